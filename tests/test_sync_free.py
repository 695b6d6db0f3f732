"""Host synchronisations of a head step (device bank), counted on CPU.

A step (forward, backward, ``head.step``) with ``validate=False`` must not read
anything back from the device, at any sample rate and world size, so that the host
runs ahead and a CUDA graph can capture it (captured on a GPU in test_cuda.py); with
``validate=True`` every check of the step costs one sync. Counts come from
:class:`~ds_pfc.bench.counting.OpCounter` (``.tolist()``, ``.item()``, ``bool(t)``,
``unique``, ``nonzero``, boolean-mask indexing ...). Multi-rank runs use gloo ranks.

``validate="deferred"`` gathers the same checks as ``True`` but reads them one step
late (0 syncs); its errors are the immediate ones, naming the forward they belong to.

The losses of the two modes are compared with a float64 softmax over the union of the
active sets written here in plain PyTorch, so the sync-free path is also the right one.
"""
from __future__ import annotations

import pytest
import torch

from _dist import run_ranks
from ds_pfc import ArcFace, PartialFC
from ds_pfc.bench.counting import OpCounter

C, D = 1009, 8
RATES = (0.1, 0.5, 1.0)


def _batch(step, rank, n, classes=C):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, D, generator=gen, dtype=torch.float64), torch.randint(0, classes, (n,), generator=gen)


def _counted_steps(head, n, rank, steps=3, lr=0.1):
    """Syncs of each training step after the first (which may set things up)."""
    counts = []
    for t in range(steps):
        x, y = _batch(t, rank, n)
        with OpCounter() as c:
            head(x.requires_grad_(), y).backward()
            head.step(lr)
        counts.append((c.syncs, list(c.sync_ops)))
    return counts[1:]


def _head(rate, validate, **kw):
    return PartialFC(C, D, sample_rate=rate, validate=validate, margin=ArcFace(16.0, 0.3), seed=5,
                     dtype=torch.float64, data_parallel_grad=False, **kw)


# ---------------------------------------------------------------------- one rank
@pytest.mark.parametrize("rate", RATES)
def test_one_rank_without_validation_never_syncs(rate):
    for syncs, ops in _counted_steps(_head(rate, False), n=37, rank=0):
        assert syncs == 0, ops


@pytest.mark.parametrize("rate", RATES)
def test_one_rank_with_validation_syncs_once(rate):
    for syncs, ops in _counted_steps(_head(rate, True), n=37, rank=0):
        assert syncs == 1, ops


def test_prefetch_on_the_device_bank_syncs_as_forward_does():
    """With the device bank prefetch stages nothing; its label check is the one sync
    of validate=True and is skipped without validation."""
    for validate, expected in ((False, 0), (True, 1)):
        head = _head(0.1, validate)
        with OpCounter() as c:
            head.prefetch(torch.randint(0, C, (37,)))
        assert c.syncs == expected, c.sync_ops
    with pytest.raises(ValueError, match=r"next_labels must lie in \[0, 1009\)"):
        _head(0.1, True).prefetch(torch.tensor([3, C]))


def test_budget_below_the_batch_reads_the_positives_count():
    """floor(r C_q) < N: a step's positives may outnumber the budget, so the active
    set's size is read back (documented); still one sync, the sampler's."""
    head = _head(0.02, False)          # budget 20 < 37 samples
    for syncs, ops in _counted_steps(head, n=37, rank=0):
        assert syncs == 1, ops


def _reference_loss(x, y, centers, actives, scale=16.0, m=0.3):
    """float64 ArcFace softmax over the union of the active classes (global ids)."""
    cols = torch.cat(actives)
    w = torch.nn.functional.normalize(centers[cols], dim=1)
    cos = torch.nn.functional.normalize(x, dim=1) @ w.t()
    target = (cols[None, :] == y[:, None])
    theta = torch.acos(cos.clamp(-1, 1))
    logits = scale * torch.where(target, torch.cos(theta + m), cos)
    return float((torch.logsumexp(logits, 1) - logits[target]).mean())


@pytest.mark.parametrize("rate", (0.1, 0.5))
def test_both_modes_give_the_reference_loss(rate):
    """The same steps with and without validation: equal losses, equal centers, and the
    loss of the softmax over the sampled classes computed here."""
    heads = [_head(rate, v) for v in (False, True)]
    for t in range(3):
        x, y = _batch(t, 0, 37)
        active = heads[0].active_set(heads[0].partition.to_local(y, 0), t)
        expected = _reference_loss(x, y, heads[0].centers(), [active])
        losses = []
        for h in heads:
            loss = h(x, y)
            loss.backward()
            h.step(0.1)
            losses.append(float(loss.detach()))
        assert losses[0] == losses[1]
        assert abs(losses[0] - expected) < 1e-9, (losses, expected)
    assert torch.equal(heads[0].centers(), heads[1].centers())


# ---------------------------------------------------------------------- gloo ranks
def _rank_counts(rank, world, n):
    """{(rate, validate): (syncs of steps 2 and 3, sample_step)} on this rank."""
    out = {}
    for rate in RATES:
        for validate in (False, True):
            head = _head(rate, validate)
            out[rate, validate] = _counted_steps(head, n, rank), head.sample_step
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_sync_never_without_validation_once_with(world):
    # 9 samples per rank: N = 9 world <= floor(0.1 C_q) (33 at world 3), the fixed-size regime.
    for rank, table in enumerate(run_ranks(_rank_counts, world, 9)):
        for (rate, validate), (counts, steps) in table.items():
            assert steps == 3
            for syncs, ops in counts:
                assert syncs == (1 if validate else 0), (rate, validate, rank, ops)


def _two_modes(rank, world, rate):
    """Centers after 3 steps with and without validation (equal batches)."""
    out = []
    for validate in (False, True):
        head = _head(rate, validate)
        for t in range(3):
            x, y = _batch(t, rank, 11)
            head(x, y).backward()
            head.step(0.1)
        out.append(head.centers())
    return out


def test_ranks_train_the_same_with_and_without_validation():
    for a, b in run_ranks(_two_modes, 3, 0.1):
        assert torch.equal(a, b)


def _uneven(rank, world, validate, bad_dtype=False):
    head = _head(0.5, validate)
    x, y = _batch(0, rank, 5 + 2 * rank)
    if bad_dtype:
        x, y = _batch(0, rank, 5)
        y = y.float() if rank == 1 else y
    try:
        head(x, y).backward()
        head.step(0.1)
    except (RuntimeError, TypeError) as err:
        return str(err)
    return float(torch.linalg.norm(head.centers()))


def test_uneven_batches_need_validation():
    """validate=True pads uneven batches; validate=False asserts on the device that
    every rank passed the same size (a RuntimeError on CPU, a device assert on CUDA)."""
    ok = run_ranks(_uneven, 2, True)
    assert all(isinstance(v, float) for v in ok), ok
    failed = run_ranks(_uneven, 2, False)
    assert all(isinstance(v, str) and "different sizes" in v for v in failed), failed
    # A rank whose input fails its local checks still joins the sizes' all-gather: the
    # other ranks fail the size assert instead of waiting for it.
    first, second = run_ranks(_uneven, 2, False, True)
    assert "different sizes" in first and "integer tensor" in second, (first, second)


def _bad_labels(rank, world):
    head = _head(0.5, True)
    x, y = _batch(0, rank, 6)
    if rank == 1:
        y[2] = C + 4
    try:
        head(x, y)
    except ValueError as err:
        return str(err), head.sample_step
    return None, head.sample_step


def test_validation_fails_on_every_rank_with_a_readable_error():
    """One bad label on rank 1: rank 1 names the values, the others name rank 1; no rank
    took a step, and the one sync checked everything (no later collective hangs)."""
    (msg0, s0), (msg1, s1), (msg2, s2) = run_ranks(_bad_labels, 3)
    assert "labels must lie in [0, 1009)" in msg1 and str(C + 4) in msg1
    for msg in (msg0, msg2):
        assert "ranks [1]" in msg and "rejected" in msg
    assert s0 == s1 == s2 == 0


# ---------------------------------------------------------------------- validate="deferred"
def _deferred_message(values, forward):
    return (f"labels must lie in [0, {C}), got values in [{min(values)}, {max(values)}] (checked one step late, "
            f"validate='deferred': the batch of training forward {forward} (sample_step {forward}), whose update "
            "may already have been applied")


@pytest.mark.parametrize("rate", RATES)
def test_one_rank_with_deferred_validation_never_syncs(rate):
    for syncs, ops in _counted_steps(_head(rate, "deferred"), n=37, rank=0):
        assert syncs == 0, ops


def test_deferred_validation_reports_bad_labels_one_step_late():
    """The bad batch of forward 1 runs (labels outside [0, C) train as label mod C); the next
    forward raises the immediate check's text naming forward 1, before it changes anything."""
    head = _head(0.5, "deferred")
    x, y = _batch(0, 0, 9)
    head(x, y).backward()
    head.step(0.1)
    x, y = _batch(1, 0, 9)
    y[4] = C + 7
    head(x, y).backward()                      # no error yet
    head.step(0.1)
    assert head.sample_step == 2
    before = head.centers()
    x, y_next = _batch(2, 0, 9)
    with pytest.raises(ValueError) as err:
        head(x, y_next)
    assert str(err.value).startswith(_deferred_message(y.tolist(), 1)), str(err.value)
    assert head.sample_step == 2 and torch.equal(head.centers(), before)
    head(x, y_next).backward()                 # reported once: the next step trains
    head.step(0.1)
    assert head.sample_step == 3


def test_deferred_validation_reports_nonfinite_embeddings_as_nonfinite():
    from ds_pfc._checks import NonFiniteError
    head = _head(1.0, "deferred")
    x, y = _batch(0, 0, 9)
    x[2, 3] = float("nan")
    head(x, y)
    with pytest.raises(NonFiniteError, match=r"^embeddings contain NaN or Inf values \(checked one step late"):
        head(*_batch(1, 0, 9))


def test_deferred_checks_run_before_a_state_dict_and_are_dropped_by_a_load():
    head = _head(0.5, "deferred")
    good = head.state_dict()
    x, y = _batch(0, 0, 9)
    y[0] = -3
    head(x, y).backward()
    head.step(0.1)
    with pytest.raises(ValueError, match=r"got values in \[-3, "):
        head.state_dict()
    head(x, y).backward()                       # the same bad batch again: flush() reports it
    with pytest.raises(ValueError, match=r"training forward 1 "):
        head.flush()
    head(x, y).backward()
    head.load_state_dict(good)                  # the state it concerns is replaced: nothing to report
    head.check_deferred()
    assert torch.equal(head.centers(), good["weight"])


def test_deferred_prefetch_never_syncs_and_reports_at_the_next_forward():
    head = _head(0.1, "deferred")
    with OpCounter() as c:
        head.prefetch(torch.randint(0, C, (37,)))
    assert c.syncs == 0, c.sync_ops
    head.prefetch(torch.tensor([3, C]))
    x, y = _batch(0, 0, 9)
    with pytest.raises(ValueError, match=r"^next_labels must lie in \[0, 1009\), got values in \[3, 1009\] "
                                         r"\(checked at the next forward.*training forward 0 .*which has not run"):
        head(x, y)
    assert head.sample_step == 0


def test_validate_names_its_choices():
    with pytest.raises(ValueError, match=r"validate must be True, False, 'immediate' or 'deferred', got 'later'"):
        _head(0.5, "later")
    assert _head(0.5, "immediate").validate is True


def test_deferred_and_immediate_validation_train_alike():
    """Good input: the deferred checks change nothing in what is computed."""
    heads = [_head(0.5, v) for v in (True, "deferred")]
    for t in range(3):
        x, y = _batch(t, 0, 37)
        losses = []
        for h in heads:
            loss = h(x, y)
            loss.backward()
            h.step(0.1)
            losses.append(float(loss.detach()))
        assert losses[0] == losses[1]
    assert torch.equal(heads[0].centers(), heads[1].centers())


def _deferred_ranks(rank, world):
    """(syncs of steps 2 and 3 with good input, message at the forward after rank 1's bad labels)."""
    head = _head(0.1, "deferred")
    counts = _counted_steps(head, 9, rank)
    x, y = _batch(5, rank, 9)
    if rank == 1:
        y[2] = C + 4
    head(x, y).backward()
    head.step(0.1)
    try:
        head(*_batch(6, rank, 9))
    except ValueError as err:
        return counts, str(err), head.sample_step
    return counts, None, head.sample_step


def test_ranks_defer_validation_without_syncs_and_fail_together():
    (c0, m0, s0), (c1, m1, s1), (c2, m2, s2) = run_ranks(_deferred_ranks, 3)
    for counts in (c0, c1, c2):
        assert all(syncs == 0 for syncs, _ in counts), counts
    assert m1.startswith(f"labels must lie in [0, {C}), got values in [") and f"{C + 4}]" in m1
    for msg in (m0, m2):
        assert "ranks [1]" in msg and "rejected" in msg and "training forward 3 " in msg
    assert "training forward 3 " in m1
    assert s0 == s1 == s2 == 4


def test_deferred_validation_with_a_tiered_bank():
    """A host-tier bank with prefetch trains as the device bank (bitwise); a bad
    next_labels is reported when the next forward starts, a bad batch at the next flush."""
    from ds_pfc.bank import TieredBank
    heads = [_head(0.1, "deferred"), _head(0.1, "deferred", bank=TieredBank.factory(default="host"))]
    for h in heads:
        for t in range(4):
            x, y = _batch(t, 0, 37)
            loss = h(x, y)
            h.prefetch(_batch(t + 1, 0, 37)[1])
            loss.backward()
            h.step(0.1)
    assert torch.equal(heads[0].centers(), heads[1].centers())
    tiered = heads[1]
    tiered.prefetch(torch.tensor([5] * 36 + [C + 2]))
    with pytest.raises(ValueError, match=r"^next_labels must lie in \[0, 1009\), got values in \[5, 1011\] "
                                         r"\(checked at the next forward.*training forward 4 "):
        tiered(*_batch(9, 0, 37))
    x, y = _batch(10, 0, 37)
    y[0] = -4
    tiered(x, y).backward()
    tiered.step(0.1)
    with pytest.raises(ValueError, match=r"got values in \[-4, \d+\] \(checked one step late.*training forward 4 "):
        tiered.flush()
    tiered.close()


def test_the_counted_head_step_at_cuda_block_sizes_has_no_sync_when_deferred():
    """bench.head.count_step (the op/sync count of one head step, with the CUDA default
    block size): 1 sync with validate=True, none with 'deferred', and 2 more ops: the check
    table's copy to the host and the labels' wrap into [0, C)."""
    from ds_pfc.bench.head import count_step
    now = count_step(20_000, 16, batch=128, sample_rate=0.1, validate=True)
    late = count_step(20_000, 16, batch=128, sample_rate=0.1, validate="deferred")
    assert (now["syncs"], now["sync_ops"]) == (1, ["Tensor.tolist"]), now
    assert (late["syncs"], late["sync_ops"]) == (0, []), late
    assert late["ops"] - now["ops"] == 2, (now["ops"], late["ops"])   # the table's host copy, the label wrap
