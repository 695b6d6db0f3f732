"""DeepSpeed idioms around Partial FC heads: each one gives the result of the plain
``engine.backward(loss)`` training, or is refused with an error that says what to do.

- Backward with gradient accumulation (GAS 2): ``engine.backward(loss)``,
  ``loss.backward()`` and ``engine.scale(loss).backward()`` at ZeRO 0-3 under fp32,
  bf16 and fp16. DeepSpeed divides the gradient of the engine's outputs by GAS when
  the backward does not go through ``engine.backward``; a head applied to those
  outputs must get the same division. References: the ``engine.backward`` run of the
  same stage and precision, and (fp32) one SGD step computed in float64 by plain
  PyTorch on the mean loss of the two micro batches. fp16 runs as in
  test_loss_scaling.py (DeepSpeed's CPU accelerator is told fp16 is supported).
- ``deepspeed.zero.Init``: a head built inside it is refused (it would get half-precision
  optimizer state); a head built outside, next to a model built inside, keeps float32.
- Activation checkpointing around the head (torch reentrant and non-reentrant,
  ``deepspeed.checkpointing.checkpoint``): refused; around the backbone: the plain result.
- Sequence parallelism: refused at initialize.
- Pipeline x tensor parallelism: a ``head_spec(shard="model")`` head shards its classes
  over the pipeline grid's tensor-slicing group.
- Private DeepSpeed attributes: each one ds_pfc reads, removed, gives an error naming
  it and the installed DeepSpeed version.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

from _dist import free_port, run_ranks

deepspeed = pytest.importorskip("deepspeed")

D_IN, D, C, N, LR, GAS = 16, 8, 10, 4, 1.0, 2
SCALE, MARGIN = 4.0, 0.2
STAGES, PRECISIONS, IDIOMS = (0, 1, 2, 3), ("fp32", "bf16", "fp16"), ("engine", "torch", "scale")


def _config(stage, precision, gas=GAS):
    cfg = {"train_micro_batch_size_per_gpu": N, "gradient_accumulation_steps": gas, "steps_per_print": 10 ** 9,
           "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": LR}},
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _head():
    from ds_pfc import CosFace, PartialFC
    return PartialFC(C, D, sample_rate=1.0, margin=CosFace(SCALE, MARGIN), optimizer="sgd", momentum=0.0,
                     weight_decay=0.0, device="cpu")


class _HeadInside(torch.nn.Module):
    """The head called inside the module's forward: the engine's output is the loss."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Linear(D_IN, D)

    def forward(self, x, y):
        return self.identity(self.backbone(x).float(), y)


def _micro_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(N, D_IN, generator=g), torch.randint(0, C, (N,), generator=g)) for _ in range(GAS)]


def _gathered_weight(engine, param):
    with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
        return param.detach().float().clone()


def _train(stage, precision, idiom, *, inside=False):
    """One optimizer step (GAS micro batches); the backbone's and the head's update, or
    the error the idiom raised."""
    from ds_pfc.deepspeed_plugin import attach, initialize
    torch.manual_seed(0)
    model = _HeadInside() if inside else torch.nn.Linear(D_IN, D)
    linear = model.backbone if inside else model
    linear.weight.data.mul_(20.0)         # embeddings of norm ~50: fp16 gradients stay in range
    head = _head()
    if inside:
        attach(model, "identity", head)
    w0 = linear.weight.detach().clone()
    b0 = linear.bias.detach().clone()
    engine = initialize(model=model, config=_config(stage, precision), heads=None if inside else {"identity": head})
    param = engine.module.backbone.weight if inside else engine.module.weight
    start_w, c0 = _gathered_weight(engine, param), head.centers().clone()
    try:
        for x, y in _micro_batches():
            x = x.to(engine.dtype)
            loss = engine(x, y) if inside else head(engine(x).float(), y)
            if idiom == "engine":
                engine.backward(loss)
            elif idiom == "torch":
                loss.backward()
            else:
                engine.scale(loss).backward()
            engine.step()
    except Exception as err:        # the refusal under test
        return {"error": f"{type(err).__name__}: {err}"}
    return {"w0": w0, "b0": b0, "c0": c0, "backbone": _gathered_weight(engine, param) - start_w,
            "head": head.centers() - c0, "step_count": head.step_count}


def _reference(w0, b0, c0):
    """float64 SGD update of the backbone weight and the centers: the gradient of the
    mean CosFace loss over the GAS micro batches."""
    w = w0.double().clone().requires_grad_(True)
    b = b0.double().clone().requires_grad_(True)
    c = c0.double().clone().requires_grad_(True)
    total = 0.0
    for x, y in _micro_batches():
        cos = F.normalize(x.double() @ w.T + b) @ F.normalize(c).T
        total = total + F.cross_entropy(SCALE * (cos - MARGIN * F.one_hot(y, C)), y) / GAS
    total.backward()
    return -LR * w.grad, -LR * c.grad


@contextlib.contextmanager
def _without(obj, name):
    """``obj`` (or the class that defines ``name`` for it) without attribute ``name``."""
    owner = obj if name in vars(obj) else next(k for k in type(obj).__mro__ if name in vars(k))
    value = vars(owner)[name]
    delattr(owner, name)
    try:
        yield
    finally:
        setattr(owner, name, value)


def _error(fn):
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _internals():
    """For each private DeepSpeed attribute ds_pfc reads: the error when it is missing."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import groups

    from ds_pfc import deepspeed_plugin as plugin
    from ds_pfc.deepspeed_plugin import checkpointing, groups as plugin_groups, heads, loss_scaling
    out = {}

    autocast = {**_config(0, "fp32", gas=1), "torch_autocast": {"enabled": True, "dtype": "float16"}}
    engine = plugin.initialize(model=torch.nn.Linear(D_IN, D), config=autocast, heads={"identity": _head()})
    inner = engine.engine
    with _without(inner, "torch_autocast_z0_gradscaler"):
        out["torch_autocast_z0_gradscaler"] = _error(lambda: plugin.loss_scale(inner))
    scaler, inner.torch_autocast_z0_gradscaler = inner.torch_autocast_z0_gradscaler, None
    out["torch_autocast_z0_gradscaler=None"] = _error(lambda: plugin.loss_scale(inner))
    inner.torch_autocast_z0_gradscaler = scaler

    autocast["zero_optimization"] = {"stage": 1}
    engine = plugin.initialize(model=torch.nn.Linear(D_IN, D), config=autocast, heads={"identity": _head()})
    with _without(engine.engine.optimizer, "torch_autocast_gradscaler"):
        out["torch_autocast_gradscaler"] = _error(lambda: plugin.loss_scale(engine.engine))

    engine = plugin.initialize(model=torch.nn.Linear(D_IN, D), config=_config(0, "fp16", gas=1),
                               heads={"identity": _head()})
    with _without(engine.engine.optimizer, "_update_scale"):
        out["_update_scale"] = _error(lambda: loss_scaling._lower_loss_scale(engine.engine))

    head = _head()
    engine = plugin.initialize(model=torch.nn.Linear(D_IN, D), config=_config(0, "fp32", gas=1),
                               heads={"identity": head})
    inner = engine.engine
    x, y = _micro_batches()[0]
    engine.backward(head(engine(x), y))
    with _without(inner, "managed_gradient_accumulation"):
        out["managed_gradient_accumulation"] = _error(engine.step)
    entries = {"identity": heads._Attached(head, 1.0)}
    for name in ("gradient_average", "sequence_parallel_size"):
        with _without(inner, name):
            out[name] = _error(lambda: plugin_groups._check_engine(inner, entries))
    for name in ("data_parallel_group", "mpu"):
        with _without(inner, name):
            out[name] = _error(lambda: plugin_groups._EngineGroups.of(inner, None))
    with _without(groups, "_TENSOR_MODEL_PARALLEL_GROUP"):
        out["_TENSOR_MODEL_PARALLEL_GROUP"] = _error(lambda: plugin_groups._tensor_parallel_group(inner, None))
    with _without(inner, "checkpoint_engine"):
        out["checkpoint_engine"] = _error(lambda: checkpointing._wait_for_commit(inner))
    with _without(inner.checkpoint_engine, "is_decoupled"):
        out["is_decoupled"] = _error(lambda: checkpointing._wait_for_commit(inner))
    inner.checkpoint_engine.is_decoupled = lambda: True
    with _without(DeepSpeedEngine, "_commit_decoupled_checkpoint"):
        out["_commit_decoupled_checkpoint"] = _error(lambda: checkpointing._wait_for_commit(inner))
    del inner.checkpoint_engine.is_decoupled
    return out


def _zero_init():
    """Heads built inside zero.Init (refused) and outside it (float32 state)."""
    from ds_pfc import PartialFC
    from ds_pfc.deepspeed_plugin import initialize
    out = {}
    for precision, optimizer in (("bf16", {"optimizer": "sgd", "momentum": 0.9}), ("fp16", {"optimizer": "adamw"})):
        cfg = _config(3, precision, gas=1)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            out[f"inside-{precision}"] = _error(lambda: PartialFC(C, D, device="cpu", **optimizer))
    cfg = _config(3, "bf16", gas=1)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = torch.nn.Linear(D_IN, D)
    head = PartialFC(C, D, device="cpu", optimizer="adamw")
    engine = initialize(model=model, config=cfg, heads={"identity": head})
    x, y = _micro_batches()[0]
    engine.backward(head(engine(x.to(engine.dtype)).float(), y))
    engine.step()
    out["outside"] = {name: head.bank.export(name).dtype for name in head.bank.state_names()}
    out["outside-steps"] = head.step_count
    return out


def _one_rank(rank, world_size, port):
    from deepspeed.accelerator import get_accelerator
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    type(get_accelerator()).is_fp16_supported = lambda self: True
    deepspeed.init_distributed(dist_backend="gloo")
    out = {"version": deepspeed.__version__}
    for stage in STAGES:
        for precision in PRECISIONS:
            for idiom in IDIOMS:
                out[(stage, precision, idiom)] = _train(stage, precision, idiom)
    for stage in (1, 3):
        for idiom in ("engine", "torch"):
            out[("inside", stage, idiom)] = _train(stage, "fp32", idiom, inside=True)
    out["internals"] = _internals()
    out["zero_init"] = _zero_init()
    return out


@pytest.fixture(scope="module")
def one_rank():
    return run_ranks(_one_rank, 1, free_port())[0]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", (1, 2, 3))
def test_direct_backward_with_accumulation_matches_engine_backward(one_rank, stage, precision):
    ref = one_rank[(stage, precision, "engine")]
    assert "error" not in ref, ref
    tol = 1e-5 if precision == "fp32" else 2e-2
    for idiom in ("torch", "scale"):
        got = one_rank[(stage, precision, idiom)]
        if precision == "fp16" and idiom == "torch":
            # DeepSpeed refuses an unscaled backward under fp16 and names the calls to use.
            assert "engine.scale(loss).backward()" in got.get("error", ""), got
            continue
        assert "error" not in got, got
        assert got["step_count"] == 1
        assert _rel(got["backbone"], ref["backbone"]) < tol, (idiom, _rel(got["backbone"], ref["backbone"]))
        assert _rel(got["head"], ref["head"]) < tol, (idiom, _rel(got["head"], ref["head"]))


@pytest.mark.parametrize("stage", STAGES)
def test_fp32_updates_match_float64(one_rank, stage):
    for idiom in IDIOMS:
        got = one_rank[(stage, "fp32", idiom)]
        if "error" in got:
            continue            # ZeRO 0: see test_zero0_accepts_only_engine_backward
        ref_w, ref_c = _reference(got["w0"], got["b0"], got["c0"])
        assert _rel(got["backbone"], ref_w) < 1e-4, (idiom, _rel(got["backbone"], ref_w))
        assert _rel(got["head"], ref_c) < 1e-4, (idiom, _rel(got["head"], ref_c))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_zero0_accepts_only_engine_backward(one_rank, precision):
    assert "error" not in one_rank[(0, precision, "engine")]
    for idiom in ("torch", "scale"):
        assert "engine.backward(loss)" in one_rank[(0, precision, idiom)].get("error", ""), idiom


@pytest.mark.parametrize("stage", (1, 3))
def test_head_inside_the_module_gets_the_division_once(one_rank, stage):
    for idiom in ("engine", "torch"):
        got = one_rank[("inside", stage, idiom)]
        assert "error" not in got, got
        ref_w, ref_c = _reference(got["w0"], got["b0"], got["c0"])
        assert _rel(got["backbone"], ref_w) < 1e-4 and _rel(got["head"], ref_c) < 1e-4, idiom


INTERNALS = ("torch_autocast_z0_gradscaler", "torch_autocast_gradscaler", "_update_scale",
             "managed_gradient_accumulation", "gradient_average", "sequence_parallel_size", "data_parallel_group",
             "mpu", "_TENSOR_MODEL_PARALLEL_GROUP", "checkpoint_engine", "is_decoupled",
             "_commit_decoupled_checkpoint")


@pytest.mark.parametrize("name", INTERNALS)
def test_missing_deepspeed_internal_is_named_with_the_version(one_rank, name):
    message = one_rank["internals"][name]
    assert message.startswith("DeepSpeedInternalsError"), message
    assert f".{name} is missing" in message and f"DeepSpeed {one_rank['version']}" in message, message


def test_float16_autocast_without_its_scaler_is_an_error(one_rank):
    message = one_rank["internals"]["torch_autocast_z0_gradscaler=None"]
    assert message.startswith("DeepSpeedInternalsError") and "torch_autocast_z0_gradscaler is None" in message
    assert one_rank["version"] in message


@pytest.mark.parametrize("precision", ("bf16", "fp16"))
def test_head_built_inside_zero_init_is_refused(one_rank, precision):
    message = one_rank["zero_init"][f"inside-{precision}"]
    assert message.startswith("RuntimeError") and "deepspeed.zero.Init" in message, message
    assert "Build the head outside" in message


def test_head_built_outside_zero_init_keeps_float32(one_rank):
    dtypes = one_rank["zero_init"]["outside"]
    assert {"weight", "exp_avg", "exp_avg_sq"} <= set(dtypes), dtypes
    assert all(dtype == torch.float32 for dtype in dtypes.values() if dtype.is_floating_point), dtypes
    assert one_rank["zero_init"]["outside-steps"] == 1


# -- activation checkpointing (single process, no DeepSpeed engine) ----------------------

def _checkpointed(kind):
    """Backbone gradient and sampler position after one backward of a sampled head
    (``sample_rate`` 0.3: a recomputation would draw another class set)."""
    import torch.utils.checkpoint as torch_checkpoint

    from ds_pfc import PartialFC
    torch.manual_seed(0)
    backbone = torch.nn.Linear(6, 4)
    head = PartialFC(40, 4, sample_rate=0.3, device="cpu", seed=1)
    x, y = torch.randn(5, 6), torch.randint(0, 40, (5,))
    if kind == "backbone":          # what to do instead: checkpoint the backbone, not the head
        loss = head(torch_checkpoint.checkpoint(backbone, x.requires_grad_(True), use_reentrant=False), y)
    else:
        e = backbone(x)
        if kind == "plain":
            loss = head(e, y)
        elif kind == "torch-non-reentrant":
            loss = torch_checkpoint.checkpoint(head, e, y, use_reentrant=False)
        elif kind == "torch-reentrant":
            loss = torch_checkpoint.checkpoint(head, e, y, use_reentrant=True)
        else:
            loss = deepspeed.checkpointing.checkpoint(head, e, y)
    loss.backward()
    return backbone.weight.grad, head.sample_step


@pytest.mark.parametrize("kind", ("torch-non-reentrant", "torch-reentrant", "deepspeed"))
def test_checkpointing_the_head_is_refused(kind):
    with pytest.raises(RuntimeError, match="Checkpoint the backbone blocks, not the head"):
        _checkpointed(kind)


def test_checkpointing_the_backbone_gives_the_plain_result():
    grad, steps = _checkpointed("backbone")
    plain_grad, plain_steps = _checkpointed("plain")
    assert steps == plain_steps == 1
    torch.testing.assert_close(grad, plain_grad, rtol=1e-6, atol=1e-7)


# -- two ranks: sequence parallelism, pipeline x tensor parallelism ----------------------

class _SequenceParallelMpu:
    """Two ranks as one sequence-parallel group of 2 (data parallel size 1)."""

    def __init__(self):
        import torch.distributed as dist
        self.rank = dist.get_rank()
        self.own = [dist.new_group([q]) for q in range(2)][self.rank]
        self.both = dist.new_group([0, 1])

    def get_data_parallel_group(self):
        return self.own

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0

    get_model_parallel_group = get_tensor_model_parallel_group = get_data_parallel_group
    get_model_parallel_world_size = get_tensor_model_parallel_world_size = get_data_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank = get_data_parallel_rank

    def get_sequence_parallel_group(self):
        return self.both

    def get_sequence_parallel_world_size(self):
        return 2

    def get_sequence_parallel_rank(self):
        return self.rank

    get_sequence_data_parallel_group = get_sequence_parallel_group
    get_sequence_data_parallel_world_size = get_sequence_parallel_world_size
    get_sequence_data_parallel_rank = get_sequence_parallel_rank


def _two_ranks(rank, world_size, port):
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from ds_pfc.core.collectives import group_ranks
    from ds_pfc.deepspeed_plugin import head_spec, initialize
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    deepspeed.init_distributed(dist_backend="gloo")
    out = {"sp": _error(lambda: initialize(model=torch.nn.Linear(D_IN, D), config=_config(0, "fp32", gas=1),
                                           mpu=_SequenceParallelMpu(), heads={"identity": head_spec(C, D)}))}
    # One pipeline stage, tensor parallel 2 (the grid's 'model' axis), data parallel 1:
    # both ranks hold the same (replicated) layer and see the same batch.
    topology = PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1)
    torch.manual_seed(0)
    layer = torch.nn.Linear(D_IN, D)
    w0, b0 = layer.weight.detach().clone(), layer.bias.detach().clone()
    model = PipelineModule(layers=[layer], topology=topology, loss_fn=lambda emb, y: model.model(emb.float(), y))
    from ds_pfc import CosFace
    from ds_pfc.deepspeed_plugin import attach
    attach(model, "model", head_spec(C, D, sample_rate=1.0, margin=CosFace(SCALE, MARGIN), optimizer="sgd",
                                     momentum=0.0, weight_decay=0.0))
    config = {**_config(0, "fp32", gas=1), "train_batch_size": N}
    engine = initialize(model=model, config=config, heads={"data": head_spec(C, D, shard="data")})
    out["pp"] = {name: (h.world_size, sorted(group_ranks(h.group)), sorted(group_ranks(h.batch_group)),
                        (h.class_start, h.class_end)) for name, h in engine.heads.items()}
    head = engine.heads["model"]
    c0 = head.centers().clone()
    x, y = _micro_batches()[0]
    engine.train_batch(iter([(x, y)]))
    out["pp-step"] = {"w0": w0, "b0": b0, "c0": c0, "backbone": layer.weight.detach() - w0,
                      "head": head.centers() - c0}
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_ranks, 2, free_port())


def test_sequence_parallelism_is_refused_at_initialize(two_ranks):
    for out in two_ranks:
        assert out["sp"].startswith("ValueError") and "sequence_parallel_size=2" in out["sp"], out["sp"]


def test_pipeline_tensor_parallel_group_comes_from_the_grid(two_ranks):
    for rank, out in enumerate(two_ranks):
        # shard="model": classes over both tensor-parallel peers, samples over the data-parallel rank alone
        assert out["pp"]["model"][:3] == (2, [0, 1], [rank]), out["pp"]
        assert out["pp"]["data"][:3] == (1, [rank], [rank]), out["pp"]
    assert [out["pp"]["model"][3] for out in two_ranks] == [(0, 5), (5, 10)]


def test_pipeline_tensor_parallel_head_trains_like_float64(two_ranks):
    """One train_batch; reference: the full classifier in float64 on the one batch both
    tensor-parallel peers see."""
    steps = [out["pp-step"] for out in two_ranks]
    c0 = torch.cat([s["c0"] for s in steps])
    w = steps[0]["w0"].double().clone().requires_grad_(True)
    b = steps[0]["b0"].double().clone().requires_grad_(True)
    c = c0.double().clone().requires_grad_(True)
    x, y = _micro_batches()[0]
    cos = F.normalize(x.double() @ w.T + b) @ F.normalize(c).T
    F.cross_entropy(SCALE * (cos - MARGIN * F.one_hot(y, C)), y).backward()
    assert _rel(torch.cat([s["head"] for s in steps]), -LR * c.grad) < 1e-4
    for s in steps:
        assert _rel(s["backbone"], -LR * w.grad) < 1e-4
