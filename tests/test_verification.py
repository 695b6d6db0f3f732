"""1:1 verification (``ds_pfc.eval.verification``).

References here share no code with the module:
- accuracy: plain-Python loops over the thresholds ``i * 0.01`` and over the pairs of
  each fold (folds sized like sklearn ``KFold``), distances from Python floats;
- TAR@FAR: a sweep over the pairs sorted by distance, accepting the best TAR among
  all thresholds whose FAR, as an exact ``Fraction`` of the decimal target, is within
  the target;
- flip TTA: the sum ``f(x) + f(flip x)`` written out by hand;
- ``.bin`` files written here with ``pickle`` (and one hand-assembled Python 2 style
  pickle), including hostile ones that must be refused.
"""
from __future__ import annotations

import math
import os
import pickle
import statistics
from fractions import Fraction

import numpy as np
import pytest
import torch

from ds_pfc.eval import UnsafePickleError, embed, embed_pairs, load_bin, verification_metrics


# -- references -----------------------------------------------------------------------
def ref_distances(e1, e2):
    out = []
    for a, b in zip(e1.tolist(), e2.tolist()):
        na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
        out.append(sum((x / na - y / nb) ** 2 for x, y in zip(a, b)))
    return out


def ref_accuracy(dist, same, nfolds):
    n = len(dist)
    sizes = [n // nfolds + (1 if f < n % nfolds else 0) for f in range(nfolds)]
    folds, start = [], 0
    for size in sizes:
        folds.append(list(range(start, start + size)))
        start += size
    thresholds = [i * 0.01 for i in range(400)]
    accs, best = [], []
    for test in folds:
        train = [i for i in range(n) if i not in set(test)]
        best_acc, best_t = -1.0, None
        for t in thresholds:
            acc = sum((dist[i] < t) == same[i] for i in train) / len(train)
            if acc > best_acc:  # strict: the first threshold among equals
                best_acc, best_t = acc, t
        best.append(best_t)
        accs.append(sum((dist[i] < best_t) == same[i] for i in test) / len(test))
    return statistics.fmean(accs), statistics.pstdev(accs), accs, best


def ref_tar_at_far(dist, same, far):
    pos = sum(same)
    neg = len(same) - pos
    target = Fraction(repr(far))
    if pos == 0 or target * neg < 1:
        return math.nan
    pairs = sorted(zip(dist, same))
    best, i, tp, fp = 0.0, 0, 0, 0
    while True:
        # threshold t = next distinct distance (or +inf): accepted = pairs with d < t
        if Fraction(fp, neg) <= target:
            best = max(best, tp / pos)
        if i == len(pairs):
            return best
        d = pairs[i][0]
        while i < len(pairs) and pairs[i][0] == d:
            tp += pairs[i][1]
            fp += not pairs[i][1]
            i += 1


def random_pairs(n, dim, seed, p_same=0.5, noise=0.9):
    g = torch.Generator().manual_seed(seed)
    e1 = torch.randn(n, dim, generator=g, dtype=torch.float64)
    same = torch.rand(n, generator=g) < p_same
    e2 = torch.where(same[:, None], e1 + noise * torch.randn(n, dim, generator=g, dtype=torch.float64),
                     torch.randn(n, dim, generator=g, dtype=torch.float64))
    return e1, e2, same.tolist()


# -- accuracy ---------------------------------------------------------------------------
@pytest.mark.parametrize("n,nfolds", [(203, 10), (61, 7)])
def test_accuracy_matches_bruteforce(n, nfolds):
    e1, e2, same = random_pairs(n, 9, seed=n)
    got = verification_metrics(e1, e2, same, nfolds=nfolds)
    mean, std, accs, best = ref_accuracy(ref_distances(e1, e2), same, nfolds)
    assert got.best_thresholds == pytest.approx(best, abs=0)
    assert got.fold_accuracies == pytest.approx(accs, abs=1e-15)
    assert got.accuracy == pytest.approx(mean, abs=1e-12)
    assert got.accuracy_std == pytest.approx(std, abs=1e-12)
    assert 0.6 < got.accuracy < 1.0  # informative data, not a degenerate case


def test_accuracy_with_exact_ties():
    # Axis directions in 2-D: squared distances are exactly 0, 2 or 4, which are also
    # thresholds (200 * 0.01 == 2.0), so "<" vs "<=" and first-of-equal-maxima matter.
    g = torch.Generator().manual_seed(3)
    axes = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]], dtype=torch.float64)
    n = 97
    e1 = axes[torch.randint(0, 4, (n,), generator=g)] * 3.0
    e2 = axes[torch.randint(0, 4, (n,), generator=g)] * 0.5
    same = (torch.rand(n, generator=g) < 0.6).tolist()
    dist = ref_distances(e1, e2)
    assert set(dist) <= {0.0, 2.0, 4.0} and 200 * 0.01 == 2.0
    got = verification_metrics(e1, e2, same, nfolds=10)
    mean, std, accs, best = ref_accuracy(dist, same, 10)
    assert got.best_thresholds == tuple(best)
    assert got.fold_accuracies == pytest.approx(accs, abs=1e-15)
    assert (got.accuracy, got.accuracy_std) == pytest.approx((mean, std), abs=1e-12)


def test_perfect_and_normalisation():
    e1, e2, same = random_pairs(50, 6, seed=1, noise=0.01)
    got = verification_metrics(e1, e2, same)
    assert got.accuracy == 1.0 and got.accuracy_std == 0.0
    # scale does not matter: distances are between L2-normalised embeddings
    scaled = verification_metrics(e1 * 7.0, e2 * 0.1, same)
    assert scaled.best_thresholds == got.best_thresholds
    # float32 and tensor labels give the same thresholds here
    f32 = verification_metrics(e1.float(), e2.float(), torch.tensor(same))
    assert f32.accuracy == 1.0


# -- TAR@FAR ------------------------------------------------------------------------------
@pytest.mark.parametrize("ties", [True, False], ids=["grid", "interleaved"])
def test_tar_at_far_matches_sorted_sweep(ties):
    # 12,345 impostor pairs: FAR 1e-4 allows 1 false accept, 1e-3 12, ... "grid":
    # distances rounded to a coarse grid so that many pairs tie. "interleaved":
    # continuous distances plus a genuine pair between each two consecutive low
    # impostor distances, so that an off-by-one in the threshold changes the TAR.
    g = torch.Generator().manual_seed(7)
    num_neg = 12345
    d_neg = 1.0 + torch.rand(num_neg, generator=g) * 3.0
    if ties:
        d_pos = (torch.rand(1001, generator=g) * 2.2).mul(50).round().div(50)
        d_neg = d_neg.mul(50).round().div(50)
    else:
        low = d_neg.sort().values[:4000]
        d_pos = torch.cat([torch.rand(1001, generator=g) * 2.2, (low[:-1] + low[1:]) / 2])
    num_pos = d_pos.numel()
    perm = torch.randperm(num_pos + num_neg, generator=g)
    dist = torch.cat([d_pos, d_neg])[perm]
    same = (perm < num_pos)
    # embeddings with exactly these squared distances: unit vectors at angle theta,
    # |a - b|^2 = 2 - 2 cos(theta)
    theta = torch.acos((1 - dist.double() / 2).clamp(-1, 1))
    e1 = torch.stack([torch.ones_like(theta), torch.zeros_like(theta)], 1)
    e2 = torch.stack([torch.cos(theta), torch.sin(theta)], 1)
    far_targets = (1e-6, 1e-4, 1e-3, 0.01, 0.3, 1.0)
    got = verification_metrics(e1, e2, same, far_targets=far_targets)
    # The distances as the module realises them (normalise, then squared L2): one ulp
    # off would move the (k+1)-th impostor across its own threshold. The distance
    # formula itself is checked against plain Python in the accuracy tests.
    n1, n2 = torch.nn.functional.normalize(e1, dim=1), torch.nn.functional.normalize(e2, dim=1)
    ref_dist = (n1 - n2).pow(2).sum(1).tolist()
    for far in far_targets:
        want = ref_tar_at_far(ref_dist, same.tolist(), far)
        if math.isnan(want):
            assert far == 1e-6 and math.isnan(got.tar_at_far[far]) and math.isnan(got.far_thresholds[far])
        else:
            assert got.tar_at_far[far] == pytest.approx(want, abs=1e-12), far
            fa = sum(d < got.far_thresholds[far] for d, s in zip(ref_dist, same.tolist()) if not s)
            assert Fraction(fa, num_neg) <= Fraction(repr(far))
    assert got.tar_at_far[1.0] == 1.0 and got.far_thresholds[1.0] == math.inf
    assert 0 < got.tar_at_far[1e-4] < got.tar_at_far[0.01] < got.tar_at_far[0.3] < 1


def test_tar_at_far_boundary_and_nan():
    # exactly 1/far impostors: measurable (one false accept allowed), not NaN
    e1, e2, same = random_pairs(10100, 4, seed=11, p_same=0.0)
    same[:100] = [True] * 100
    assert same.count(False) == 10000
    got = verification_metrics(e1, e2, same, far_targets=(1e-4, 1e-6))
    dist = ref_distances(e1, e2)
    assert got.tar_at_far[1e-4] == pytest.approx(ref_tar_at_far(dist, same, 1e-4), abs=1e-12)
    assert not math.isnan(got.tar_at_far[1e-4]) and math.isnan(got.tar_at_far[1e-6])
    # LFW-sized: 3000 impostors cannot measure FAR=1e-4
    e1, e2, same = random_pairs(6000, 4, seed=12)
    got = verification_metrics(e1, e2, same)
    assert set(got.tar_at_far) == {1e-4, 1e-6} and all(math.isnan(v) for v in got.tar_at_far.values())
    # no genuine pair
    e1, e2, _ = random_pairs(20, 4, seed=13)
    assert math.isnan(verification_metrics(e1, e2, [False] * 20, far_targets=(0.5,)).tar_at_far[0.5])


def test_metric_argument_errors():
    e1, e2, same = random_pairs(30, 4, seed=2)
    with pytest.raises(ValueError, match="one entry per pair"):
        verification_metrics(e1, e2, same[:-1])
    with pytest.raises(ValueError, match="nfolds"):
        verification_metrics(e1, e2, same, nfolds=31)
    with pytest.raises(ValueError, match="same shape"):
        verification_metrics(e1, e2[:, :3], same)
    with pytest.raises(ValueError, match="far_targets"):
        verification_metrics(e1, e2, same, far_targets=(0.0,))
    with pytest.raises(ValueError, match="issame must hold bools"):
        verification_metrics(e1, e2, [2] * 30)
    with pytest.raises(ValueError, match="NaN"):
        verification_metrics(e1 * float("nan"), e2, same)


# -- flip TTA -----------------------------------------------------------------------------
class Asymmetric(torch.nn.Module):
    """Linear on the flattened image with a width-asymmetric weight, plus dropout that
    would make outputs random if eval mode were not set."""

    def __init__(self, in_features, dim=16):
        super().__init__()
        self.fc = torch.nn.Linear(in_features, dim)
        self.drop = torch.nn.Dropout(0.5)
        self.seen = []

    def forward(self, x):
        self.seen.append((self.training, torch.is_grad_enabled(), x.shape[0]))
        return self.fc(self.drop(x.flatten(1)))


def test_flip_tta_is_the_manual_sum():
    torch.manual_seed(0)
    images = torch.randn(10, 3, 112, 112)
    model = Asymmetric(3 * 112 * 112)
    model.train()
    got = embed(model, images, batch_size=3)
    assert model.training  # restored
    assert all(not training and not grad for training, grad, _ in model.seen)
    assert [b for _, _, b in model.seen] == [3, 3, 3, 3, 3, 3, 1, 1]  # each batch, then its flip
    model.eval()
    with torch.no_grad():
        manual = model(images) + model(torch.flip(images, dims=[3]))
    manual = manual / manual.norm(dim=1, keepdim=True)
    assert torch.allclose(got, manual, atol=1e-6)
    no_flip = embed(model, images, batch_size=4, flip=False)
    assert not model.training  # eval stays eval
    with torch.no_grad():
        plain = model(images)
    assert torch.allclose(no_flip, plain / plain.norm(dim=1, keepdim=True), atol=1e-6)
    assert (no_flip - got).abs().max() > 1e-2  # the model is not flip-invariant


def test_embed_pairs_plain_callable():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3 * 5 * 7, 4, generator=g)
    model = lambda x: x.flatten(1) @ w  # no .eval/.train: left alone
    images = torch.randn(6, 3, 5, 7, generator=g)
    e1, e2 = embed_pairs(model, images, batch_size=4)
    full = embed(model, images, batch_size=6)
    assert torch.equal(e1, full[0::2]) and torch.equal(e2, full[1::2])
    assert torch.allclose(e1.norm(dim=1), torch.ones(3))
    with pytest.raises(ValueError, match="even count"):
        embed_pairs(model, images[:5], batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        embed(model, images, batch_size=0)
    with pytest.raises(ValueError, match=r"\[M, C, H, W\]"):
        embed(model, images[0], batch_size=2)


# -- .bin files ---------------------------------------------------------------------------
def test_load_bin_bytes_and_numpy(tmp_path):
    bins = [bytes([i, 255, 216, 0]) + bytes(i) for i in range(10)]
    issame = [True, False, False, True, True]
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        path = tmp_path / f"p{protocol}.bin"
        path.write_bytes(pickle.dumps((bins, issame), protocol=protocol))
        assert load_bin(path) == (bins, issame)
    # build_eval_pack.py style: cv2.imencode arrays; numpy bools
    path = tmp_path / "np.bin"
    path.write_bytes(pickle.dumps(([np.frombuffer(b, np.uint8) for b in bins], [np.bool_(s) for s in issame]),
                                  protocol=4))
    images, got_same = load_bin(str(path), decode=lambda b: len(b))
    assert images == [len(b) for b in bins] and got_same == issame
    assert all(type(s) is bool for s in got_same)
    path.write_bytes(pickle.dumps((bins, np.array(issame)), protocol=5))
    assert load_bin(path)[1] == issame


def test_load_bin_python2_pickle(tmp_path):
    # What Python 2 writes for (['\xff\xd8\x00', 'xy', '', 'z'], [True, False]) with
    # protocol 2: str items as SHORT_BINSTRING, which only encoding="bytes" turns into
    # bytes (the default, ASCII, fails on \xff).
    raw = (b"\x80\x02" b"]q\x00(" b"U\x03\xff\xd8\x00q\x01" b"U\x02xyq\x02" b"U\x00q\x03" b"U\x01zq\x04" b"e"
           b"]q\x05(\x88\x89e" b"\x86q\x06.")
    path = tmp_path / "py2.bin"
    path.write_bytes(raw)
    with pytest.raises(UnicodeDecodeError):
        pickle.loads(raw)
    assert load_bin(path) == ([b"\xff\xd8\x00", b"xy", b"", b"z"], [True, False])


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _EvalEvil:
    def __reduce__(self):
        return eval, ("__import__('os').getpid()",)


def test_load_bin_refuses_code(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.bin"
    path.write_bytes(pickle.dumps(([b"a", _Evil(marker)], [True])))
    with pytest.raises(UnsafePickleError, match=r"evil\.bin.*refusing to unpickle global '(posix|nt|os)\.system'"):
        load_bin(path)
    assert not marker.exists()
    path.write_bytes(pickle.dumps((_EvalEvil(), [True])))
    with pytest.raises(UnsafePickleError, match="builtins.eval"):
        load_bin(path)
    # hidden inside a numpy object array: the nested global goes through the same check
    arr = np.empty(2, dtype=object)
    arr[0], arr[1] = b"a", _Evil(marker)
    path.write_bytes(pickle.dumps((list(arr), [True]), protocol=2))
    with pytest.raises(UnsafePickleError):
        load_bin(path)
    path.write_bytes(pickle.dumps(([b"a", b"b"], arr), protocol=2))
    with pytest.raises(UnsafePickleError):
        load_bin(path)
    assert not marker.exists()
    assert issubclass(UnsafePickleError, ValueError) and issubclass(UnsafePickleError, pickle.UnpicklingError)


def test_load_bin_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.bin"):
        load_bin(tmp_path / "missing.bin")
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a pickle at all")
    with pytest.raises(ValueError, match=r"bad\.bin.*not a readable pickle"):
        load_bin(bad)
    good = pickle.dumps(([b"a", b"b", b"c", b"d"], [True, False]))
    bad.write_bytes(good[:-9])
    with pytest.raises(ValueError, match="not a readable pickle"):
        load_bin(bad)
    bad.write_bytes(pickle.dumps(([b"a", b"b"], [0.5], [True])))
    with pytest.raises(ValueError, match=r"\(bins, issame_list\) pair, got a tuple of length 3"):
        load_bin(bad)
    bad.write_bytes(pickle.dumps(([b"a", b"b", b"c"], [True, False])))
    with pytest.raises(ValueError, match="3 images for 2 pairs"):
        load_bin(bad)
    bad.write_bytes(pickle.dumps(([b"a", [1, 2]], [True])))
    with pytest.raises(ValueError, match="image 1 is a builtins.list"):
        load_bin(bad)
    bad.write_bytes(pickle.dumps(([b"a", b"b"], [2])))
    with pytest.raises(ValueError, match=r"issame_list\[0\] = 2"):
        load_bin(bad)


def test_bin_end_to_end(tmp_path):
    """Synthetic .bin -> decode -> embed_pairs -> metrics: an 'image' is 12 identity
    bytes plus 4 noise bytes, decoded into a 3x8x8 tensor; same pairs share identity."""
    g = torch.Generator().manual_seed(5)
    num_pairs = 120
    same = (torch.rand(num_pairs, generator=g) < 0.5).tolist()
    bins = []
    for i, s in enumerate(same):
        ida = torch.randint(0, 256, (12,), generator=g)
        idb = ida if s else torch.randint(0, 256, (12,), generator=g)
        for ident in (ida, idb):
            bins.append(bytes(ident.tolist() + torch.randint(0, 256, (4,), generator=g).tolist()))
    path = tmp_path / "synthetic.bin"
    path.write_bytes(pickle.dumps((bins, same), protocol=2))

    def decode(buf: bytes) -> torch.Tensor:
        v = torch.frombuffer(bytearray(buf), dtype=torch.uint8).float() / 127.5 - 1.0
        ident, noise = v[:12], v[12:]
        return (ident.repeat(16) + 0.05 * noise.repeat(48)).reshape(3, 8, 8)

    images, issame = load_bin(path, decode=decode)
    e1, e2 = embed_pairs(lambda x: x.flatten(1), torch.stack(images), batch_size=32)
    res = verification_metrics(e1, e2, issame)
    assert res.accuracy > 0.95 and len(res.best_thresholds) == 10
