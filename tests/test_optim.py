"""Sparse row optimizers through ``PartialFC`` (paper Eq. pfc_center_update).

Reference: for every class row a ``torch.optim.SGD`` / ``torch.optim.AdamW`` on an
``nn.Parameter`` holding that row alone, stepped only at the steps where the row was
active ("lazy" semantics). The row's gradient comes from an independent float64
margin-softmax written here over the active set, which the test obtains from
``head.active_set(labels, sample_step)`` (the sampler is tested on its own in
test_sampler.py). The reference weights evolve on their own: the reference never
reads the head's centers after initialisation.
"""
from __future__ import annotations


import pytest
import torch

from _reference import arcface_ref_loss
from ds_pfc import ArcFace, PartialFC

F64 = torch.float64
C, D, N = 211, 7, 37
SCALE, MARGIN = 16.0, 0.4


def ref_loss(x, w, target_col, scale=SCALE, m=MARGIN):
    return arcface_ref_loss(x, w, target_col, scale, m)


OPTIMIZERS = {
    "sgd_momentum": (dict(optimizer="sgd", momentum=0.9, weight_decay=5e-4),
                     lambda p: torch.optim.SGD([p], lr=1.0, momentum=0.9, weight_decay=5e-4),
                     ("momentum_buffer",)),
    "sgd_nesterov": (dict(optimizer="sgd", momentum=0.8, weight_decay=1e-3, nesterov=True),
                     lambda p: torch.optim.SGD([p], lr=1.0, momentum=0.8, weight_decay=1e-3, nesterov=True),
                     ("momentum_buffer",)),
    "sgd_plain": (dict(optimizer="sgd", momentum=0.0, weight_decay=0.0),
                  lambda p: torch.optim.SGD([p], lr=1.0),
                  ()),
    "adamw": (dict(optimizer="adamw", betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
              lambda p: torch.optim.AdamW([p], lr=1.0, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05,
                                          foreach=False),
              ("exp_avg", "exp_avg_sq", "step")),
}
LRS = [0.2, 0.1, 0.15, 0.05, 0.1, 0.12, 0.08]


def run_against_torch_optim(name, sample_rate, num_classes, dim, batch, lrs, seed=123):
    """Train a float64 head and the per-row torch.optim reference side by side."""
    head_kw, make_opt, state_names = OPTIMIZERS[name]
    head = PartialFC(num_classes, dim, sample_rate=sample_rate, margin=ArcFace(SCALE, MARGIN), seed=17,
                     dtype=F64, **head_kw)
    params = [torch.nn.Parameter(row.clone()) for row in head.centers()]
    opts = {}   # row -> its own torch.optim optimizer, created when first active
    ever_active = torch.zeros(num_classes, dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed)

    for t, lr in enumerate(lrs):
        x = torch.randn(batch, dim, generator=gen, dtype=F64)
        y = torch.randint(0, num_classes, (batch,), generator=gen)
        assert head.sample_step == t
        active = head.active_set(y, t)
        active = torch.arange(num_classes) if active is None else active
        column = {c: j for j, c in enumerate(active.tolist())}
        target_col = torch.tensor([column[c] for c in y.tolist()])

        # independent reference gradient over the active rows
        w = torch.stack([params[i].detach() for i in active.tolist()]).requires_grad_(True)
        loss_ref = ref_loss(x, w, target_col)
        (g_ref,) = torch.autograd.grad(loss_ref, w)

        before = head.state_dict()
        loss = head(x, y)
        torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=1e-12, atol=1e-12)
        loss.backward()
        assert head.step(lr) == active.numel()
        after = head.state_dict()

        for k, i in enumerate(active.tolist()):
            params[i].grad = g_ref[k].clone()
            if i not in opts:
                opts[i] = make_opt(params[i])
            opts[i].param_groups[0]["lr"] = lr
            opts[i].step()
        ever_active[active] = True

        # every row equals its own torch.optim trajectory
        expected = torch.stack([p.detach() for p in params])
        torch.testing.assert_close(after["weight"], expected, rtol=1e-11, atol=1e-13)
        # rows not active at this step: weight and state bit-identical to before
        inactive = torch.ones(num_classes, dtype=torch.bool)
        inactive[active] = False
        for key in ("weight",) + state_names:
            assert torch.equal(after[key][inactive], before[key][inactive]), key
        for key in state_names:
            ref_state = torch.stack([
                (opts[i].state[params[i]][key] if i in opts else
                 torch.zeros_like(params[i]) if key != "step" else torch.tensor(0.0)).detach().to(F64)
                for i in range(num_classes)])
            got = after[key].to(F64)
            torch.testing.assert_close(got, ref_state.reshape(got.shape), rtol=1e-11, atol=1e-13)

    never = ~ever_active
    init = PartialFC(num_classes, dim, sample_rate=sample_rate, seed=17, dtype=F64, **head_kw)
    final, start = head.state_dict(), init.state_dict()
    for key in ("weight",) + state_names:
        assert torch.equal(final[key][never], start[key][never]), key
    assert head.step_count == len(lrs)
    return ever_active


@pytest.mark.parametrize("sample_rate", [0.25, 1.0])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_row_optimizer_matches_torch_optim_per_row(name, sample_rate):
    ever_active = run_against_torch_optim(name, sample_rate, C, D, N, LRS)
    if sample_rate < 1:
        assert (~ever_active).any() and ever_active.any()


@pytest.mark.parametrize("name,sample_rate", [("sgd_nesterov", 0.9), ("adamw", 0.9), ("sgd_momentum", 1.0)])
def test_row_optimizer_many_wide_rows(name, sample_rate):
    """Wide rows (d = 1031) and > 1000 active rows: the optimizer may work through
    the active rows in pieces (4 MiB chunks of float32 rows at the time of writing);
    every row must still follow its own torch.optim."""
    run_against_torch_optim(name, sample_rate, 1201, 1031, 17, [0.1, 0.05])


def test_row_adamw_bias_correction_follows_each_rows_own_count():
    """Two rows active a different number of times get different bias corrections;
    the check above covers it numerically, this pins the per-row counters."""
    head = PartialFC(C, D, sample_rate=0.1, optimizer="adamw", seed=2, dtype=F64)
    counts = torch.zeros(C, dtype=torch.int64)
    gen = torch.Generator().manual_seed(9)
    for t in range(5):
        y = torch.randint(0, C, (N,), generator=gen)
        counts[head.active_set(y, t)] += 1
        head(torch.randn(N, D, generator=gen, dtype=F64), y).backward()
        head.step(0.01)
    steps = head.state_dict()["step"]
    assert torch.equal(steps.long(), counts)
    assert len(set(counts.tolist())) > 2


def test_lr_zero_sgd_without_decay_changes_nothing_but_momentum():
    head = PartialFC(C, D, sample_rate=0.3, optimizer="sgd", momentum=0.9, weight_decay=0.0, dtype=F64)
    before = head.centers()
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, C, (N,), generator=gen)
    active = head.active_set(y, 0)
    head(torch.randn(N, D, generator=gen, dtype=F64), y).backward()
    head.step(0.0)
    assert torch.equal(head.centers(), before)
    buf = head.state_dict()["momentum_buffer"]
    assert bool((buf[active].abs().sum(1) > 0).all())
    mask = torch.ones(C, dtype=torch.bool)
    mask[active] = False
    assert bool((buf[mask] == 0).all())
