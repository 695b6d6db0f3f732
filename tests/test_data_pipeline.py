"""Data pipeline: DistributedIdentitySampler, tensor transforms, local HF loader.

References: the sampler's shards are checked against plain set arithmetic and
against one uninterrupted pass; transforms against the formulas written out here;
the HF loader against tiny datasets built in each test (no Hub access).
"""
from __future__ import annotations

import os

import pytest
import torch

from ds_pfc.data.hf import ImageFolderBytes, load_image_dataset
from ds_pfc.data.sampler import DistributedIdentitySampler
from ds_pfc.data.transforms import (ImageDecoderError, decode_image, default_decoder, normalize, random_flip,
                                    set_image_decoder)


def _ranks(n, w, **kw):
    return [DistributedIdentitySampler(n, rank=r, world_size=w, **kw) for r in range(w)]


# -- sampler -------------------------------------------------------------------------
@pytest.mark.parametrize("n,w", [(37, 3), (36, 4), (5, 5), (1021, 7)])
def test_shards_disjoint_drop_last(n, w):
    shards = [list(s) for s in _ranks(n, w, seed=3)]
    assert all(len(s) == n // w for s in shards)
    flat = [i for s in shards for i in s]
    assert len(set(flat)) == len(flat) == (n // w) * w
    assert set(flat) <= set(range(n))


@pytest.mark.parametrize("n,w", [(37, 3), (2, 5), (1021, 7), (12, 4)])
def test_shards_cover_padded(n, w):
    samplers = _ranks(n, w, seed=3, drop_last=False)
    shards = [list(s) for s in samplers]
    per = -(-n // w)
    assert all(len(s) == per == len(smp) for s, smp in zip(shards, samplers))
    flat = [i for s in shards for i in s]
    assert set(flat) == set(range(n))
    perm = samplers[0].epoch_permutation().tolist()
    # padding wraps: the extra entries repeat the start of the permutation
    assert perm == (perm[:n] * (per * w // n + 1))[: per * w]


def test_same_permutation_on_all_ranks_and_unshuffled():
    perms = [s.epoch_permutation(epoch=2) for s in _ranks(50, 4, seed=9)]
    assert all(torch.equal(p, perms[0]) for p in perms)
    assert list(_ranks(10, 2, shuffle=False)[1]) == [1, 3, 5, 7, 9]


def test_deterministic_per_seed_and_epoch():
    a = DistributedIdentitySampler(100, rank=1, world_size=3, seed=5)
    b = DistributedIdentitySampler(100, rank=1, world_size=3, seed=5)
    a.set_epoch(4)
    b.set_epoch(4)
    assert list(a) == list(b)
    e0 = a.shard(0).tolist()
    assert e0 != a.shard(1).tolist() != a.shard(2).tolist()
    c = DistributedIdentitySampler(100, rank=1, world_size=3, seed=6)
    assert c.shard(0).tolist() != e0
    # (seed, epoch) is hashed, not added: (0, 1) and (1, 0) differ
    s0 = DistributedIdentitySampler(100, rank=0, world_size=1, seed=0)
    s1 = DistributedIdentitySampler(100, rank=0, world_size=1, seed=1)
    assert s0.shard(1).tolist() != s1.shard(0).tolist()


@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_mid_epoch_gives_remaining(drop_last):
    n, w, batch = 103, 3, 8
    for rank in range(w):
        ref = DistributedIdentitySampler(n, rank=rank, world_size=w, seed=11, drop_last=drop_last)
        ref.set_epoch(2)
        full = list(ref)  # uninterrupted epoch
        run = DistributedIdentitySampler(n, rank=rank, world_size=w, seed=11, drop_last=drop_last)
        run.set_epoch(2)
        seen = []
        for i in list(run)[: 3 * batch]:  # three steps, then stop
            seen.append(i)
        run.advance(3 * batch)
        state = run.state_dict()
        resumed = DistributedIdentitySampler(n, rank=rank, world_size=w, seed=11, drop_last=drop_last)
        resumed.load_state_dict(state)
        resumed.set_epoch(2)  # the loop's usual call keeps the position
        assert len(resumed) == len(full) - 3 * batch
        assert seen + list(resumed) == full
        resumed.set_epoch(3)
        assert resumed.consumed == 0 and list(resumed) == ref.shard(3).tolist()


def test_state_dict_round_trip_and_checks():
    s = DistributedIdentitySampler(40, rank=0, world_size=2, seed=1)
    s.set_epoch(7)
    s.advance(5)
    t = DistributedIdentitySampler(40, rank=0, world_size=2, seed=1)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() and list(t) == list(s)
    with pytest.raises(ValueError, match="seed"):
        DistributedIdentitySampler(40, rank=0, world_size=2, seed=2).load_state_dict(s.state_dict())
    # another world size, mid-epoch: the 2 ranks consumed the first 10 samples of the order
    four = DistributedIdentitySampler(40, rank=3, world_size=4, seed=1)
    four.load_state_dict(s.state_dict())
    assert (four.epoch, four.start, four.consumed, len(four)) == (7, 10, 0, 7)
    boundary = dict(s.state_dict(), consumed=0)
    DistributedIdentitySampler(40, rank=3, world_size=4, seed=1).load_state_dict(boundary)
    # part of a block consumed: not a prefix of the order, so no other split
    with pytest.raises(ValueError, match="whole number of blocks"):
        DistributedIdentitySampler(40, rank=0, world_size=4, seed=1).load_state_dict(
            dict(s.state_dict(), block_size=2))
    with pytest.raises(ValueError, match="consumed"):
        t.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="consumed"):
        t.load_state_dict(dict(s.state_dict(), consumed=21))
    with pytest.raises(ValueError, match="advance"):
        t.advance(100)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_samples=10, rank=2, world_size=2), "rank"),
    (dict(num_samples=10, rank=-1, world_size=2), "rank"),
    (dict(num_samples=10, rank=0, world_size=0), "world_size"),
    (dict(num_samples=3, rank=0, world_size=4), "num_samples"),
    (dict(num_samples=0, rank=0, world_size=1, drop_last=False), "num_samples"),
    (dict(num_samples=-1, rank=0, world_size=1), "num_samples"),
])
def test_bad_args(kwargs, match):
    n = kwargs.pop("num_samples")
    with pytest.raises(ValueError, match=match):
        DistributedIdentitySampler(n, **kwargs)


def test_bad_arg_types():
    with pytest.raises(TypeError, match="seed"):
        DistributedIdentitySampler(10, rank=0, world_size=1, seed=1.5)
    with pytest.raises(ValueError, match="epoch"):
        DistributedIdentitySampler(10, rank=0, world_size=1).set_epoch(-1)


def test_works_in_dataloader():
    s = DistributedIdentitySampler(20, rank=1, world_size=2, seed=0)
    loader = torch.utils.data.DataLoader(list(range(20)), batch_size=4, sampler=s)
    assert torch.cat(list(loader)).tolist() == s.shard().tolist()


# -- transforms ------------------------------------------------------------------------
def test_normalize_reference():
    x = torch.randint(0, 256, (2, 3, 5, 4), dtype=torch.uint8)
    ref = (x.double() / 255.0 - 0.5) / 0.5
    out = normalize(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(normalize(x[0].float()), out[0])
    assert normalize(torch.tensor([0, 255], dtype=torch.uint8).view(1, 1, 2).expand(3, 1, 2)).tolist()[0] == [[-1.0, 1.0]]
    with pytest.raises(ValueError, match="shape"):
        normalize(torch.zeros(1, 4, 4))
    with pytest.raises(TypeError, match="dtype|uint8"):
        normalize(torch.zeros(3, 2, 2, dtype=torch.int32))


def test_random_flip_reference():
    x = torch.arange(64 * 3 * 2 * 3, dtype=torch.float32).view(64, 3, 2, 3)
    x_before = x.clone()
    out = random_flip(x, torch.Generator().manual_seed(0))
    mask = torch.rand(64, generator=torch.Generator().manual_seed(0)) < 0.5
    for b in range(64):
        assert torch.equal(out[b], x[b].flip(-1) if mask[b] else x[b])
    assert torch.equal(x, x_before)
    assert 10 < int(mask.sum()) < 54
    again = random_flip(x, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    single = x[0]
    assert torch.equal(random_flip(single, torch.Generator().manual_seed(1), p=1.0), single.flip(-1))
    assert torch.equal(random_flip(single, torch.Generator().manual_seed(1), p=0.0), single)
    with pytest.raises(TypeError, match="generator"):
        random_flip(x, None)


def _ppm_decoder(data: bytes) -> torch.Tensor:
    """Binary PPM (P6) only: enough to test the decoder hook without an image library."""
    header, rest = data.split(b"\n", 3)[:3], data.split(b"\n", 3)[3]
    w, h = map(int, header[1].split())
    return torch.frombuffer(bytearray(rest), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1).contiguous()


def _ppm(img_3HW: torch.Tensor) -> bytes:
    h, w = img_3HW.shape[1:]
    return b"P6\n%d %d\n255\n" % (w, h) + img_3HW.permute(1, 2, 0).contiguous().numpy().tobytes()


def test_decode_hook():
    img = torch.randint(0, 256, (3, 4, 5), dtype=torch.uint8)
    assert torch.equal(decode_image(_ppm(img), decoder=_ppm_decoder), img)
    if default_decoder()[0] == "Pillow":
        try:
            import PIL  # noqa: F401
        except ImportError:          # no decoder at all: the error says how to install one
            with pytest.raises(ImageDecoderError, match="pip install pillow"):
                decode_image(_ppm(img))
        else:                        # Pillow reads PPM too
            assert torch.equal(decode_image(_ppm(img)), img)
    set_image_decoder(_ppm_decoder)
    try:
        assert torch.equal(decode_image(_ppm(img)), img)
    finally:
        set_image_decoder(None)
    with pytest.raises(ValueError, match="uint8"):
        decode_image(b"x", decoder=lambda b: torch.zeros(3, 2, 2))


# -- Hugging Face loader -----------------------------------------------------------------
@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "cache"


def _rows(n=7):
    return {"image": [bytes([i]) * (i + 1) for i in range(n)], "label": [i % 3 for i in range(n)],
            "note": [f"n{i}" for i in range(n)]}


def test_save_to_disk(tmp_path, hf_cache):
    import datasets

    ds = datasets.Dataset.from_dict(_rows())
    ds.save_to_disk(str(tmp_path / "arrow"))
    out = load_image_dataset(tmp_path / "arrow")
    assert len(out) == 7 and out.num_classes == 3
    assert out[4] == (bytes([4]) * 5, 1)
    assert out.labels().tolist() == [i % 3 for i in range(7)]
    dd = datasets.DatasetDict({"train": ds, "val": ds.select([0, 1])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(load_image_dataset(tmp_path / "dd", split="val")) == 2
    with pytest.raises(ValueError, match="split='test'.*train"):
        load_image_dataset(tmp_path / "dd", split="test")


def test_image_feature_and_classlabel_without_pillow(tmp_path, hf_cache):
    import datasets

    # Writing through Image.encode_example needs Pillow, even for {"bytes", "path"}
    # dicts; an Arrow cast of a {bytes, path} struct column to Image() does not.
    (tmp_path / "on_disk.jpg").write_bytes(b"jpeg2")
    ds = datasets.Dataset.from_dict({"img": [{"bytes": b"jpeg0", "path": None}, {"bytes": b"jpeg1", "path": None},
                                             {"bytes": None, "path": str(tmp_path / "on_disk.jpg")}],
                                     "who": [1, 0, 3]})
    ds = ds.cast_column("img", datasets.Image()).cast_column("who", datasets.ClassLabel(names=["a", "b", "c", "d"]))
    ds.save_to_disk(str(tmp_path / "arrow"))
    out = load_image_dataset(tmp_path / "arrow")
    assert (out.image_column, out.label_column) == ("img", "who")
    assert out[0] == (b"jpeg0", 1) and out.num_classes == 4  # ClassLabel, not max+1
    assert out[2] == (b"jpeg2", 3)  # path-only entry read from the file


def test_parquet(tmp_path, hf_cache):
    import datasets

    os.makedirs(tmp_path / "pq")
    datasets.Dataset.from_dict(_rows()).to_parquet(str(tmp_path / "pq" / "part-0.parquet"))
    datasets.Dataset.from_dict({k: v[:2] for k, v in _rows().items()}).to_parquet(str(tmp_path / "pq" / "part-1.parquet"))
    out = load_image_dataset(tmp_path / "pq", cache_dir=hf_cache)
    assert len(out) == 9 and out[8] == (b"\x01\x01", 1) and out.num_classes == 3
    single = load_image_dataset(tmp_path / "pq" / "part-1.parquet", cache_dir=hf_cache, decode=len)
    assert [single[i] for i in range(2)] == [(1, 0), (2, 1)]


def test_columns_errors(tmp_path, hf_cache):
    import datasets

    datasets.Dataset.from_dict({"a": [b"x"], "b": [b"y"], "label": [0]}).save_to_disk(str(tmp_path / "two"))
    with pytest.raises(ValueError, match=r"image_column is ambiguous between \['a', 'b'\]"):
        load_image_dataset(tmp_path / "two")
    assert load_image_dataset(tmp_path / "two", image_column="b")[0] == (b"y", 0)
    with pytest.raises(ValueError, match=r"label_column='y' is not a column; available: \['a', 'b', 'label'\]"):
        load_image_dataset(tmp_path / "two", image_column="a", label_column="y")
    datasets.Dataset.from_dict({"image": [b"x"], "k": [0]}).save_to_disk(str(tmp_path / "nolabel"))
    with pytest.raises(ValueError, match=r"cannot infer label_column.*\['image', 'k'\]"):
        load_image_dataset(tmp_path / "nolabel")
    assert load_image_dataset(tmp_path / "nolabel", label_column="k").num_classes == 1
    datasets.Dataset.from_dict({"image": [b"x"], "label": [-1]}).save_to_disk(str(tmp_path / "neg"))
    with pytest.raises(ValueError, match=">= 0"):
        load_image_dataset(tmp_path / "neg").labels()


def test_image_folder(tmp_path, hf_cache):
    root = tmp_path / "folder"
    files = {"bob/1.jpg": b"b1", "alice/x.png": b"a1", "alice/sub/y.JPG": b"a2", "carol/z.jpeg": b"c1",
             "carol/notes.txt": b"skip"}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    out = load_image_dataset(root)
    assert isinstance(out, ImageFolderBytes)
    assert out.classes == ["alice", "bob", "carol"] and out.num_classes == 3
    assert [out[i] for i in range(len(out))] == [(b"a2", 0), (b"a1", 0), (b"b1", 1), (b"c1", 2)]
    assert out.labels().tolist() == [0, 0, 1, 2]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no class subdirectories"):
        load_image_dataset(tmp_path / "empty")
    with pytest.raises(ValueError, match="image folder"):
        load_image_dataset(root, label_column="label")


def test_missing_and_wrong_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_image_dataset(tmp_path / "nope")
    (tmp_path / "f.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="not .parquet"):
        load_image_dataset(tmp_path / "f.csv")


@pytest.mark.parametrize("n,drop_last", [(103, True), (103, False), (96, True)])
def test_block_shards_make_micro_batches_world_size_invariant(n, drop_last):
    # Reference: the epoch's permutation cut into consecutive micro batches of m.
    m = 4
    perm = DistributedIdentitySampler(n, rank=0, world_size=1, seed=3, drop_last=drop_last).epoch_permutation(0)
    for w in (1, 2, 4):
        samplers = _ranks(n, w, seed=3, drop_last=drop_last, block_size=m)
        shards = [s.shard(0) for s in samplers]
        assert len({len(t) for t in shards}) == 1 and len(shards[0]) % m == 0
        for q, shard in enumerate(shards):
            for k in range(len(shard) // m):      # k-th micro batch of rank q is block k*w + q
                block = k * w + q
                if (block + 1) * m <= len(perm):
                    assert shard[k * m:(k + 1) * m].tolist() == perm[block * m:(block + 1) * m].tolist()


def test_block_resume_on_another_world_size_continues_the_epoch():
    m, n = 3, 120
    old = _ranks(n, 2, seed=9, block_size=m)
    for s in old:
        s.advance(4 * m)                 # 2 ranks x 4 blocks = 8 blocks consumed
    consumed = set()
    for s in old:
        consumed.update(s.shard()[:s.consumed].tolist())
    new = _ranks(n, 4, seed=9, block_size=m)
    for s in new:
        s.load_state_dict(old[0].state_dict())
        assert (s.start, s.consumed) == (8 * m, 0)        # the 8 blocks, as a position in the order
    rest = [i for s in new for i in s]
    assert not consumed & set(rest)
    assert sorted(consumed | set(rest)) == sorted(new[0].epoch_permutation().tolist())


def _epoch_across_changes(n, seed, drop_last, phases):
    """Train one epoch of ``n`` samples in ``phases`` of ``(world_size, block_size,
    micro batches per rank)`` (None: to the end of the epoch), each phase resumed from
    rank 0's state of the one before as the app does. Returns the indices trained, in
    order, and the last phase's samplers. Reference for the order: torch.randperm with
    the sampler's documented generator seed."""
    from ds_pfc.data.sampler import epoch_seed
    seen, state, samplers = [], None, None
    for world, block, micro_batches in phases:
        samplers = _ranks(n, world, seed=seed, drop_last=drop_last, block_size=block)
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
            s.set_epoch(3)
        steps = len(samplers[0]) // block if micro_batches is None else micro_batches
        for k in range(steps):
            for s in samplers:
                seen.extend(list(s)[:block])
                s.advance(block)
        state = samplers[0].state_dict()
    g = torch.Generator()
    g.manual_seed(epoch_seed(seed, 3))
    return seen, samplers, torch.randperm(n, generator=g).tolist()


@pytest.mark.parametrize("phases", [
    [(2, 3, 4), (3, 3, None)],              # 2 -> 3 ranks mid-epoch
    [(3, 3, 3), (2, 3, None)],              # 3 -> 2
    [(1, 4, 5), (2, 4, None)],              # 1 -> 2
    [(2, 4, 3), (3, 2, 2), (5, 1, None)],   # and again, other block sizes
    [(3, 2, 0), (2, 3, None)],              # at the epoch's start
], ids=["2to3", "3to2", "1to2", "2to3to5", "boundary"])
@pytest.mark.parametrize("drop_last", [True, False])
def test_world_size_change_at_any_step_sees_each_sample_once(phases, drop_last):
    """Exact multiset of one epoch across world-size changes: a prefix of the
    permutation, each index once, and the unseen tail shorter than one
    world_size x block_size of the last phase (drop_last); without drop_last the
    tail is padded from the order's start."""
    n = 103
    seen, last, perm = _epoch_across_changes(n, 21, drop_last, phases)
    unit = last[0].world_size * last[0].block_size
    assert all(len(s) == 0 for s in last)
    if drop_last:
        assert n - unit < len(seen) <= n
        assert sorted(seen) == sorted(perm[:len(seen)])      # each at most once, a prefix of the order
        assert len(set(seen)) == len(seen)
    else:
        assert n <= len(seen) < n + unit
        assert sorted(seen) == sorted(perm + perm[:len(seen) - n])


class _TinyImages(torch.utils.data.Dataset):
    """Item i: a uint8 [3, 4, 5] image whose pixels encode i, label i % 7."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        base = torch.arange(60, dtype=torch.int64).view(3, 4, 5)
        return ((base + 3 * i) % 256).to(torch.uint8), i % 7


@pytest.mark.parametrize("workers", [0, 1])
def test_micro_batch_loader_matches_a_plain_reference(workers):
    from ds_pfc.data.loader import MicroBatchLoader, flip_mask
    ds = _TinyImages()
    sampler = DistributedIdentitySampler(len(ds), rank=1, world_size=2, seed=4, block_size=3)
    sampler.set_epoch(2)
    sampler.advance(3)                     # resume after one micro batch
    got = list(MicroBatchLoader(ds, sampler, flip=True, seed=9, workers=workers))
    order = sampler.shard()[3:]
    assert len(got) == len(order) // 3 == 7
    flips = []
    for k, (images, labels) in enumerate(got):
        idx = order[3 * k:3 * k + 3].tolist()
        assert labels.tolist() == [i % 7 for i in idx]
        for j, i in enumerate(idx):
            raw = ds[i][0].float()
            flipped = bool(flip_mask(torch.tensor([i]), 9, 2)[0])
            flips.append(flipped)
            ref = (raw.flip(-1) if flipped else raw) / 127.5 - 1.0
            torch.testing.assert_close(images[j], ref)
    assert 0 < sum(flips) < len(flips)
    # the flip of a sample is a function of (seed, epoch, index) only
    idx = torch.arange(10000)
    a = flip_mask(idx, 9, 2)
    assert torch.equal(a, flip_mask(idx, 9, 2)) and not torch.equal(a, flip_mask(idx, 9, 3))
    assert abs(a.float().mean().item() - 0.5) < 0.02
