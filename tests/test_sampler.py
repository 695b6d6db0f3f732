"""Positive-preserving sampler (paper Eq. local_sampling; DESIGN.md 3 "Sampler").

References used here, all independent of ``ds_pfc.core.sampling``:
- the budget ``floor(r * C_q)`` computed exactly with ``fractions.Fraction`` of the
  decimal ``r`` the user wrote;
- the documented draw written again with Python integers (splitmix64 mod 2**64, the
  positives first, then the negatives by decreasing key), for exact sets;
- the selection of the largest keys against a Python sort of (key, id) pairs and
  against ``torch.topk`` + ``torch.sort``;
- uniformity without replacement by counting: per-class inclusion frequencies and,
  for tiny pools, the frequency of every k-subset, judged by a chi-square statistic
  computed here (Wilson-Hilferty normal approximation; no scipy on this machine).
  Every draw is a pure function of fixed seeds, so these tests are deterministic.
"""
from __future__ import annotations

import importlib.util
import itertools
import math
import os
from fractions import Fraction

import pytest
import torch

from ds_pfc import ArcFace, PartialFC
from ds_pfc.bench.counting import OpCounter
from ds_pfc.core.sampling import (POSITIVE_KEY, _bucket_capacity, _largest_ids, activation_budget, class_keys,
                                 remap_labels, sample_active)

# A chi-square statistic is accepted while its Wilson-Hilferty z-score stays below
# this (one-sided p ~ 1e-6). Deterministic seeds: no flakiness, only a margin.
Z_MAX = 4.75


def chi2_z(stat: float, df: int) -> float:
    """Wilson-Hilferty: (X/df)^(1/3) is ~ N(1 - 2/(9 df), 2/(9 df)) for X ~ chi2(df)."""
    v = 2.0 / (9.0 * df)
    return ((stat / df) ** (1.0 / 3.0) - (1.0 - v)) / math.sqrt(v)


def inclusion_stat(counts: torch.Tensor, trials: int, k: int) -> tuple[float, int]:
    """Chi-square statistic for per-item inclusion counts of k-of-n sampling without
    replacement over ``trials`` independent draws.

    count_i ~ T*p with Var = T p (1-p), p = k/n, and the counts sum to T*k exactly, so
    the covariance is T p (1-p) n/(n-1) (I - 11^T/n): the quadratic form reduces to
    (n-1)/n * sum (O-E)^2 / (T p (1-p)) ~ chi2(n-1).
    """
    n = counts.numel()
    p = k / n
    expected = trials * p
    stat = float(((counts.double() - expected) ** 2).sum()) / (trials * p * (1 - p)) * (n - 1) / n
    return stat, n - 1


def multinomial_stat(counts: torch.Tensor, trials: int) -> tuple[float, int]:
    expected = trials / counts.numel()
    return float(((counts.double() - expected) ** 2).sum() / expected), counts.numel() - 1


def budget(num_local: int, rate: str) -> int:
    """floor(r * C_q) for the decimal r, exactly."""
    return math.floor(Fraction(rate) * num_local)


def check_active(active, positives, num_local, rate):
    assert active.dtype == torch.int64
    expected_size = max(budget(num_local, rate), positives.numel())
    assert active.numel() == expected_size
    if active.numel():
        assert int(active.min()) >= 0 and int(active.max()) < num_local
        assert bool((active[1:] > active[:-1]).all()), "not sorted / not unique"
    assert set(positives.tolist()) <= set(active.tolist())


# ---------------------------------------------------------------- basic contract
@pytest.mark.parametrize("num_local,rate,positives", [
    (1021, "0.1", [0, 5, 17, 1020]),
    (1021, "0.37", list(range(0, 1021, 97))),
    (100, "0.29", [3, 4, 5]),          # 0.29 * 100 = 28.999999999999996 in binary
    (10, "0.7", [9]),                   # 0.7 * 10 = 7.000000000000001 in binary
    (37, "0.5", []),                    # no positives at all
    (37, "0.03", []),                   # budget 1
    (37, "0.02", []),                   # budget 0: empty active set
    (7, "0.5", [0, 1, 2, 3, 4, 5, 6]),  # every class positive
])
@pytest.mark.parametrize("step", [0, 1, 12345])
def test_active_set_contract(num_local, rate, positives, step):
    pos = torch.tensor(positives, dtype=torch.int64)
    active = sample_active(pos, num_local, float(rate), seed=11, step=step, rank=0)
    check_active(active, pos, num_local, rate)


def test_positives_exceeding_budget_give_exactly_the_positives():
    pos = torch.tensor([1, 4, 8, 15, 16, 23, 42, 99, 100, 500, 1020])
    active = sample_active(pos, 1021, 0.005, seed=0, step=3, rank=2)  # budget 5 < 11
    assert torch.equal(active, pos)
    # exactly at the budget: also only the positives
    active = sample_active(pos[:5], 1021, 0.005, seed=0, step=3, rank=2)
    assert torch.equal(active, pos[:5])


def test_rate_one_returns_every_class():
    pos = torch.tensor([2, 30])
    for num_local in (1, 37, 1021):
        active = sample_active(pos[pos < num_local], num_local, 1.0, seed=5, step=9, rank=1)
        assert torch.equal(active, torch.arange(num_local))


@pytest.mark.parametrize("space,num_draw", [
    (400, 100),
    (4001, 1000),
    (10**6, 999),  # very sparse
    (50, 49),      # all but one
    (50, 50),      # everything
])
def test_pools_of_every_density_produce_valid_sets(space, num_draw):
    """Pool of negatives = ``space``; positives are spread over the classes."""
    num_pos = 7
    num_local = space + num_pos
    pos = torch.linspace(0, num_local - 1, num_pos).round().long().unique()
    assert pos.numel() == num_pos
    rate = Fraction(num_draw + num_pos, num_local)
    rate_f = float(rate)
    for step in range(3):
        active = sample_active(pos, num_local, rate_f, seed=3, step=step, rank=0)
        assert active.numel() == num_draw + num_pos
        assert bool((active[1:] > active[:-1]).all())
        assert int(active.min()) >= 0 and int(active.max()) < num_local
        assert set(pos.tolist()) <= set(active.tolist())


# ---------------------------------------------------------------- determinism
def test_pure_function_of_seed_step_rank_positives():
    pos = torch.tensor([3, 77, 500])
    kw = dict(seed=123, step=7, rank=1)
    a = sample_active(pos, 1021, 0.2, **kw)
    b = sample_active(pos.clone(), 1021, 0.2, **kw)
    torch.manual_seed(999)  # global RNG state must not matter
    c = sample_active(torch.tensor([3, 77, 500]), 1021, 0.2, **kw)
    assert torch.equal(a, b) and torch.equal(a, c)
    for change in (dict(seed=124), dict(step=8), dict(rank=0)):
        other = sample_active(pos, 1021, 0.2, **{**kw, **change})
        check_active(other, pos, 1021, "0.2")
        assert not torch.equal(a, other), f"{change} did not change the draw"


def test_distinct_steps_give_distinct_sets():
    pos = torch.tensor([10])
    seen = {tuple(sample_active(pos, 1021, 0.05, seed=0, step=s, rank=0).tolist()) for s in range(50)}
    assert len(seen) == 50


# ---------------------------------------------------------------- uniformity
@pytest.mark.parametrize("num_local,rate,positives", [
    (64, "0.3125", [0, 7, 30, 63]),           # 16 negatives of 60
    (256, "0.125", [1, 2, 100, 200, 255]),   # 27 negatives of 251
])
def test_negatives_uniform_inclusion_frequency(num_local, rate, positives):
    pos = torch.tensor(positives)
    # The head's form of the positives: gathered local labels, repeated, -1 for another rank's.
    labels = torch.tensor(positives + positives[:2] + [-1, -1])
    num_neg = budget(num_local, rate) - len(positives)
    pool = num_local - len(positives)
    trials = 3000
    counts = torch.zeros(num_local, dtype=torch.int64)
    for step in range(trials):
        active = sample_active(labels, num_local, float(rate), seed=2024, step=step, rank=3)
        counts[active] += 1
    assert bool((counts[pos] == trials).all())
    neg_mask = torch.ones(num_local, dtype=torch.bool)
    neg_mask[pos] = False
    neg_counts = counts[neg_mask]
    assert int(neg_counts.sum()) == trials * num_neg
    stat, df = inclusion_stat(neg_counts, trials, num_neg)
    assert chi2_z(stat, df) < Z_MAX, (stat, df)
    # Power check of the same statistic: a sampler that favours the first negatives
    # by only 15 % is rejected, so the acceptance above means something.
    biased = neg_counts.double().clone()
    shift = 0.15 * trials * num_neg / pool
    biased[: pool // 2] += shift
    biased[pool // 2: 2 * (pool // 2)] -= shift
    stat_b, _ = inclusion_stat(biased, trials, num_neg)
    assert chi2_z(stat_b, df) > Z_MAX


@pytest.mark.parametrize("num_local,rate,positives,trials", [
    (8, "0.625", [2, 5], 4000),      # 3 negatives of 6: 20 subsets
    (16, "0.3125", [3, 9], 36400),   # 3 negatives of 14: 364 subsets
])
def test_every_negative_subset_equally_likely(num_local, rate, positives, trials):
    """Uniform without replacement <=> every k-subset of the pool equally likely.
    This also covers pairwise inclusion: each pair lies in the same number of subsets."""
    pos = torch.tensor(positives)
    pool = [c for c in range(num_local) if c not in positives]
    k = budget(num_local, rate) - len(positives)
    subsets = {s: i for i, s in enumerate(itertools.combinations(pool, k))}
    counts = torch.zeros(len(subsets), dtype=torch.int64)
    pair_counts = {}
    for step in range(trials):
        active = sample_active(pos, num_local, float(rate), seed=77, step=step, rank=0).tolist()
        negs = tuple(c for c in active if c not in positives)
        counts[subsets[negs]] += 1
        for pair in itertools.combinations(negs, 2):
            pair_counts[pair] = pair_counts.get(pair, 0) + 1
    stat, df = multinomial_stat(counts, trials)
    assert chi2_z(stat, df) < Z_MAX, (stat, df)
    # pairwise inclusion: P({i, j} subset of negatives) = k(k-1) / (n(n-1))
    n = len(pool)
    p_pair = k * (k - 1) / (n * (n - 1))
    assert len(pair_counts) == n * (n - 1) // 2
    worst = max(abs(c - trials * p_pair) / math.sqrt(trials * p_pair * (1 - p_pair))
                for c in pair_counts.values())
    assert worst < 5.0, worst


# ---------------------------------------------------------------- the exact draw
M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def splitmix64_out(state: int) -> int:
    """splitmix64's output for the state after adding the increment (Vigna's reference)."""
    z = (state + GAMMA) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def reference_draw(labels, num_local, rate, seed, step, rank):
    """The documented draw with Python ints: stream seed = hash(seed, rank); class i of
    step s has key splitmix64 output s C_q + i (top 62 bits); S = positives, then the
    negatives by decreasing key, up to max(b, |P|) classes."""
    state = splitmix64_out(seed & M64)
    base = splitmix64_out(state ^ rank)
    keys = [splitmix64_out((base + (step * num_local + i) * GAMMA) & M64) >> 2 for i in range(num_local)]
    pos = {int(c) for c in labels if c >= 0}
    size = max(budget(num_local, rate), len(pos))
    negs = sorted((c for c in range(num_local) if c not in pos), key=lambda c: -keys[c])
    return sorted(list(pos) + negs[: size - len(pos)])


@pytest.mark.parametrize("num_local,rate,labels,seed,step,rank", [
    (1021, "0.1", [5, -1, 17, 5, 1020, 0], 0, 0, 0),
    (1021, "0.1", [5, -1, 17, 5, 1020, 0], 0, 1, 0),
    (1021, "0.1", [5, -1, 17, 5, 1020, 0], 9, 1, 3),
    (333, "0.5", list(range(0, 333, 7)), 2 ** 62 + 5, 2 ** 33, 7),
    (100, "0.03", [1, 50, 99, 98], 1, 2, 0),      # positives exceed the budget of 3
    (37, "0.3", [-1, -1, -1], 4, 5, 1),           # no positive at all
])
def test_draw_equals_python_reference(num_local, rate, labels, seed, step, rank):
    lab = torch.tensor(labels)
    active = sample_active(lab, num_local, float(rate), seed=seed, step=step, rank=rank)
    assert active.tolist() == reference_draw(labels, num_local, rate, seed, step, rank)
    # The step as a 0-d tensor (how the head passes its device counter) draws the same set.
    again = sample_active(lab, num_local, float(rate), seed=seed, step=torch.tensor(step), rank=rank)
    assert torch.equal(active, again)


def test_fixed_size_draw_needs_no_host_sync():
    """Budget >= number of label entries: the size is the budget, known to the host, and
    nothing reads the device. Below that the positives' count is read back once."""
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(-1, 1000, (64,), generator=gen)
    step = torch.tensor(3)
    with OpCounter() as c:
        active = sample_active(labels, 1000, 0.1, seed=0, step=step, rank=0)     # budget 100 >= 64
    assert c.syncs == 0, c.sync_ops
    check_active(active, torch.unique(labels[labels >= 0]), 1000, "0.1")
    with OpCounter() as c:
        active = sample_active(labels, 1000, 0.05, seed=0, step=step, rank=0)    # budget 50 < 64
    assert c.syncs == 1, c.sync_ops
    check_active(active, torch.unique(labels[labels >= 0]), 1000, "0.05")


def test_same_set_whatever_form_the_positives_take():
    """Sorted unique positives, the gathered labels with repeats and -1 entries, and any
    order of them: one set (the draw depends on the set of positives only)."""
    pos = [3, 77, 500, 1000]
    forms = [pos, [500, -1, 3, 3, 1000, 77, -1, 500], [1000, 500, 77, 3]]
    sets = [sample_active(torch.tensor(f), 1021, 0.2, seed=5, step=2, rank=1) for f in forms]
    assert all(torch.equal(sets[0], s) for s in sets[1:])


# ---------------------------------------------------------------- remap
def test_remap_labels_maps_to_columns():
    gen = torch.Generator().manual_seed(5)
    num_local = 1021
    labels = torch.randint(-1, num_local, (37,), generator=gen)
    labels[::5] = -1
    pos = torch.unique(labels[labels >= 0])
    active = sample_active(pos, num_local, 0.1, seed=0, step=4, rank=0)
    cols = remap_labels(labels, active)
    assert cols.shape == labels.shape
    owned = labels >= 0
    assert bool((cols[~owned] == -1).all())
    assert torch.equal(active[cols[owned]], labels[owned])
    # brute force: column = index in the sorted list
    listed = active.tolist()
    assert cols[owned].tolist() == [listed.index(v) for v in labels[owned].tolist()]


# ---------------------------------------------------------------- head level
def _train_steps(head, steps, gen, n=37):
    for _ in range(steps):
        x = torch.randn(n, head.embedding_size, generator=gen)
        y = torch.randint(0, head.num_classes, (n,), generator=gen)
        head(x, y).backward()
        head.step(0.1)


def test_head_resume_samples_the_same_sets():
    gen = torch.Generator().manual_seed(0)
    kw = dict(sample_rate=0.2, margin=ArcFace(16.0, 0.3), seed=31)
    head = PartialFC(1021, 7, **kw)
    _train_steps(head, 3, gen)
    assert head.sample_step == 3
    sd = head.state_dict()
    resumed = PartialFC(1021, 7, **{**kw, "seed": 0})  # the seed comes from the checkpoint
    resumed.load_state_dict(sd)
    assert resumed.sample_step == 3
    labels = torch.randint(0, 1021, (37,), generator=gen)
    for step in (None, 0, 3, 4, 99):
        a = head.active_set(labels, step)
        b = resumed.active_set(labels, step)
        assert torch.equal(a, b)
        check_active(a, torch.unique(labels), 1021, "0.2")
    assert not torch.equal(head.active_set(labels, 3), head.active_set(labels, 4))
    # The next training forward of both uses the sets of sample_step 3, then 4.
    x = torch.randn(37, 7, generator=gen)
    for h in (head, resumed):
        h(x, labels).backward()
        h.step(0.1)
        assert h.sample_step == 4
    assert torch.equal(head.centers(), resumed.centers())


def test_head_active_set_ignores_foreign_labels():
    head = PartialFC(1021, 7, sample_rate=0.05, seed=4)
    local = torch.tensor([-1, 3, -1, 900, 3])
    active = head.active_set(local, 2)
    check_active(active, torch.tensor([3, 900]), 1021, "0.05")
    assert torch.equal(active, sample_active(torch.tensor([3, 900]), 1021, 0.05, seed=4, step=2, rank=0))
    assert PartialFC(13, 3, sample_rate=1.0).active_set(local[local < 13]) is None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the key kernel runs on CPU tensors only in Triton's interpreter (TRITON_INTERPRET=1, "
                           "set by conftest.py when there is no GPU)")
@pytest.mark.parametrize("num_local,seed,step,rank,spare", [
    (1, 0, 0, 0, 1), (1000, 7, 3, 1, 1), (4097, 2 ** 40 + 5, 2 ** 33 + 11, 6, 0), (37, 123, 2 ** 62, 3, 1)])
def test_key_kernel_matches_the_torch_keys_bit_for_bit(num_local, seed, step, rank, spare):
    """The one-pass Triton kernel (used on CUDA and when a GPU step is counted) writes exactly the
    keys of the int64 torch ops, for an int step and a device-tensor step."""
    from ds_pfc.kernels._target import gpu_tiles
    from ds_pfc.core.sampling import class_keys
    expected = class_keys(num_local, seed, step, rank, "cpu", spare=spare)     # torch ops
    import ds_pfc.kernels.triton_keys  # noqa: F401  (imported before counting, so its launches are seen)
    with gpu_tiles(sms=132), OpCounter() as counter:                           # the kernel
        got_int = class_keys(num_local, seed, step, rank, "cpu", spare=spare)
        got_t = class_keys(num_local, seed, torch.tensor(step, dtype=torch.int64), rank, "cpu", spare=spare)
    assert counter.by_op["triton:_keys_kernel"] == 2
    assert torch.equal(got_int, expected) and torch.equal(got_t, expected)
    assert int(expected.min()) >= 0 and int(expected.max()) < 2 ** 62


# ---------------------------------------------------------------- the selection of the largest keys
def largest_reference(keys: torch.Tensor, k: int) -> list[int]:
    """Ascending ids of the k largest keys, ties to the smaller id: a Python sort of (key, id)."""
    values = keys.tolist()
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))
    return sorted(order[:k])


def topk_reference(keys: torch.Tensor, k: int) -> torch.Tensor:
    """topk, then a sort of the ids (with no tie at the boundary, the set of the k largest)."""
    if k == 0:
        return torch.zeros(0, dtype=torch.int64)
    return torch.sort(torch.topk(keys, k, sorted=False).indices).values


BUCKET = 1 << 48            # keys sharing key >> 48 share a histogram bucket


def _key_vectors():
    """(name, keys) with every shape the selection meets: uniform keys, ties of every
    width, one crowded bucket, positives, extremes and bucket edges, odd lengths."""
    gen = torch.Generator().manual_seed(7)

    def uniform(n):
        return torch.randint(0, POSITIVE_KEY, (n,), generator=gen)

    cases = []
    for n in (1, 2, 3, 5, 64, 1021, 4093):
        cases.append((f"uniform-{n}", uniform(n)))
    for n in (1, 2, 7, 1000):
        cases.append((f"all-zero-{n}", torch.zeros(n, dtype=torch.int64)))
        cases.append((f"all-positive-{n}", torch.full((n,), POSITIVE_KEY)))
        cases.append((f"all-equal-{n}", torch.full((n,), 12345 * BUCKET + 42)))
    # one bucket, keys differing only in their low bits (many ties among them too)
    cases.append(("one-bucket-low-bits", 5 * BUCKET + torch.randint(0, 50, (4001,), generator=gen)))
    cases.append(("one-bucket-distinct", 9 * BUCKET + torch.randperm(3001, generator=gen)))
    # two neighbouring buckets and their edges
    edges = torch.tensor([BUCKET - 1, BUCKET, BUCKET + 1, 2 * BUCKET - 1, 0, POSITIVE_KEY - 1, POSITIVE_KEY])
    cases.append(("bucket-edges", edges[torch.randint(0, edges.numel(), (999,), generator=gen)]))
    # positives (tied at POSITIVE_KEY) among uniform keys; a crowded bucket below them
    keys = uniform(2047)
    keys[torch.randint(0, 2047, (300,), generator=gen)] = POSITIVE_KEY
    cases.append(("positives", keys))
    keys = uniform(3333)
    keys[::3] = POSITIVE_KEY - 1 - torch.randint(0, 4, (1111,), generator=gen)
    keys[::7] = POSITIVE_KEY
    cases.append(("positives-over-a-crowded-bucket", keys))
    return cases


KEY_VECTORS = _key_vectors()


@pytest.mark.parametrize("name,keys", KEY_VECTORS, ids=[c[0] for c in KEY_VECTORS])
def test_largest_ids_equals_a_sort_of_key_id_pairs(name, keys):
    n = keys.numel()
    gen = torch.Generator().manual_seed(n)
    sizes = {0, 1, n // 2, n - 1, n} | set(torch.randint(0, n + 1, (6,), generator=gen).tolist())
    for k in sorted(s for s in sizes if 0 <= s <= n):
        got = _largest_ids(keys, k)
        assert got.dtype == torch.int64 and got.shape == (k,)
        assert got.tolist() == largest_reference(keys, k), (name, k)
        sorted_keys = torch.sort(keys, descending=True).values
        if 0 < k < n and sorted_keys[k - 1] != sorted_keys[k]:
            # the k largest are unique: topk + sort, whatever its tie rule, gives the same set
            assert torch.equal(got, topk_reference(keys, k)), (name, k)


@pytest.mark.parametrize("n", [4097, 65_537, 300_007])
def test_largest_ids_equals_topk_on_uniform_keys_past_the_minimum_capacity(n):
    """Past 4096 keys the boundary bucket is sorted within its capacity; uniform keys stay
    far below it."""
    gen = torch.Generator().manual_seed(n)
    keys = torch.randint(0, POSITIVE_KEY, (n,), generator=gen)
    keys[torch.randint(0, n, (500,), generator=gen)] = POSITIVE_KEY
    num_pos = int((keys == POSITIVE_KEY).sum())
    for k in sorted(k for k in {num_pos, num_pos + 1, n // 10, n // 2, n - 1} if k >= num_pos):
        assert torch.equal(_largest_ids(keys, k), topk_reference(keys, k)), k
    for k in (1, num_pos // 2):       # a split of the tied positives: the smaller ids first
        assert torch.equal(_largest_ids(keys, k), torch.nonzero(keys == POSITIVE_KEY).squeeze(1)[:k])


def test_largest_ids_takes_a_crowded_bucket_whole_or_refuses():
    """A bucket above its capacity is fine above the boundary, or as the boundary when it
    is taken whole (the positives' bucket when exactly the positives are drawn); as a
    boundary split in two it fails loudly rather than return another set."""
    n = 20_000
    crowd = _bucket_capacity(n) + 1000
    gen = torch.Generator().manual_seed(3)
    keys = torch.randint(0, POSITIVE_KEY, (n,), generator=gen)
    keys[:crowd] = POSITIVE_KEY
    for k in (crowd, crowd + 1, crowd + 777):
        assert _largest_ids(keys, k).tolist() == largest_reference(keys, k), k
    keys[crowd:] = torch.randint(0, 1 << 40, (n - crowd,), generator=gen)       # all in bucket 0
    assert _largest_ids(keys, crowd).tolist() == list(range(crowd))
    assert _largest_ids(keys, n).tolist() == list(range(n))
    with pytest.raises(RuntimeError, match="boundary bucket"):
        _largest_ids(keys, crowd + 1)


def test_largest_ids_names_bad_arguments():
    keys = torch.arange(10)
    with pytest.raises(ValueError, match="size"):
        _largest_ids(keys, 11)
    with pytest.raises(ValueError, match="size"):
        _largest_ids(keys, -1)
    with pytest.raises(ValueError, match="keys"):
        _largest_ids(keys.int(), 3)
    with pytest.raises(ValueError, match="keys"):
        _largest_ids(keys.view(2, 5), 3)


def topk_draw(labels, num_local, rate, seed, step, rank):
    """The documented draw with topk + sort as the selection: the keys, the positives' keys
    overwritten, the size read from the device below N labels."""
    keys = class_keys(num_local, seed, step, rank, spare=1)
    owned = labels.reshape(-1).long()
    owned = torch.where(owned >= 0, owned, torch.full_like(owned, num_local))
    keys.index_fill_(0, owned, POSITIVE_KEY)
    keys = keys[:num_local]
    size = activation_budget(num_local, rate)
    if size < owned.numel():
        size = max(size, int((keys == POSITIVE_KEY).sum()))
    return topk_reference(keys, size)


@pytest.mark.parametrize("num_local,rate,num_labels", [
    (1021, 0.1, 37),
    (4099, 0.25, 200),
    (65_537, 0.1, 512),
    (300_007, 0.1, 1024),
    (300_007, 0.01, 1024),
    (1021, 0.01, 64),        # budget 10 < 64 labels: the size is read from the device
    (65_537, 0.001, 512),    # budget 65 < 512 labels
])
def test_sample_active_equals_the_topk_draw(num_local, rate, num_labels):
    gen = torch.Generator().manual_seed(num_local + num_labels)
    for seed, step, rank in ((0, 0, 0), (5, 1, 3), (2 ** 40 + 1, 2 ** 33, 7)):
        labels = torch.randint(-1, num_local, (num_labels,), generator=gen)
        labels[: num_labels // 4] = labels[num_labels // 4: 2 * (num_labels // 4)]    # repeats
        labels[::9] = -1                                                           # another rank's
        expected = topk_draw(labels, num_local, rate, seed, step, rank)
        got = sample_active(labels, num_local, rate, seed=seed, step=step, rank=rank)
        assert torch.equal(got, expected), (seed, step, rank)
        got_t = sample_active(labels, num_local, rate, seed=seed, step=torch.tensor(step), rank=rank)
        assert torch.equal(got_t, expected)


def test_sample_active_draws_exactly_many_positives_past_the_bucket_capacity():
    """b_q = N = |P_q| > the capacity of a bucket: the positives' bucket is the boundary and
    is taken whole, with no sync."""
    num_local = 50_000
    labels = torch.randperm(num_local, generator=torch.Generator().manual_seed(0))[:5000]
    assert 5000 > _bucket_capacity(num_local)
    with OpCounter() as c:
        active = sample_active(labels, num_local, 0.1, seed=1, step=torch.tensor(2), rank=0)
    assert c.syncs == 0, c.sync_ops
    assert torch.equal(active, torch.sort(labels).values)


@pytest.mark.parametrize("num_local", [1000, 100_003])
def test_selection_needs_no_host_sync(num_local):
    """The selection reads no device value: the boundary bucket, its count and the ranks
    stay on the device, every shape is fixed by the host's size."""
    gen = torch.Generator().manual_seed(2)
    keys = class_keys(num_local, 3, torch.tensor(4), 0)
    labels = torch.randint(-1, num_local, (min(256, num_local // 10),), generator=gen)   # budget >= N
    with OpCounter() as c:
        ids = _largest_ids(keys, num_local // 10)
        active = sample_active(labels, num_local, 0.1, seed=3, step=torch.tensor(4), rank=0)
    assert c.syncs == 0, c.sync_ops
    assert "topk" not in c.by_op and "nonzero" not in c.by_op
    assert torch.equal(ids, topk_reference(keys, num_local // 10))
    assert torch.equal(active, topk_draw(labels, num_local, 0.1, 3, 4, 0))
