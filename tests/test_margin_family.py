"""AdaFace, MagFace, CurricularFace, ElasticFace and sub-center ArcFace through
``margin_cross_entropy`` and ``PartialFC``, against the float64 transcriptions of
each paper's official code in ``_margin_references.py`` (written without the
library's code in view).

- World size 1, sample rate 1, float32 inputs: loss and gradients with respect to the
  embeddings and the centers within 1e-4 (relative) of float64, over several steps
  of running state.
- 3 gloo ranks, uneven batches, sample rate 0.5, float64: every rank's loss,
  embedding gradient and active-center gradient equal the reference softmax over
  the union of the active sets, and the running state equals the reference state of
  the concatenated batch.
- State: saved and restored exactly (state_dict and checkpoint shards), on another
  world size too.
"""
from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

import _margin_references as R
from _capture import CaptureRows
from _dist import run_ranks
import ds_pfc
from ds_pfc.core.margins import AdaFace, CurricularFace, ElasticArcFace, ElasticCosFace, MagFace

D = 12


def _case(seed, n, num_classes, *, norm_lo=0.5, norm_hi=4.0, k=1, equal_sub_centers=False):
    """Embeddings leaning towards their class's first center, norms spread over
    [norm_lo, norm_hi]; centers [C K, d] (K sub-centers per class, optionally K
    copies of one)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(num_classes * k, D, generator=g, dtype=torch.float64)
    if equal_sub_centers:
        W = W[::k].repeat_interleave(k, dim=0)
    y = torch.randint(0, num_classes, (n,), generator=g)
    lean = 2.5 * torch.rand(n, 1, generator=g, dtype=torch.float64)
    x = lean * torch.nn.functional.normalize(W[y * k], dim=1) + torch.randn(n, D, generator=g, dtype=torch.float64) / 3
    x = torch.nn.functional.normalize(x, dim=1) * (norm_lo + (norm_hi - norm_lo) * torch.rand(n, 1, generator=g,
                                                                                               dtype=torch.float64))
    return x, y, W


# name -> (library margin factory, reference loss(emb, weight, labels, state, draw margins) -> (loss, state),
#          initial reference state, norm range, sub-centers)
def _elastic_ref(fn, plus):
    def ref(emb, weight, labels, state, margins):
        return fn(emb, weight, labels, margins, plus=plus), state
    return ref


CASES = {
    "adaface": (lambda: AdaFace(), lambda e, w, y, s, m: R.adaface_loss(e, w, y, s), R.adaface_initial_state,
                (2.0, 40.0), 1),
    "magface": (lambda: MagFace(), lambda e, w, y, s, m: (R.magface_loss(e, w, y, easy_margin=True), s), dict,
                (5.0, 130.0), 1),
    "magface-threshold": (lambda: MagFace(easy_margin=False),
                          lambda e, w, y, s, m: (R.magface_loss(e, w, y, easy_margin=False), s), dict,
                          (5.0, 130.0), 1),
    "curricularface": (lambda: CurricularFace(), lambda e, w, y, s, m: R.curricularface_loss(e, w, y, s),
                       R.curricularface_initial_state, (0.5, 4.0), 1),
    "elastic-arc": (lambda: ElasticArcFace(seed=4), _elastic_ref(R.elastic_arcface_loss, False), dict,
                    (0.5, 4.0), 1),
    "elastic-cos-plus": (lambda: ElasticCosFace(plus=True, seed=4), _elastic_ref(R.elastic_cosface_loss, True),
                         dict, (0.5, 4.0), 1),
    "subcenter-arcface": (lambda: ds_pfc.ArcFace(),
                          lambda e, w, y, s, m: (R.subcenter_arcface_loss(e, w, y, k=3, threshold=False), s), dict,
                          (0.5, 4.0), 3),
    "subcenter-adaface": (lambda: AdaFace(), None, R.adaface_initial_state, (2.0, 40.0), 2),
}


def _draws(name, n, steps):
    """The per-sample margins of ElasticFace's training draws (for the reference)."""
    if not name.startswith("elastic"):
        return [None] * steps
    lib = CASES[name][0]()
    probe = type(lib)(lib.scale, lib.m, lib.std, plus=False, seed=lib.seed)     # the raw, unsorted draws
    return [probe.margins(torch.zeros(n, dtype=torch.float64), draw) for draw in range(steps)]


def _reference(name, emb, weight, labels, state, margins, *, union=None, k=1):
    """Reference loss and gradients (float64) on the classes ``union`` (all: None)."""
    _, ref, *_ = CASES[name]
    emb = emb.detach().double().clone().requires_grad_(True)
    full = weight.detach().double()
    if union is not None:          # the softmax over the union of active classes: relabel into it
        rows = (union[:, None] * k + torch.arange(k)).reshape(-1)
        weight_u, labels_u = full[rows], torch.searchsorted(union, labels)
    else:
        weight_u, labels_u = full, labels
    weight_u = weight_u.clone().requires_grad_(True)
    if name == "subcenter-adaface":
        # The K sub-centers of a class are equal here (see _case): the class cosine is
        # that center's, so the reference is AdaFace on one row per class, and the
        # gradient of those rows is what the K copies receive together.
        one = weight_u.detach()[::k].clone().requires_grad_(True)
        loss, state = R.adaface_loss(emb, one, labels_u, state)
        gx, gw = torch.autograd.grad(loss, (emb, one))
        return loss.detach(), gx, gw, state
    else:
        loss, state = ref(emb, weight_u, labels_u, state, margins)
    gx, gw = torch.autograd.grad(loss, (emb, weight_u))
    return loss.detach(), gx, gw, state


# ---------------------------------------------------------------------- world size 1, float32
@pytest.mark.parametrize("name", sorted(CASES))
def test_world1_float32_matches_the_official_code_in_float64(name):
    factory, _, init_state, (lo, hi), k = CASES[name]
    margin = factory()
    state = init_state()
    steps, n, c = 3, 11, 37
    draws = _draws(name, n, steps)
    for step in range(steps):
        x64, y, w64 = _case(10 + step, n, c, norm_lo=lo, norm_hi=hi, k=k,
                            equal_sub_centers=name == "subcenter-adaface")
        x = x64.float().requires_grad_(True)
        w = w64.float().requires_grad_(True)
        loss = ds_pfc.margin_cross_entropy(x, y, w, margin=margin, sub_centers=k, backend="torch")
        gx, gw = torch.autograd.grad(loss, (x, w))
        if name == "subcenter-adaface":
            gw = gw.view(c, k, D).sum(1)
        ref_loss, ref_gx, ref_gw, state = _reference(name, x.double(), w.double(), y, state, draws[step], k=k)
        what = f"{name} step {step}"
        torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-4, atol=0, msg=lambda m: f"{what} loss: {m}")
        for got, ref, label in ((gx, ref_gx, "d embeddings"), (gw, ref_gw, "d centers")):
            torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()),
                                       msg=lambda m: f"{what} {label}: {m}")
        for key, value in state.items():     # running state after every step
            assert margin.state_dict()[key] == pytest.approx(float(value), rel=1e-6), (what, key)


def test_the_running_state_really_moves():
    ada, cur = AdaFace(), CurricularFace()
    x, y, w = _case(3, 9, 20, norm_lo=5, norm_hi=60)
    ds_pfc.margin_cross_entropy(x, y, w, margin=ada)
    ds_pfc.margin_cross_entropy(x, y, w, margin=cur)
    assert ada.state_dict() != {"batch_mean": 20.0, "batch_std": 100.0} and cur.state_dict()["t"] != 0.0
    before = ada.state_dict(), cur.state_dict()
    with torch.no_grad():           # evaluation forwards leave the state alone
        ds_pfc.margin_cross_entropy(x, y, w, margin=ada)
        ds_pfc.margin_cross_entropy(x, y, w, margin=cur)
    assert (ada.state_dict(), cur.state_dict()) == before


def test_elastic_draws_are_reproducible_and_distributed_as_specified():
    a, b = ElasticArcFace(m=0.5, std=0.05, seed=3), ElasticArcFace(m=0.5, std=0.05, seed=3)
    z = torch.zeros(20000, dtype=torch.float64)
    assert torch.equal(a.margins(z, 7), b.margins(z, 7))
    assert not torch.equal(a.margins(z, 7), a.margins(z, 8))
    assert not torch.equal(a.margins(z, 7), ElasticArcFace(seed=4).margins(z, 7))
    m = a.margins(z, 0)
    assert abs(float(m.mean()) - 0.5) < 0.003 and abs(float(m.std()) - 0.05) < 0.002


def test_curricularface_refuses_the_fused_backend_and_auto_uses_torch():
    x, y, w = _case(1, 5, 9)
    with pytest.raises(ValueError, match="triton.*CurricularFace"):
        ds_pfc.margin_cross_entropy(x.float(), y, w.float(), margin=CurricularFace(), backend="triton")
    ds_pfc.margin_cross_entropy(x.float(), y, w.float(), margin=CurricularFace(), backend="auto")
    with pytest.raises(ValueError, match="sub-centers"):
        ds_pfc.PartialFC(9, D, sub_centers=2, backend="triton")


@pytest.mark.parametrize("kwargs, match", [
    ({"margin": "AdaFace", "m": -0.1}, "m must be >= 0"), ({"margin": "MagFace", "u_a": 5.0}, "u_a"),
    ({"margin": "AdaFace", "t_alpha": 2.0}, "t_alpha"), ({"margin": "ElasticCosFace", "std": -1.0}, "std"),
    ({"margin": "CurricularFace", "m": 4.0}, "m must be <")])
def test_bad_hyper_parameters_name_themselves(kwargs, match):
    cls = getattr(ds_pfc, kwargs.pop("margin"))
    with pytest.raises((ValueError, TypeError), match=match):
        cls(**kwargs)


# ---------------------------------------------------------------------- 3 ranks, sampled
RANKS_CASES = ["adaface", "magface", "curricularface", "elastic-arc", "subcenter-arcface"]
SIZES, CLASSES, RATE, STEPS = [6, 3, 8], 31, 0.5, 2


def _ranks(rank, world_size, names):
    out = {}
    for name in names:
        factory, _, _, (lo, hi), k = CASES[name]
        head = ds_pfc.PartialFC(CLASSES, D, sample_rate=RATE, margin=factory(), dtype=torch.float64,
                                data_parallel_grad=False, optimizer=CaptureRows(), seed=5, sub_centers=k)
        steps = []
        for step in range(STEPS):
            x, y, _ = _case(40 + step, sum(SIZES), CLASSES, norm_lo=lo, norm_hi=hi, k=k)
            sl = slice(sum(SIZES[:rank]), sum(SIZES[:rank + 1]))
            a = head.class_start
            local = torch.where((y >= a) & (y < head.class_end), y - a, torch.full_like(y, -1))
            active = head.active_set(local)
            centers = head.centers()
            xs = x[sl].clone().requires_grad_(True)
            res = head(xs, y[sl], return_details=True)
            res.loss.backward()
            head.step(0.5)
            rows, grad = head.optimizer.calls[-1]
            steps.append({"active": active + a, "centers": centers, "loss": res.loss.detach(), "gx": xs.grad,
                          "rows": rows, "grad": grad, "state": head.margin.state_dict()})
        out[name] = {"steps": steps, "bounds": (head.class_start, head.class_end)}
    return out


def test_three_ranks_sampled_equal_the_reference_over_the_union():
    results = run_ranks(_ranks, 3, RANKS_CASES)
    for name in RANKS_CASES:
        factory, _, init_state, (lo, hi), k = CASES[name]
        state = init_state()
        draws = _draws(name, sum(SIZES), STEPS)
        for step in range(STEPS):
            x, y, _ = _case(40 + step, sum(SIZES), CLASSES, norm_lo=lo, norm_hi=hi, k=k)
            union = torch.cat([r[name]["steps"][step]["active"] for r in results])
            W = torch.cat([r[name]["steps"][step]["centers"] for r in results])      # every class's rows
            assert union.numel() < CLASSES, "sampling must leave classes out"
            loss, gx, gw, state = _reference(name, x, W, y, state, draws[step], union=union, k=k)
            for q, r in enumerate(results):
                s = r[name]["steps"][step]
                what = f"{name} step {step} rank {q}"
                torch.testing.assert_close(s["loss"], loss, rtol=1e-10, atol=0, msg=lambda m: f"{what}: {m}")
                sl = slice(sum(SIZES[:q]), sum(SIZES[:q + 1]))
                torch.testing.assert_close(s["gx"], gx[sl], rtol=1e-9, atol=1e-12, msg=lambda m: f"{what} dx: {m}")
                # this rank's active rows, in the union's order
                a = r[name]["bounds"][0]
                mine = torch.isin(union, s["active"])
                rows = (torch.nonzero(mine).squeeze(1)[:, None] * k + torch.arange(k)).reshape(-1)
                torch.testing.assert_close(s["grad"], gw[rows], rtol=1e-9, atol=1e-12,
                                           msg=lambda m: f"{what} d centers: {m}")
                expected_rows = ((s["active"] - a)[:, None] * k + torch.arange(k)).reshape(-1)
                assert torch.equal(s["rows"], expected_rows), what
                for key, value in state.items():
                    assert s["state"][key] == pytest.approx(float(value), rel=1e-12), (what, key)


# ---------------------------------------------------------------------- state in checkpoints
def _train(head, steps, seed=0):
    for step in range(steps):
        x, y, _ = _case(seed + step, 10, head.num_classes, norm_lo=3, norm_hi=50, k=head.sub_centers)
        head(x.float(), y).backward()
        head.step(0.1)


@pytest.mark.parametrize("margin", [AdaFace, CurricularFace, lambda: ElasticArcFace(seed=2)],
                         ids=["adaface", "curricularface", "elastic"])
def test_state_dict_round_trip_continues_bitwise(margin):
    a = ds_pfc.PartialFC(17, D, margin=margin(), sample_rate=0.6, seed=1, sub_centers=2)
    _train(a, 3)
    saved = a.state_dict()
    b = ds_pfc.PartialFC(17, D, margin=margin(), sample_rate=0.6, seed=1, sub_centers=2)
    b.load_state_dict(saved)
    assert b.margin.state_dict() == a.margin.state_dict()
    _train(a, 2, seed=100)
    _train(b, 2, seed=100)
    assert torch.equal(a.centers(), b.centers()) and a.margin.state_dict() == b.margin.state_dict()


def test_checkpoint_shards_carry_the_state_and_reshard_with_sub_centers(tmp_path):
    from ds_pfc.checkpoint import shards as ckpt
    head = ds_pfc.PartialFC(23, D, margin=AdaFace(), sample_rate=0.5, seed=3, sub_centers=3)
    _train(head, 3)
    ckpt.save_head_shard(head, str(tmp_path / "one"))
    fresh = ds_pfc.PartialFC(23, D, margin=AdaFace(), sample_rate=0.5, seed=9, sub_centers=3)
    ckpt.load_head_shard(fresh, str(tmp_path / "one"))
    assert torch.equal(fresh.centers(), head.centers()) and fresh.margin.state_dict() == head.margin.state_dict()
    # resharded to 2 ranks: rank r holds the K rows of each of its classes
    ckpt.reshard(str(tmp_path / "one"), str(tmp_path / "two"), 2)
    tensors, meta = ckpt.merge_shards(str(tmp_path / "two"))
    assert meta["sub_centers"] == 3 and tensors["weight"].shape == (23 * 3, D)
    assert torch.equal(tensors["weight"], head.centers())
    with pytest.raises(ValueError, match="sub_centers"):
        ckpt.load_head_shard(ds_pfc.PartialFC(23, D, margin=AdaFace(), sub_centers=2), str(tmp_path / "one"))


def test_export_keeps_the_sub_centers_and_the_dominant_one(tmp_path):
    from safetensors.torch import load_file

    from ds_pfc.checkpoint import shards as ckpt
    head = ds_pfc.PartialFC(15, D, sub_centers=3, seed=2)
    ckpt.save_head_shard(head, str(tmp_path))
    x, y, _ = _case(5, 60, 15, k=3)
    counter = ckpt.SubcenterCounter(head.centers(), 3)
    counter.update(x[:25], y[:25])
    counter.update(x[25:], y[25:])
    expected = R.dominant_subcenters(x, head.centers().double(), y, k=3)
    assert torch.equal(counter.dominant(), expected)
    out = ckpt.export_classifier(str(tmp_path), str(tmp_path / "classifier.safetensors"), dominant=counter.dominant())
    got = load_file(out)
    assert got["weight"].shape == (45, D) and torch.equal(got["dominant"], expected)
    assert torch.equal(got["weight_dominant"], head.centers()[torch.arange(15) * 3 + expected])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused kernels run on CPU tensors only in Triton's interpreter (TRITON_INTERPRET=1, "
                           "set by conftest.py when there is no GPU)")
@pytest.mark.parametrize("name", ["adaface", "magface", "elastic-arc"])
def test_per_sample_margins_run_in_the_fused_backend(name):
    """The fused kernels handle the negatives; the per-sample target terms (and the
    norm terms) are applied outside them, so these margins work there too."""
    factory, _, _, (lo, hi), _ = CASES[name]
    x64, y, w64 = _case(21, 9, 19, norm_lo=lo, norm_hi=hi)
    out = {}
    for backend in ("torch", "triton"):
        x, w = x64.float().requires_grad_(True), w64.float().requires_grad_(True)
        loss = ds_pfc.margin_cross_entropy(x, y, w, margin=factory(), backend=backend)
        out[backend] = (loss.detach(), *torch.autograd.grad(loss, (x, w)))
    for a, b in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_sub_centers_and_adaface_on_a_tiered_bank_match_the_device_bank():
    """Host-tier slots with prefetch give the device bank's trajectory bitwise."""
    runs = []
    for bank in (None, ds_pfc.TieredBank.factory(default="host")):
        head = ds_pfc.PartialFC(29, D, margin=AdaFace(), sample_rate=0.4, seed=6, sub_centers=3, bank=bank,
                                momentum=0.9)
        batches = [_case(60 + i, 10, 29, norm_lo=3, norm_hi=50) for i in range(4)]
        losses = []
        for i, (x, y, _) in enumerate(batches):
            loss = head(x.float(), y)
            loss.backward()
            if i + 1 < len(batches):
                head.prefetch(batches[i + 1][1])
            head.step(0.1)
            losses.append(float(loss.detach()))
        runs.append((losses, head.centers(), head.margin.state_dict()))
        head.close()
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1]) and runs[0][2] == runs[1][2]
