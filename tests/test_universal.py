"""Universal checkpoints (``ds_pfc.checkpoint.universal``): ZeRO tags saved on 2 CPU ranks resume on
1 and on 3 ranks.

Each case (ZeRO 1, 2, 3; fp32, bf16, bf16 with DeepSpeed's BF16_Optimizer; SGD with
and without momentum, AdamW) trains a small backbone (Linear, BatchNorm or LayerNorm
with a frozen gamma, Tanh, Linear classifier) 3 steps on 2 gloo ranks, with a Partial
FC head attached so that the tag is a real ds_pfc tag (the head learns from detached
embeddings, so the backbone's trajectory is plain PyTorch's), saves it, converts it,
and loads it on 1 and 3 ranks.

References, independent of the checkpoint path: the 2-rank run gathers its live
float32 master weights and optimizer states at save time with DeepSpeed's
``safe_get_full_*`` accessors; the step after the load is recomputed by
``torch.optim.SGD`` / ``AdamW`` on float32 copies of that state, with each rank's share
of the batch through BatchNorm separately, as on the ranks.
"""
from __future__ import annotations

import copy
import filecmp
import json
import os
import shutil

import pytest
import torch

from _dist import run_ranks

pytest.importorskip("deepspeed")

W_SAVE, GLOBAL_BATCH, STEPS = 2, 6, 3           # 6 rows split over 1, 2 and 3 ranks
D_IN, D_EMB, NUM_CLASSES, HEAD_CLASSES = 5, 7, 3, 11
SGD_LR, ADAMW_LR = 0.1, 0.01
CASES = {   # name: (ZeRO stage, precision, optimizer)
    "z1_sgd": (1, "fp32", "sgd"),               # momentum_buffer: ds_pfc's converter
    "z2_sgd_nomomentum": (2, "fp32", "sgd0"),   # no optimizer state at all
    "z3_sgd": (3, "fp32", "sgd"),               # ds_pfc's ZeRO-3 state loader
    "z1_adamw_bf16": (1, "bf16", "adamw"),      # DeepSpeed's converter
    "z1_sgd_bf16_fp32acc": (1, "bf16+fp32acc", "sgd"),   # DeepSpeed's BF16_Optimizer (bf16_zero_* files)
}
STATE_KEYS = {"sgd": ("momentum_buffer",), "sgd0": (), "adamw": ("exp_avg", "exp_avg_sq")}
TAG = "step3"
SAVED_GAMMA = 1.5


class Net(torch.nn.Module):
    """The normalisation's gamma is frozen at ``gamma``, as in the backbones' embedding
    BatchNorm; the saving runs use another value than the loading ones."""

    def __init__(self, norm: str, gamma: float = 1.0):
        super().__init__()
        torch.manual_seed(0)
        layer = torch.nn.BatchNorm1d(D_EMB) if norm == "bn" else torch.nn.LayerNorm(D_EMB)
        layer.weight.data.fill_(gamma)
        layer.weight.requires_grad_(False)
        self.body = torch.nn.Sequential(torch.nn.Linear(D_IN, D_EMB), layer, torch.nn.Tanh())
        self.cls = torch.nn.Linear(D_EMB, NUM_CLASSES)

    def forward(self, x, y, y_head=None):
        emb = self.body(x)
        loss = torch.nn.functional.cross_entropy(self.cls(emb).float(), y)
        if y_head is not None:
            loss = loss + self.head(emb.detach(), y_head)
        return loss


def _norm(case):     # BatchNorm (buffers to restore) in fp32; DeepSpeed's CPU bf16 BatchNorm does not run
    return "bn" if CASES[case][1] == "fp32" else "ln"


def _data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(STEPS + 1, GLOBAL_BATCH, D_IN, generator=g)
    y = torch.randint(0, NUM_CLASSES, (STEPS + 1, GLOBAL_BATCH), generator=g)
    y_head = torch.randint(0, HEAD_CLASSES, (STEPS + 1, GLOBAL_BATCH), generator=g)
    return x, y, y_head


def _ds_config(case, world):
    stage, precision, optimizer = CASES[case]
    lr = ADAMW_LR if optimizer == "adamw" else SGD_LR
    cfg = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
           "gradient_clipping": 0.0, "steps_per_print": 10 ** 9, "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True,
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": lr / 5, "warmup_max_lr": lr,
                                                        "warmup_num_steps": 6, "warmup_type": "linear"}}}
    if optimizer == "adamw":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                        "weight_decay": 0.1, "torch_adam": True}}
    else:
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": lr, "momentum": 0.9 if optimizer == "sgd" else 0.0,
                                                      "weight_decay": 5e-4}}
    if precision.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    if precision == "bf16+fp32acc":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def _init_deepspeed(rank, world):
    import deepspeed
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ["DS_PFC_TEST_PORT"])
    deepspeed.init_distributed(dist_backend="gloo")


def _engine(case, world, *, with_head):
    from ds_pfc import PartialFC
    from ds_pfc.deepspeed_plugin import attach, initialize
    model = Net(_norm(case), gamma=SAVED_GAMMA if with_head else 1.0)
    if with_head:
        attach(model, "head", PartialFC(HEAD_CLASSES, D_EMB, sample_rate=1.0, seed=3, optimizer="sgd",
                                        momentum=0.9, weight_decay=0.0))
    return initialize(model=model, config=_ds_config(case, world))


def _state(engine, case):
    """Full fp32 master weights and optimizer states, this rank's buffers, the lr of the
    next step and the step count (a collective: every rank gathers)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    frozen = [(n, p) for n, p in engine.module.named_parameters() if not p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in frozen], enabled=CASES[case][0] == 3):
        frozen = {n: p.detach().float().cpu().clone() for n, p in frozen}
    return {"params": {n: safe_get_full_fp32_param(p).detach().float().cpu().clone() for n, p in named},
            "frozen": frozen,
            "states": {(n, k): safe_get_full_optimizer_state(p, k).detach().float().cpu().clone()
                       for n, p in named for k in STATE_KEYS[CASES[case][2]]},
            "buffers": {n: b.detach().cpu().clone() for n, b in engine.module.named_buffers()},
            "lr": engine.get_lr(), "global_steps": engine.global_steps,
            "optimizer": type(engine.engine.optimizer).__name__}


def _rows(rank, world):
    share = GLOBAL_BATCH // world
    return slice(rank * share, (rank + 1) * share)


def _save_worker(rank, world, root):
    _init_deepspeed(rank, world)
    x, y, y_head = _data()
    rows, saved = _rows(rank, world), {}
    for case in CASES:
        engine = _engine(case, world, with_head=True)
        for step in range(STEPS):
            engine.backward(engine(x[step, rows].to(engine.dtype), y[step, rows], y_head[step, rows]))
            engine.step()
        saved[case] = _state(engine, case)
        engine.save_checkpoint(os.path.join(root, case), TAG)
    return saved


def _load_worker(rank, world, root):
    from ds_pfc.checkpoint.universal import load_universal
    _init_deepspeed(rank, world)
    x, y, _ = _data()
    rows, out = _rows(rank, world), {}
    for case in CASES:
        engine = _engine(case, world, with_head=False)
        init_buffers = {n: b.clone() for n, b in engine.module.named_buffers()}
        load_universal(engine.engine, os.path.join(root, case), TAG + "-universal")
        loaded = _state(engine, case)
        flag_after = engine.engine._config.load_universal_checkpoint
        engine.backward(engine(x[STEPS, rows].to(engine.dtype), y[STEPS, rows]))
        engine.step()
        out[case] = {"loaded": loaded, "stepped": _state(engine, case), "flag_after": flag_after,
                     "init_buffers": init_buffers}
    return out


def _reference_step(case, saved, world, dtype=torch.float32):
    """One step of plain torch.optim from the 2-rank run's gathered state: each of
    ``world`` ranks' gradient of its share of the batch (BatchNorm sees those rows
    alone) computed on a ``dtype`` copy of the float32 weights, averaged in float32,
    applied to the float32 weights."""
    optimizer = CASES[case][2]
    model = Net(_norm(case))
    model.load_state_dict({**saved["params"], **saved["frozen"], **saved["buffers"]})
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params.values(), lr=saved["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(params.values(), lr=saved["lr"], momentum=0.9 if optimizer == "sgd" else 0.0,
                              weight_decay=5e-4)
    for name, p in params.items():
        for key in STATE_KEYS[optimizer]:
            opt.state[p][key] = saved["states"][(name, key)].clone()
        if optimizer == "adamw":
            opt.state[p]["step"] = torch.tensor(float(STEPS))
    x, y, _ = _data()
    grads = []
    for r in range(world):
        rank_model = copy.deepcopy(model).to(dtype)
        rows = _rows(r, world)
        torch.nn.functional.cross_entropy(rank_model.cls(rank_model.body(x[STEPS, rows].to(dtype))).float(),
                                          y[STEPS, rows]).backward()
        grads.append({n: p.grad.float() for n, p in rank_model.named_parameters() if p.requires_grad})
    for name, p in params.items():
        p.grad = sum(g[name] for g in grads) / world
    opt.step()
    return ({n: p.detach() for n, p in params.items()},
            {(n, k): opt.state[p][k] for n, p in params.items() for k in STATE_KEYS[optimizer]})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Save on 2 ranks, convert every tag, load on 1 and on 3 ranks."""
    from ds_pfc.checkpoint.universal import to_universal
    root = str(tmp_path_factory.mktemp("universal"))
    saved = run_ranks(_save_worker, W_SAVE, root)
    for case in CASES:
        to_universal(os.path.join(root, case, TAG), workers=1, progress=False)
    loads = {world: run_ranks(_load_worker, world, root) for world in (1, 3)}
    return {"root": root, "saved": saved[0], "loads": loads}


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_load_restores_the_saved_state(runs, case, world):
    saved = runs["saved"][case]
    assert saved["global_steps"] == STEPS
    expected = {1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}
    assert saved["optimizer"] == ("BF16_Optimizer" if case == "z1_sgd_bf16_fp32acc" else expected[CASES[case][0]])
    for rank, result in enumerate(runs["loads"][world]):
        loaded = result[case]["loaded"]
        assert loaded["optimizer"] == saved["optimizer"]
        assert loaded["global_steps"] == STEPS
        assert loaded["lr"] == saved["lr"]                  # the scheduler's next lr, not the config's
        assert result[case]["flag_after"] is False          # load_universal left the config as it was
        for name, value in saved["params"].items():         # fp32 master weights, bitwise
            assert torch.equal(loaded["params"][name], value), (rank, name)
        assert saved["frozen"] and all(torch.all(v == SAVED_GAMMA) for v in saved["frozen"].values())
        for name, value in saved["frozen"].items():         # not the loading model's initial values
            assert torch.equal(loaded["frozen"][name], value), (rank, name)
        assert set(loaded["states"]) == set(saved["states"])
        for key, value in saved["states"].items():
            assert torch.equal(loaded["states"][key], value), (rank, key)
        for name, value in saved["buffers"].items():        # rank 0's running statistics, not the initial ones
            assert torch.equal(loaded["buffers"][name], value), (rank, name)
            if name.endswith("running_mean"):
                assert not torch.equal(result[case]["init_buffers"][name], value)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_next_step_matches_plain_pytorch(runs, case, world):
    saved, low_precision = runs["saved"][case], CASES[case][1] != "fp32"
    ref_params, ref_states = _reference_step(case, saved, world)
    if low_precision:    # the reference's own error when its gradients are computed in bf16 too
        own_params, own_states = _reference_step(case, saved, world, torch.bfloat16)
    refs = [(ref_params, saved["params"], own_params if low_precision else None),
            (ref_states, saved["states"], own_states if low_precision else None)]
    for result in runs["loads"][world]:
        stepped = result[case]["stepped"]
        for (ref, before, own), got in zip(refs, (stepped["params"], stepped["states"])):
            assert set(got) == set(ref)
            for key, value in ref.items():
                if not low_precision:
                    torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6)
                    continue
                change, own_error = (value - before[key]).norm(), (own[key] - value).norm()
                assert change > 0
                assert (got[key] - value).norm() <= 2 * own_error + 0.005 * change, \
                    (key, float((got[key] - value).norm()), float(own_error), float(change))
        assert all(not torch.equal(stepped["params"][n], saved["params"][n]) for n in saved["params"])


def test_converted_tag_is_a_complete_ds_pfc_tag(runs):
    from ds_pfc.deepspeed_plugin import COMPLETE_MARKER
    from ds_pfc.checkpoint.universal import is_universal
    for case, (stage, _, optimizer) in CASES.items():
        src = os.path.join(runs["root"], case, TAG)
        dst = src + "-universal"
        with open(os.path.join(src, COMPLETE_MARKER)) as f:
            src_marker = json.load(f)
        with open(os.path.join(dst, COMPLETE_MARKER)) as f:
            marker = json.load(f)
        assert is_universal(dst) and not is_universal(src)
        assert marker["universal"]["source_tag"] == TAG and marker["universal"]["zero_stage"] == stage
        assert marker["universal"]["converter"] == ("deepspeed" if optimizer == "adamw" else "ds_pfc")
        assert set(STATE_KEYS[optimizer]) <= set(marker["universal"]["optimizer_states"])
        assert {k: v for k, v in marker.items() if k not in ("tag", "universal", "engine_files")} == \
            {k: v for k, v in src_marker.items() if k not in ("tag", "engine_files")}
        assert marker["tag"] == TAG + "-universal"
        copied = [e for e in os.listdir(src) if e.startswith(("head-rank", "rank_state-"))]
        assert len(copied) == 2 * W_SAVE
        for entry in copied:
            assert filecmp.cmp(os.path.join(src, entry), os.path.join(dst, entry), shallow=False)
        on_disk = {os.path.relpath(os.path.join(d, f), dst): os.path.getsize(os.path.join(d, f))
                   for d, _, files in os.walk(dst) for f in files}
        assert marker["engine_files"] == {k: v for k, v in on_disk.items() if k not in copied + [COMPLETE_MARKER]}
        assert any(k.startswith("zero" + os.sep) for k in marker["engine_files"])
        assert not [e for e in os.listdir(os.path.dirname(src)) if e.startswith(".")]     # no scratch left


@pytest.mark.parametrize("case", ["z1_sgd", "z3_sgd"])
def test_universal_state_dict_holds_the_master_weights(runs, case):
    from ds_pfc.checkpoint.universal import universal_state_dict
    saved = runs["saved"][case]
    state = universal_state_dict(os.path.join(runs["root"], case, TAG + "-universal"))
    assert list(state) == list(Net(_norm(case)).state_dict())
    for name, value in {**saved["params"], **saved["frozen"], **saved["buffers"]}.items():
        assert torch.equal(state[name], value), name


def test_ds_pfc_converter_writes_what_deepspeeds_writes(runs, tmp_path):
    """On Adam's states both converters run: ds_pfc's must give DeepSpeed's files."""
    from ds_pfc.checkpoint.universal import to_universal
    src = os.path.join(runs["root"], "z1_adamw_bf16", TAG)
    ours = to_universal(src, str(tmp_path / "ours"), impl="ds_pfc", progress=False)
    theirs = src + "-universal"
    params = sorted(e for e in os.listdir(os.path.join(ours, "zero")) if e != "optimizer_state.pt")
    assert params == sorted(e for e in os.listdir(os.path.join(theirs, "zero")) if e != "optimizer_state.pt")
    for name in params:
        files = sorted(os.listdir(os.path.join(ours, "zero", name)))
        frozen = name in runs["saved"]["z1_adamw_bf16"]["frozen"]
        assert files == (["fp32.pt"] if frozen else ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"])
        assert files == sorted(os.listdir(os.path.join(theirs, "zero", name)))
        for file in files:
            a, b = (torch.load(os.path.join(d, "zero", name, file), weights_only=False) for d in (ours, theirs))
            if isinstance(a, dict):
                assert a.get("cat_dim", 0) == b.get("cat_dim", 0)   # DeepSpeed omits it for frozen parameters
                a, b = a["param"], b["param"]
            assert torch.equal(a, b), (name, file)
    a, b = (torch.load(os.path.join(d, "zero", "optimizer_state.pt"), weights_only=False) for d in (ours, theirs))
    assert a.keys() == b.keys() and a["param_groups"] == b["param_groups"]


def test_needs_universal_and_loadable_tag(runs, tmp_path):
    from ds_pfc.deepspeed_plugin import COMPLETE_MARKER
    from ds_pfc.checkpoint.universal import UniversalCheckpointError, loadable_tag, needs_universal, to_universal
    root = os.path.join(runs["root"], "z1_sgd")
    src = os.path.join(root, TAG)
    assert needs_universal(src, 1) and needs_universal(src, 3) and not needs_universal(src, W_SAVE)
    assert not needs_universal(src + "-universal", 1)
    assert loadable_tag(root, TAG, W_SAVE) == (TAG, False)
    assert loadable_tag(root, TAG, 3) == (TAG + "-universal", True)
    assert loadable_tag(root, TAG + "-universal", 3) == (TAG + "-universal", True)
    # Without the converted sibling: the error says how to convert.
    other = tmp_path / "ckpt"
    os.makedirs(other)
    os.symlink(src, other / TAG)
    with pytest.raises(UniversalCheckpointError, match=r"launch/export.py universal --checkpoint .* --tag step3"):
        loadable_tag(str(other), TAG, 3)
    # A sibling converted from an earlier save of the same tag is not used.
    stale = tmp_path / "stale"
    shutil.copytree(src, stale / TAG)
    os.symlink(src + "-universal", stale / (TAG + "-universal"))
    marker = json.loads((stale / TAG / COMPLETE_MARKER).read_text())
    (stale / TAG / COMPLETE_MARKER).write_text(json.dumps(dict(marker, metadata={"attempt": 2})))
    with pytest.raises(UniversalCheckpointError, match="not converted from the current"):
        loadable_tag(str(stale), TAG, 3)
    with pytest.raises(FileExistsError):
        to_universal(src, progress=False)
    with pytest.raises(UniversalCheckpointError, match="already universal"):
        to_universal(src + "-universal", progress=False)
    with pytest.raises(UniversalCheckpointError, match="Adam"):
        to_universal(src, str(tmp_path / "x"), impl="deepspeed", progress=False)
    with pytest.raises(ValueError, match="impl"):
        to_universal(src, str(tmp_path / "x"), impl="fast", progress=False)
    with pytest.raises(ValueError, match="workers"):
        to_universal(src, str(tmp_path / "x"), workers=0, progress=False)
    assert not os.path.exists(tmp_path / "x")


def test_stage0_and_incomplete_tags_are_refused(tmp_path):
    from ds_pfc.deepspeed_plugin import COMPLETE_MARKER, CheckpointIncompleteError
    from ds_pfc.checkpoint.universal import UniversalCheckpointError, needs_universal, to_universal
    tag = tmp_path / "step1"
    os.makedirs(tag)
    torch.save({"module": {}, "optimizer": {}}, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointIncompleteError):
        to_universal(str(tag), progress=False)
    (tag / COMPLETE_MARKER).write_text(json.dumps({"tag": "step1", "world_size": 2, "global_steps": 1,
                                                   "heads": [], "metadata": {}}))
    assert not needs_universal(str(tag), 5)         # ZeRO 0 loads at any world size
    with pytest.raises(UniversalCheckpointError, match="ZeRO stage 0.*any world size"):
        to_universal(str(tag), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["step1"]
