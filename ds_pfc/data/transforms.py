"""Tensor-only image transforms matching insightface's training pipeline
(arcface_torch's: decode RGB, random horizontal flip, ``(x/255 - 0.5)/0.5``).

Images are ``[3, H, W]`` or ``[B, 3, H, W]`` in pixel units (0..255), uint8 or float.

Decoding: no image decoder is installed with this package (no torchvision, no
Pillow, and torch itself ships none), so :func:`decode_image` calls a pluggable
decoder: the one passed in, else the one set with :func:`set_image_decoder`, else
``torchvision.io.decode_image`` if torchvision happens to be importable (that path
is not exercised by the tests here), else Pillow if importable, else it raises
``RuntimeError``.

:func:`decode_jpeg_batch` decodes a batch of JPEGs on an accelerator through
``torchvision.io.decode_jpeg`` (nvJPEG on CUDA); the loader uses it when
``data.decode`` is ``cuda``.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["normalize", "random_flip", "decode_image", "set_image_decoder", "decode_jpeg_batch", "is_jpeg",
           "device_decode_available"]

Decoder = Callable[[bytes], torch.Tensor]
_decoder: Decoder | None = None


def _check_image(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not ((x.dim() == 3 and x.shape[0] == 3) or (x.dim() == 4 and x.shape[1] == 3)):
        raise ValueError(f"{name} must have shape [3, H, W] or [B, 3, H, W], got {list(x.shape)}")


def normalize(x: torch.Tensor) -> torch.Tensor:
    """float32 ``(x / 255 - 0.5) / 0.5``: pixel units to [-1, 1]. Returns a new tensor."""
    _check_image("x", x)
    if not (x.dtype == torch.uint8 or x.is_floating_point()):
        raise TypeError(f"x must be uint8 or floating point, got {x.dtype}")
    return (x.to(torch.float32) / 255.0 - 0.5) / 0.5


def random_flip(x: torch.Tensor, generator: torch.Generator, p: float = 0.5) -> torch.Tensor:
    """Flip each image left-right with probability ``p``, one draw per image from
    ``generator`` (so the result depends only on the generator's state). Returns a
    new tensor; ``x`` is not modified."""
    _check_image("x", x)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    batched = x.dim() == 4
    num = x.shape[0] if batched else 1
    flip_B = torch.rand(num, generator=generator, device=generator.device) < p
    flip_B = flip_B.to(x.device)
    xb = x if batched else x.unsqueeze(0)
    out = torch.where(flip_B.view(-1, 1, 1, 1), xb.flip(-1), xb)
    return out if batched else out.squeeze(0)


def set_image_decoder(decoder: Decoder | None) -> None:
    """Install the default decoder: ``bytes -> uint8 [3, H, W]`` RGB. ``None`` unsets."""
    global _decoder
    if decoder is not None and not callable(decoder):
        raise TypeError(f"decoder must be callable or None, got {type(decoder).__name__}")
    _decoder = decoder


def decode_image(data: bytes, decoder: Decoder | None = None) -> torch.Tensor:
    """Encoded image bytes -> uint8 ``[3, H, W]`` RGB via the pluggable decoder."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    fn = decoder if decoder is not None else _decoder
    if fn is None:
        try:
            from torchvision.io import ImageReadMode, decode_image as tv_decode
        except ImportError:
            return _pillow_decode(bytes(data))
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return tv_decode(buf, mode=ImageReadMode.RGB)
    out = fn(bytes(data))
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 3 or out.shape[0] != 3:
        got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"decoder must return a uint8 [3, H, W] tensor, got {got}")
    return out


def _pillow_decode(data: bytes) -> torch.Tensor:
    try:
        import io

        from PIL import Image
    except ImportError:
        raise RuntimeError("no image decoder: this environment has neither torchvision nor Pillow; install one, "
                           "pass decoder= or call ds_pfc.data.transforms.set_image_decoder(fn)") from None
    with Image.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
        out = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
        return out.view(rgb.height, rgb.width, 3).permute(2, 0, 1).contiguous()


def is_jpeg(data) -> bool:
    """Whether encoded bytes (or a uint8 1-D tensor of them) start with a JPEG marker."""
    head = bytes(data[:3].tolist()) if isinstance(data, torch.Tensor) else bytes(data[:3])
    return head == b"\xff\xd8\xff"


def device_decode_available(device) -> str | None:
    """``None`` when :func:`decode_jpeg_batch` can run on ``device``, else why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the training device is {device.type}, not cuda"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import torchvision.io  # noqa: F401
    except ImportError:
        return "torchvision is not installed"
    return None


def decode_jpeg_batch(payloads: list[torch.Tensor], device) -> list[torch.Tensor]:
    """JPEGs (uint8 1-D CPU tensors) -> uint8 ``[3, H, W]`` RGB tensors on ``device``,
    decoded in one batched ``torchvision.io.decode_jpeg`` call. On CUDA (nvJPEG) pixels
    may differ from a CPU decode (libjpeg) by a few levels."""
    from torchvision.io import ImageReadMode, decode_jpeg
    if not payloads:
        return []
    out = decode_jpeg(list(payloads), mode=ImageReadMode.RGB, device=torch.device(device))
    return list(out) if isinstance(out, (list, tuple)) else [out]
