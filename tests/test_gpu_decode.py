"""``data.decode``: JPEG decoding on the training device.

On CPU the plumbing is checked with the device decoder replaced by a Pillow decode
(the workers keep JPEGs encoded, the training process decodes, flips with the
workers' masks and normalises): the batches must equal the CPU path's exactly. The
real nvJPEG decode runs only on a CUDA machine with torchvision.
"""
from __future__ import annotations

import io
import sys

import pytest
import torch

from ds_pfc.app.config import ConfigError, DataConfig
from ds_pfc.data import transforms
from ds_pfc.data.loader import MicroBatchLoader, flip_mask
from ds_pfc.data.sampler import DistributedIdentitySampler

try:
    import PIL.Image as PIL
except ImportError:
    PIL = None
needs_pillow = pytest.mark.skipif(PIL is None, reason="needs Pillow to encode test JPEGs and decode them on CPU")

SIZE, N, M = 16, 12, 4


def _pixels(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    base = torch.randint(0, 256, (3, SIZE // 4, SIZE // 4), generator=g, dtype=torch.uint8)
    # Blocky content: survives JPEG well, and differs left to right so flips show.
    return base.repeat_interleave(4, 1).repeat_interleave(4, 2)


def _encode(x: torch.Tensor, fmt: str, subsampling: int = 0) -> bytes:
    """PNG, or JPEG at quality 90 with full-resolution chroma (``subsampling=0``, 4:4:4)
    unless ``subsampling=2`` (4:2:0) is asked for."""
    image = PIL.fromarray(x.permute(1, 2, 0).contiguous().numpy())
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 90, "subsampling": subsampling} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _pil_decode(data: bytes) -> torch.Tensor:
    with PIL.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
        import numpy as np
        return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1).contiguous()


class _Encoded(torch.utils.data.Dataset):
    """``(bytes, label)`` items: JPEGs, every fifth a PNG (decoded in the workers)."""

    def __init__(self):
        self.items = [_encode(_pixels(i), "PNG" if i % 5 == 4 else "JPEG") for i in range(N)]

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.items[i], i % 3


def _sampler(seed=3):
    return DistributedIdentitySampler(N, rank=0, world_size=1, seed=seed, shuffle=True, drop_last=True, block_size=M)


def _run(dataset, **kw):
    return [(x.clone(), y.clone()) for x, y in MicroBatchLoader(dataset, _sampler(), seed=7, prefetch=1, **kw)]


@needs_pillow
@pytest.mark.parametrize("workers", [0, 1])
def test_device_decode_path_equals_cpu_path(monkeypatch, workers):
    ds = _Encoded()
    calls = []

    def fake_device_decode(payloads, device):
        calls.append([(p.dtype, p.dim(), transforms.is_jpeg(p)) for p in payloads])
        return [_pil_decode(bytes(p.tolist())).to(device) for p in payloads]

    monkeypatch.setattr(transforms, "decode_jpeg_batch", fake_device_decode)
    cpu = _run(ds, workers=workers)
    dev = _run(ds, workers=workers, decode_on_device=True)
    assert len(cpu) == len(dev) == N // M
    for (xc, yc), (xd, yd) in zip(cpu, dev):
        assert xd.dtype == torch.float32 and torch.equal(xc, xd) and torch.equal(yc, yd)
    # One batched call per micro batch, JPEGs only (the PNGs were decoded in the workers).
    assert len(calls) == N // M
    assert all(c == (torch.uint8, 1, True) for call in calls for c in call)
    assert sum(len(c) for c in calls) == sum(1 for i in range(N) if i % 5 != 4)

    # Independent reference: Pillow decode, flip by the (seed, epoch, index) mask, float64 normalise.
    order = _sampler().shard()
    flips = 0
    for b, (xd, yd) in enumerate(dev):
        idx = order[b * M:(b + 1) * M]
        mask = flip_mask(idx, 7, 0)
        flips += int(mask.sum())
        ref = torch.stack([_pil_decode(ds.items[int(i)]) for i in idx]).to(torch.float64)
        ref = torch.where(mask.view(-1, 1, 1, 1), ref.flip(-1), ref)
        ref = (ref / 255 - 0.5) / 0.5
        torch.testing.assert_close(xd.to(torch.float64), ref, rtol=0, atol=1e-6)
        assert yd.tolist() == [int(i) % 3 for i in idx]
    assert 0 < flips < N, "the draw should flip some samples and not others"


@needs_pillow
def test_device_decode_flip_off_and_tensor_items(monkeypatch):
    monkeypatch.setattr(transforms, "decode_jpeg_batch",
                        lambda payloads, device: [_pil_decode(bytes(p.tolist())) for p in payloads])
    ds = _Encoded()
    a = _run(ds, workers=0, flip=False)
    b = _run(ds, workers=0, flip=False, decode_on_device=True)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))

    class Tensors(_Encoded):                 # already decoded items pass through untouched
        def __getitem__(self, i):
            return _pixels(i), i % 3
    t = Tensors()
    a, b = _run(t, workers=0), _run(t, workers=0, decode_on_device=True)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))

    class Batched(_Encoded):                 # get_batch datasets: flipped and normalised after the hand-over
        def get_batch(self, indices):
            return torch.stack([_pixels(int(i)) for i in indices]), indices % 3
    t = Batched()
    a, b = _run(t, workers=0), _run(t, workers=0, decode_on_device=True)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
    assert not all(torch.equal(x, y) for (x, _), (y, _) in zip(a, _run(t, workers=0, flip=False)))


@needs_pillow
def test_device_decoder_output_is_checked(monkeypatch):
    monkeypatch.setattr(transforms, "decode_jpeg_batch",
                        lambda payloads, device: [torch.zeros(SIZE, SIZE)] * len(payloads))
    with pytest.raises(ValueError, match="device JPEG decoder must return uint8"):
        _run(_Encoded(), workers=0, decode_on_device=True)


@needs_pillow
def test_is_jpeg():
    assert transforms.is_jpeg(_encode(_pixels(0), "JPEG"))
    assert not transforms.is_jpeg(_encode(_pixels(0), "PNG"))
    assert transforms.is_jpeg(torch.frombuffer(bytearray(_encode(_pixels(0), "JPEG")), dtype=torch.uint8))


def test_decode_config_values_and_errors(monkeypatch):
    assert DataConfig().decode == "cpu"
    with pytest.raises(ConfigError, match=r"ds_pfc\.data\.decode must be cpu, cuda or auto, got 'gpu'"):
        DataConfig(decode="gpu")
    cpu = torch.device("cpu")
    assert DataConfig(decode="cpu").decode_on(cpu) is False
    assert DataConfig(decode="auto").decode_on(cpu) is False
    with pytest.raises(ConfigError, match=r"ds_pfc\.data\.decode is \"cuda\" but the training device is cpu"):
        DataConfig(decode="cuda").decode_on(cpu)

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"ds_pfc\.data\.decode is \"cuda\" but CUDA is not available"):
        DataConfig(decode="cuda").decode_on(cuda)
    assert DataConfig(decode="auto").decode_on(cuda) is False

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "torchvision.io", None)      # import fails: torchvision missing
    with pytest.raises(ConfigError, match=r"ds_pfc\.data\.decode is \"cuda\" but torchvision is not installed"):
        DataConfig(decode="cuda").decode_on(cuda)
    assert DataConfig(decode="auto").decode_on(cuda) is False
    assert DataConfig(decode="cpu").decode_on(cuda) is False


def _have_cuda_torchvision() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import torchvision.io  # noqa: F401
    except ImportError:
        return False
    return True


@needs_pillow
@pytest.mark.cuda
@pytest.mark.skipif(not _have_cuda_torchvision(), reason="needs a CUDA device and torchvision (nvJPEG decode)")
def test_nvjpeg_matches_cpu_decode():
    """With full-resolution chroma (4:4:4) nvJPEG and libjpeg may only round the IDCT and
    colour conversion differently: allow max |diff| <= 2 and mean |diff| <= 0.5 levels on
    uint8 (an H200 gave 0 and 0). With 4:2:0 chroma (most face datasets' JPEGs) they upsample
    the chroma differently (nvJPEG without libjpeg's smoothing filter): on a smooth image the
    mean difference stays a few levels (2.5 on an H200 at 112 x 112), sharp colour edges
    differ more."""
    from torchvision.io import ImageReadMode, decode_jpeg
    device = torch.device("cuda", torch.cuda.current_device())
    ds = _Encoded()
    jpegs = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in ds.items if transforms.is_jpeg(b)]
    got = transforms.decode_jpeg_batch(jpegs, device)
    assert len(got) == len(jpegs)
    for g, p in zip(got, jpegs):
        ref = decode_jpeg(p, mode=ImageReadMode.RGB)
        assert g.device.type == "cuda" and g.dtype == torch.uint8 and g.shape == ref.shape == (3, SIZE, SIZE)
        diff = (g.cpu().to(torch.int16) - ref.to(torch.int16)).abs()
        assert diff.max() <= 2 and diff.float().mean() <= 0.5
    # The loader end to end: same flips and labels, pixels within the same tolerance.
    cpu = [(x.clone(), y.clone()) for x, y in MicroBatchLoader(ds, _sampler(), seed=7, workers=0, device=device)]
    dev = [(x.clone(), y.clone()) for x, y in MicroBatchLoader(ds, _sampler(), seed=7, workers=0, device=device,
                                                             decode_on_device=True)]
    for (xc, yc), (xd, yd) in zip(cpu, dev):
        assert torch.equal(yc, yd)
        diff = ((xc - xd).abs() * 127.5)
        assert diff.max() <= 2 + 1e-3 and diff.mean() <= 0.5
    # 4:2:0 chroma on a smooth 112 x 112 image: a bounded mean difference, not equality.
    g = torch.Generator().manual_seed(5)
    noise = torch.rand(1, 3, 112, 112, generator=g) * 255
    smooth = torch.nn.functional.avg_pool2d(noise, 5, 1, 2)[0].round().to(torch.uint8)
    jpeg = torch.frombuffer(bytearray(_encode(smooth, "JPEG", subsampling=2)), dtype=torch.uint8)
    got = transforms.decode_jpeg_batch([jpeg], device)[0].cpu().to(torch.int16)
    ref = decode_jpeg(jpeg, mode=ImageReadMode.RGB).to(torch.int16)
    assert (got - ref).abs().float().mean() <= 4.0


@pytest.mark.skipif(_have_cuda_torchvision(), reason="here decode=cuda can run: nothing to refuse")
def test_train_app_refuses_cuda_decode_at_setup(tmp_path):
    """``launch/train.py`` with ``data.decode: cuda`` where it cannot run: a one-line
    error naming the key, before any training."""
    pytest.importorskip("deepspeed")
    import copy
    import json
    import os
    import subprocess

    from test_train_app import ROOT, TINY, _env
    config = copy.deepcopy(TINY)
    config["ds_pfc"]["data"]["decode"] = "cuda"
    path = tmp_path / "cuda_decode.json"
    path.write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--deepspeed_config", str(path),
                           "--output_dir", str(tmp_path / "out")], env=_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and 'ds_pfc.data.decode is "cuda" but' in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "checkpoints").exists()
