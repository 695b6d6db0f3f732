"""Heads built from the engine's groups (an mpu, DeepSpeed's own, AutoTP's) and
checked against them by membership, on 4 gloo ranks as TP = 2 x DP = 2.

The AutoTP case is a real tensor-parallel backbone: DeepSpeed splits a two-layer MLP
column-wise then row-wise over the TP peers (``"tensor_parallel"`` with a
``partition_config``); its groups exist only inside ``deepspeed.initialize``, so the
head is declared with ``head_spec`` and built there.

Rank r has tensor-parallel index r % 2 and data-parallel index r // 2: TP groups
{0, 1}, {2, 3}, DP groups {0, 2}, {1, 3}. The backbone is a Linear layer replicated
over the TP peers (same seed), so both peers of a DP position compute the same
embeddings, as the halves of a tensor-parallel backbone would. Reference for the
training case: one float64 process, the backbone and the full classifier trained
with plain SGD on the concatenated batches of the two DP positions.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from _dist import free_port, run_ranks

pytest.importorskip("deepspeed")

WORLD, TP, D_IN, D, C, MICRO, STEPS, LR = 4, 2, 12, 8, 11, 3, 2, 0.5
SCALE, MARGIN = 8.0, 0.2


class Mpu:
    """A Megatron-style model-parallel unit over TP x DP (what DeepSpeed and the plugin
    ask of one); TP = 2 x DP = 2 by default."""

    def __init__(self, world=WORLD, tp=TP):
        import torch.distributed as dist
        rank = dist.get_rank()
        self.world, self.tp = world, tp
        self._tp = self._dp = None
        for t in range(tp):                       # every rank creates every group, in order
            g = dist.new_group(list(range(t, world, tp)))
            if rank % tp == t:
                self._dp = g
        for p in range(world // tp):
            g = dist.new_group(list(range(p * tp, (p + 1) * tp)))
            if rank // tp == p:
                self._tp = g

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_world_size(self):
        return self.world // self.tp

    def get_data_parallel_rank(self):
        import torch.distributed as dist
        return dist.get_rank(self._dp)

    def get_tensor_model_parallel_group(self):
        return self._tp

    def get_tensor_model_parallel_world_size(self):
        return self.tp

    def get_tensor_model_parallel_rank(self):
        import torch.distributed as dist
        return dist.get_rank(self._tp)

    def get_tensor_model_parallel_src_rank(self):
        import torch.distributed as dist
        return dist.get_rank() // self.tp * self.tp

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank


def _config():
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": 10 ** 9, "optimizer": {"type": "SGD", "params": {"lr": LR}}}


def _data():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(STEPS, WORLD // TP * MICRO, D_IN, generator=g)
    y = torch.randint(0, C, (STEPS, WORLD // TP * MICRO), generator=g)
    return x, y


def _state(engine, model):
    return (engine.module.weight.detach().clone(), model.identity.centers().clone(),
            model.replicated.centers().clone())


def _both_heads_step(engine, model, x, y):
    emb = engine(x)
    loss = model.identity(emb, y) + model.replicated(emb, y)
    engine.backward(loss)
    engine.step()


def _worker(rank, world_size, port, ckpt_dir):
    import deepspeed

    from ds_pfc import CosFace, PartialFC
    from ds_pfc.deepspeed_plugin import attach, head_spec, initialize
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    deepspeed.init_distributed(dist_backend="gloo")
    mpu = Mpu()
    out = {}

    torch.manual_seed(0)
    model = torch.nn.Linear(D_IN, D)
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    attach(model, "identity", head_spec(C, D, sample_rate=1.0, margin=CosFace(SCALE, MARGIN), optimizer="sgd",
                                        momentum=0.0, weight_decay=0.0, seed=3))
    attach(model, "replicated", head_spec(C, D, shard="data", sample_rate=1.0, seed=3))
    engine = initialize(model=model, config=_config(), mpu=mpu)
    head = model.identity
    out["identity"] = (type(head).__name__, head.world_size, head.rank, head.batch_world_size, head.batch_rank)
    out["replicated"] = (model.replicated.world_size, model.replicated.batch_world_size)
    out["start"] = (w0, b0, head.class_start, head.centers())
    x, y = _data()
    pos = rank // TP
    rows = slice(pos * MICRO, (pos + 1) * MICRO)
    losses = []
    for step in range(STEPS):
        loss = head(engine(x[step, rows]), y[step, rows])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    out["losses"] = losses
    out["weight"] = engine.module.weight.detach().clone()
    out["centers"] = head.centers()
    # Checkpoints: both heads trained one more step, saved, trained one step further,
    # restored, and trained that step again.
    _both_heads_step(engine, model, x[0, rows], y[0, rows])
    out["saved"] = _state(engine, model)
    out["layouts"] = {name: (h.class_start, h.class_end) for name, h in engine.heads.items()}
    engine.save_checkpoint(ckpt_dir, "tagged")
    _both_heads_step(engine, model, x[1, rows], y[1, rows])
    out["after"] = _state(engine, model)
    engine.load_checkpoint(ckpt_dir, "tagged")
    out["restored"] = _state(engine, model)
    _both_heads_step(engine, model, x[1, rows], y[1, rows])
    out["after_resume"] = _state(engine, model)

    # Right size, wrong members: a head sharded over the TP group (2 ranks, like DP).
    bad = torch.nn.Linear(D_IN, D)
    attach(bad, "bad", PartialFC(C, D, group=mpu.get_tensor_model_parallel_group()))
    try:
        initialize(model=bad, config=_config(), mpu=mpu)
        out["refused"] = None
    except ValueError as err:
        out["refused"] = str(err)
    bad = torch.nn.Linear(D_IN, D)        # the same without the data-parallel gradient factor
    attach(bad, "bad", PartialFC(C, D, group=mpu.get_tensor_model_parallel_group(), data_parallel_grad=False))
    try:
        initialize(model=bad, config=_config(), mpu=mpu)
        out["refused_no_dp_grad"] = None
    except ValueError as err:
        out["refused_no_dp_grad"] = str(err)
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tp_checkpoints"))


@pytest.fixture(scope="module")
def results(checkpoint_dir):
    return run_ranks(_worker, WORLD, free_port(), checkpoint_dir)


def test_specs_are_built_from_the_mpu_groups(results):
    for r, out in enumerate(results):
        assert out["identity"] == ("PartialFC", WORLD, r, WORLD // TP, r // TP)
        assert out["replicated"] == (WORLD // TP, WORLD // TP)


def test_tp_x_dp_head_trains_as_one_float64_process(results):
    w0, b0 = results[0]["start"][:2]
    centers = torch.cat([out["start"][3] for out in sorted(results, key=lambda o: o["start"][2])]).double()
    w, b = w0.double().clone(), b0.double().clone()
    x, y = _data()
    for step in range(STEPS):
        w.requires_grad_(True)
        b.requires_grad_(True)
        centers.requires_grad_(True)
        e = x[step].double() @ w.T + b
        cos = F.normalize(e) @ F.normalize(centers).T
        loss = F.cross_entropy(SCALE * (cos - MARGIN * F.one_hot(y[step], C)), y[step])
        loss.backward()
        for r, out in enumerate(results):
            assert out["losses"][step] == pytest.approx(float(loss.detach()), rel=1e-5), (r, step)
        with torch.no_grad():
            w, b, centers = w - LR * w.grad, b - LR * b.grad, centers - LR * centers.grad
    for r, out in enumerate(results):
        torch.testing.assert_close(out["weight"].double(), w, rtol=1e-4, atol=1e-5)
        lo = out["start"][2]
        torch.testing.assert_close(out["centers"].double(), centers[lo: lo + out["centers"].shape[0]],
                                   rtol=1e-4, atol=1e-5)


def test_a_group_of_the_right_size_but_wrong_members_is_refused(results):
    for r, out in enumerate(results):
        assert out["refused_no_dp_grad"] is not None and "head 'bad'" in out["refused_no_dp_grad"]
        message = out["refused"]
        assert message is not None and "head 'bad'" in message
        dp = sorted(range(r % TP, WORLD, TP))
        tp = sorted(range(r // TP * TP, r // TP * TP + TP))
        assert str(tp) in message and str(dp) in message, message


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, 16)
        self.fc2 = torch.nn.Linear(16, D)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


AUTOTP = {"autotp_size": TP, "partition_config": {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*fc1\.weight$"], "partition_type": "column"},
    {"patterns": [r".*fc2\.weight$"], "partition_type": "row"}]}}


def _autotp_worker(rank, world_size, port):
    import deepspeed

    from ds_pfc import CosFace
    from ds_pfc.deepspeed_plugin import attach, head_spec, initialize
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Mlp()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    attach(model, "identity", head_spec(C, D, sample_rate=1.0, margin=CosFace(SCALE, MARGIN), optimizer="sgd",
                                        momentum=0.0, weight_decay=0.0, seed=3))
    engine = initialize(model=model, config=dict(_config(), tensor_parallel=AUTOTP))
    head = model.identity
    out = {"start": start, "layout": (head.world_size, head.batch_world_size, engine.dp_world_size),
           "class_start": head.class_start, "centers0": head.centers(),
           "split": type(engine.module.fc1).__name__}
    x, y = _data()
    rows = slice(rank // TP * MICRO, (rank // TP + 1) * MICRO)
    losses = []
    for step in range(STEPS + 1):
        loss = head(engine(x[step % STEPS, rows]), y[step % STEPS, rows])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    out["losses"] = losses
    out["centers"] = head.centers()
    return out


@pytest.fixture(scope="module")
def autotp():
    return run_ranks(_autotp_worker, WORLD, free_port())


def test_autotp_backbone_with_a_head_built_inside_initialize(autotp):
    """Every step's loss (which depends on the backbone's and the centers' earlier
    updates) and the final centers equal one float64 process training the unsplit MLP."""
    for out in autotp:
        assert out["layout"] == (WORLD, WORLD // TP, WORLD // TP)
        assert out["split"] != "Linear"                 # DeepSpeed really split the MLP
    model = Mlp().double()
    model.load_state_dict({k: v.double() for k, v in autotp[0]["start"].items()})
    order = sorted(autotp, key=lambda o: o["class_start"])
    centers = torch.cat([o["centers0"] for o in order]).double().requires_grad_(True)
    x, y = _data()
    opt = torch.optim.SGD(list(model.parameters()) + [centers], lr=LR)
    for step in range(STEPS + 1):
        opt.zero_grad()
        cos = F.normalize(model(x[step % STEPS].double())) @ F.normalize(centers).T
        loss = F.cross_entropy(SCALE * (cos - MARGIN * F.one_hot(y[step % STEPS], C)), y[step % STEPS])
        loss.backward()
        opt.step()
        for r, out in enumerate(autotp):
            assert out["losses"][step] == pytest.approx(float(loss.detach()), rel=1e-5), (r, step)
    got = torch.cat([o["centers"] for o in order]).double()
    torch.testing.assert_close(got, centers.detach(), rtol=1e-4, atol=1e-5)


def test_tp_checkpoint_files_and_exact_resume(results, checkpoint_dir):
    """The model-sharded head writes one shard per rank of the TP x DP grid, the head
    replicated over the TP peers one per data-parallel position (written by the lower
    TP rank); a load restores every rank bitwise and the next step repeats exactly."""
    import json

    tag = os.path.join(checkpoint_dir, "tagged")
    names = sorted(n for n in os.listdir(tag) if n.endswith(".safetensors"))
    assert names == [f"identity-rank{r:05d}-of-00004.safetensors" for r in range(4)] + \
        [f"replicated-rank{r:05d}-of-00002.safetensors" for r in range(2)]
    with open(os.path.join(tag, "ds_pfc_complete.json")) as f:
        marker = json.load(f)
    layouts = marker["head_layouts"]
    assert layouts["identity"]["world_size"] == 4 and layouts["replicated"]["world_size"] == 2
    assert layouts["replicated"]["writers"] == {"0": 0, "1": 2}
    assert layouts["identity"]["partition_dim"] == 0
    for out in results:
        for a, b in zip(out["saved"], out["restored"]):
            assert torch.equal(a, b)
        for a, b in zip(out["after"], out["after_resume"]):
            assert torch.equal(a, b)
        assert not torch.equal(out["saved"][2], out["after"][2])       # the replicated head trained too


def _other_layout_worker(rank, world_size, port, ckpt_dir):
    """TP = 2 x DP = 1 on 2 ranks: the model-sharded head now has 2 shards, the
    replicated one 1; both are resharded from the 4-rank checkpoint on load."""
    import deepspeed

    from ds_pfc.deepspeed_plugin import attach, head_spec, initialize
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    deepspeed.init_distributed(dist_backend="gloo")
    mpu = Mpu(world_size, 2)
    model = torch.nn.Linear(D_IN, D)
    attach(model, "identity", head_spec(C, D, sample_rate=1.0, optimizer="sgd", momentum=0.0, weight_decay=0.0,
                                        seed=11))
    attach(model, "replicated", head_spec(C, D, shard="data", sample_rate=1.0, seed=11))
    engine = initialize(model=model, config=_config(), mpu=mpu)
    engine.load_checkpoint(ckpt_dir, "tagged")
    return {"state": _state(engine, model),
            "layouts": {name: (h.class_start, h.class_end, h.world_size) for name, h in engine.heads.items()}}


def test_tp_checkpoint_loads_at_another_tp_x_dp_layout(results, checkpoint_dir):
    other = run_ranks(_other_layout_worker, 2, free_port(), checkpoint_dir)
    identity = torch.cat([o["saved"][1] for o in sorted(results, key=lambda o: o["layouts"]["identity"][0])])
    replicated = torch.cat([results[r]["saved"][2] for r in (0, 2)])          # DP positions 0 and 1
    for out in other:
        lo, hi, k = out["layouts"]["identity"]
        assert k == 2
        assert torch.equal(out["state"][1], identity[lo:hi])
        assert out["layouts"]["replicated"] == (0, C, 1)
        assert torch.equal(out["state"][2], replicated)
        assert torch.equal(out["state"][0], results[0]["saved"][0])
