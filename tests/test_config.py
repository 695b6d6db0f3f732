"""The ds_pfc config block: strict parsing, clear errors, warnings, and that the head
it builds is the head the same arguments build directly."""
import json
import warnings

import pytest
import torch

from ds_pfc import ArcFace, CombinedMargin, CosFace, PartialFC
from ds_pfc.bank import TieredBank
from ds_pfc.app.config import ConfigError, DsPfcConfig, from_dict, split_config

BASE = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0}


def _config(head: dict, **top) -> dict:
    return {**BASE, **top, "ds_pfc": {"head": head}}


def test_head_from_config_equals_the_directly_built_head():
    ds, pfc = split_config(json.loads(json.dumps(_config({
        "num_classes": 1021, "embedding_size": 7, "sample_rate": 0.3, "seed": 5, "filter_threshold": 0.4,
        "compute_dtype": "bf16", "margin": {"type": "cosface", "scale": 32, "margin": 0.35}, "block_bytes": 65536,
        "backend": "torch", "optimizer": {"type": "sgd", "momentum": 0.8, "weight_decay": 1e-3, "lr_ratio": 2.0}}))))
    assert ds == BASE                                 # the block is removed, nothing else
    head = pfc.head.build()
    direct = PartialFC(1021, 7, sample_rate=0.3, seed=5, filter_threshold=0.4, compute_dtype=torch.bfloat16,
                       margin=CosFace(32.0, 0.35), optimizer="sgd", momentum=0.8, weight_decay=1e-3)
    assert torch.equal(head.centers(), direct.centers())
    assert (head.sample_rate, head.filter_threshold, head.compute_dtype) == (0.3, 0.4, torch.bfloat16)
    assert (head.block_bytes, head.backend) == (65536, "torch")
    assert isinstance(head.margin, CosFace) and (head.margin.scale, head.margin.m3) == (32.0, 0.35)
    assert (head.optimizer.momentum, head.optimizer.weight_decay) == (0.8, 1e-3)
    assert pfc.head.optimizer.lr_ratio == 2.0
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(9, 7, generator=g), torch.randint(0, 1021, (9,), generator=g)
    assert head(x, y).item() == direct(x, y).item()


@pytest.mark.parametrize("margin, expected", [
    ({}, ArcFace(64.0, 0.5)),
    ({"type": "arcface", "margin": 0.3, "straight_through": True}, ArcFace(64.0, 0.3, straight_through=True)),
    ({"type": "cosface"}, CosFace(64.0, 0.4)),
    ({"type": "combined", "scale": 30, "m1": 1.1, "m2": 0.2, "m3": 0.1}, CombinedMargin(30.0, 1.1, 0.2, 0.1)),
])
def test_margins(margin, expected):
    _, pfc = split_config(_config({"num_classes": 11, "margin": margin}))
    got = pfc.head.margin.build()
    assert type(got) is type(expected)
    assert (got.scale, got.m1, got.m2, got.m3, got.straight_through) == \
        (expected.scale, expected.m1, expected.m2, expected.m3, expected.straight_through)


def test_optimizer_defaults_follow_the_type():
    _, pfc = split_config(_config({"num_classes": 11, "optimizer": {"type": "adamw"}}))
    head = pfc.head.build()
    assert head.optimizer.weight_decay == 0.01 and head.optimizer.betas == (0.9, 0.999)
    _, pfc = split_config(_config({"num_classes": 11}))
    assert pfc.head.build().optimizer.weight_decay == 5e-4


def test_bank_placements_build_a_tiered_bank():
    _, pfc = split_config(_config({"num_classes": 101, "embedding_size": 4,
                                   "bank": {"default": "host", "placements": {"weight": ["host", "bf16"]}}}))
    head = pfc.head.build()
    assert isinstance(head.bank, TieredBank)
    assert head.bank.store("weight").dtype == torch.bfloat16 and head.bank.store("weight").tier == "host"
    assert head.bank.store("momentum_buffer").tier == "host"
    head.close()
    _, pfc = split_config(_config({"num_classes": 101}))
    assert pfc.head.bank.build() is None


@pytest.mark.parametrize("head, needle", [
    ({"num_classes": 10, "smaple_rate": 0.1}, "unknown key ['smaple_rate']"),
    ({"num_classes": 10, "margin": {"typ": "arcface"}}, "ds_pfc.head.margin: unknown key ['typ']"),
    ({"num_classes": 10, "optimizer": {"lr": 0.1}}, "ds_pfc.head.optimizer: unknown key ['lr']"),
    ({"num_classes": 10, "bank": {"tier": "host"}}, "ds_pfc.head.bank: unknown key ['tier']"),
    ({}, "missing required key ['num_classes']"),
    ({"num_classes": "10"}, "ds_pfc.head.num_classes must be int"),
    ({"num_classes": 0}, "ds_pfc.head.num_classes must be a positive integer"),
    ({"num_classes": 10, "sample_rate": 0}, "ds_pfc.head.sample_rate must be > 0"),
    ({"num_classes": 10, "sample_rate": 1.5}, "ds_pfc.head.sample_rate must be <= 1"),
    ({"num_classes": 10, "filter_threshold": 2}, "ds_pfc.head.filter_threshold must be <= 1"),
    ({"num_classes": 10, "compute_dtype": "int8"}, "ds_pfc.head.compute_dtype must be one of"),
    ({"num_classes": 10, "block_bytes": 0}, "ds_pfc.head.block_bytes must be null or a positive integer"),
    ({"num_classes": 10, "block_bytes": "256MiB"}, "ds_pfc.head.block_bytes must be int or NoneType"),
    ({"num_classes": 10, "keep_bytes": -1}, "ds_pfc.head.keep_bytes must be null or a non-negative integer"),
    ({"num_classes": 10, "backend": "cuda"}, "ds_pfc.head.backend must be one of"),
    ({"num_classes": 10, "margin": {"type": "sphere"}}, "ds_pfc.head.margin.type must be"),
    ({"num_classes": 10, "margin": {"type": "arcface", "m3": 0.2}}, "['m3'] do not apply to type 'arcface'"),
    ({"num_classes": 10, "margin": {"type": "combined", "margin": 0.2}}, "['margin'] do not apply to type 'combined'"),
    ({"num_classes": 10, "margin": {"type": "cosface", "h": 0.2}}, "['h'] do not apply to type 'cosface'"),
    ({"num_classes": 10, "margin": {"type": "adaface", "t_alpha": 2.0}}, "t_alpha"),
    ({"num_classes": 10, "margin": {"type": "sphereface"}}, "margin.type must be one of"),
    ({"num_classes": 10, "sub_centers": 0}, "sub_centers must be a positive integer"),
    ({"num_classes": 10, "optimizer": {"type": "lamb"}}, "ds_pfc.head.optimizer.type must be sgd or adamw"),
    ({"num_classes": 10, "bank": {"default": "ssd"}}, "ds_pfc.head.bank.default tier must be one of"),
    ({"num_classes": 10, "bank": {"placements": {"weight": ["host", "int8"]}}},
     "ds_pfc.head.bank.placements.weight[1] must be one of"),
    ({"num_classes": 10, "bank": {"default": "nvme"}}, "ds_pfc.head.bank.default: tier 'nvme' is not a per-step tier"),
    ({"num_classes": 10, "bank": {"placements": {"weight": ["nvme", "bf16"]}}},
     "ds_pfc.head.bank.placements.weight: tier 'nvme' is not a per-step tier"),
    ({"num_classes": 10, "bank": {"nvme_dir": "/nvme"}}, "nvme_dir"),
])
def test_bad_config_names_the_key(head, needle):
    with pytest.raises(ConfigError) as err:
        split_config(_config(head))
    assert needle in str(err.value)


def test_unknown_block_keys_and_missing_block():
    with pytest.raises(ConfigError, match=r"ds_pfc: unknown key \['heads'\] \(did you mean 'head'\?\); allowed keys are \['backbone', 'checkpoint', 'data', 'description', 'evaluation', 'head', 'train'\]"):
        split_config({**BASE, "ds_pfc": {"heads": {}}})
    with pytest.raises(ConfigError, match="no 'ds_pfc' block"):
        split_config(BASE)
    with pytest.raises(ConfigError, match="must be an object"):
        from_dict(DsPfcConfig, [1, 2])


def test_top_level_typos_are_refused_and_missing_clipping_warns():
    typo = {"train_micro_batch_size_per_gpuu": 8, "gradient_clipping": 0.0, "ds_pfc": {"head": {"num_classes": 3}}}
    with pytest.raises(ConfigError, match=r"top-level config key \['train_micro_batch_size_per_gpuu'\] is not a "
                                          r"DeepSpeed key \(DeepSpeed would ignore it; did you mean "
                                          r"'train_micro_batch_size_per_gpu'\?\): fix or remove it"):
        split_config(typo)
    with pytest.raises(ConfigError, match=r"keys \['bacth', 'zzz'\] are not DeepSpeed keys"):
        split_config(_config({"num_classes": 3}, bacth=1, zzz=2))
    # a config stored with a model, read back (strict=False), only warns
    with pytest.warns(UserWarning, match="train_micro_batch_size_per_gpuu"):
        assert split_config(typo, strict=False)[1].head.num_classes == 3
    with pytest.warns(UserWarning, match="gradient_clipping"):
        split_config({"train_micro_batch_size_per_gpu": 8, "ds_pfc": {"head": {"num_classes": 3}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # an editor's "$schema" is allowed
        split_config(_config({"num_classes": 3}, **{"$schema": "./ds_pfc.schema.json"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # a clean config warns about nothing
        split_config(_config({"num_classes": 3}, bf16={"enabled": True}, zero_optimization={"stage": 1}))


def test_keys_removed_from_deepspeed_are_refused():
    with pytest.raises(ConfigError, match=r"\['amp'\] were removed from DeepSpeed"):
        split_config({**BASE, "amp": {"enabled": True}, "ds_pfc": {"head": {"num_classes": 3}}})


@pytest.mark.parametrize("value", [-1, float("nan"), "30", True])
def test_checkpoint_every_minutes_is_a_number_of_minutes(value):
    config = _config({"num_classes": 10})
    config["ds_pfc"]["checkpoint"] = {"every_minutes": value}
    with pytest.raises(ConfigError, match="ds_pfc.checkpoint.every_minutes must be|every_minutes must be"):
        split_config(config)


def test_keep_bytes_reaches_the_head():
    config = _config({"num_classes": 10, "keep_bytes": 0})
    config["ds_pfc"]["checkpoint"] = {"every_minutes": 30}
    _, pfc = split_config(config)
    assert pfc.checkpoint.every_minutes == 30.0
    head = pfc.head.build()
    try:
        assert head.keep_bytes == 0
    finally:
        head.close()


@pytest.mark.parametrize("value, needle", [
    ("SIGTERM", "preempt_signals must be list"),
    ([15], "must be a list of signal names"),
    (["SIGKILL"], "'SIGKILL' is not a signal that can be caught"),
    (["SIGNOPE"], "'SIGNOPE' is not a signal"),
    (["SIG_IGN"], "'SIG_IGN' is not a signal"),
])
def test_preempt_signals_are_catchable_signal_names(value, needle):
    config = _config({"num_classes": 10})
    config["ds_pfc"]["train"] = {"preempt_signals": value}
    with pytest.raises(ConfigError, match=needle):
        split_config(config)
    config["ds_pfc"]["train"] = {"preempt_signals": ["SIGUSR2"]}
    assert split_config(config)[1].train.preempt_signals == ["SIGUSR2"]


@pytest.mark.parametrize("train, needle", [
    ({"on_nonfinite": "ignore"}, "on_nonfinite must be one of \\['stop', 'skip', 'rollback'\\]"),
    ({"on_nonfinite": "skip", "max_consecutive_skips": 0}, "max_consecutive_skips must be a positive integer"),
    ({"on_nonfinite": "rollback", "rollback_lr_factor": 0}, "rollback_lr_factor must be > 0"),
    ({"on_nonfinite": "rollback", "rollback_lr_factor": 1.5}, "rollback_lr_factor must be <= 1"),
    ({"on_nonfinite": "rollback", "max_rollbacks": -1}, "max_rollbacks must be a positive integer"),
])
def test_on_nonfinite_settings_are_checked(train, needle):
    config = _config({"num_classes": 10})
    config["ds_pfc"]["train"] = train
    with pytest.raises(ConfigError, match=needle):
        split_config(config)
    config["ds_pfc"]["train"] = {"on_nonfinite": "rollback", "rollback_lr_factor": 0.25, "max_rollbacks": 2}
    train = split_config(config)[1].train
    assert (train.on_nonfinite, train.rollback_lr_factor, train.max_rollbacks) == ("rollback", 0.25, 2)
    assert split_config(_config({"num_classes": 10}))[1].train.on_nonfinite == "stop"


class _Recording(dict):
    """A dict that records every key looked up in it (get, [], in, in .keys())."""

    def __init__(self, data, seen):
        super().__init__(data)
        self.seen = seen

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self):
        seen = self.seen

        class Keys(list):
            def __contains__(self, key):
                seen.add(key)
                return list.__contains__(self, key)
        return Keys(super().keys())


def test_the_top_level_keys_are_the_ones_deepspeed_reads():
    """DEEPSPEED_TOP_LEVEL_KEYS (refused otherwise) against the keys DeepSpeed's own parser,
    DeepSpeedConfig, looks up at the top level of a config (minus the removed ones it looks
    for to refuse them)."""
    from unittest import mock

    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    from ds_pfc.app.config import DEEPSPEED_REMOVED_KEYS, DEEPSPEED_TOP_LEVEL_KEYS
    seen = set()
    config = _Recording({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                         "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, seen)
    with mock.patch.object(deepspeed.comm, "get_world_size", return_value=1), \
            mock.patch.object(deepspeed.comm, "get_rank", return_value=0), \
            mock.patch.object(deepspeed.comm, "is_initialized", return_value=True):
        DeepSpeedConfig(config)
    read = {key for key in seen if isinstance(key, str)}
    assert DEEPSPEED_REMOVED_KEYS <= read
    assert sorted(read - DEEPSPEED_REMOVED_KEYS) == sorted(DEEPSPEED_TOP_LEVEL_KEYS)
