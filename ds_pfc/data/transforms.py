"""Tensor-only image transforms matching insightface's training pipeline
(arcface_torch's: decode RGB, random horizontal flip, ``(x/255 - 0.5)/0.5``).

Images are ``[3, H, W]`` or ``[B, 3, H, W]`` in pixel units (0..255), uint8 or float.

Decoding: :func:`decode_image` calls the decoder passed in, else the one set with
:func:`set_image_decoder`, else the default (:func:`default_decoder`, chosen once per
process): ``torchvision.io.decode_image`` when torchvision imports and decodes a test JPEG
and PNG, else Pillow (a dependency of ds_pfc). A torchvision that is installed but broken
(any exception at import or decode, e.g. a build for another torch) is passed over with
one warning. :func:`check_decoder` decodes a tiny in-memory JPEG and PNG with the decoder
:func:`decode_image` would use and raises :class:`ImageDecoderError` (a ``ConfigError``:
one ``error:`` line in the training app) naming the decoder, what failed and the fix.

:func:`decode_jpeg_batch` decodes a batch of JPEGs on an accelerator through
``torchvision.io.decode_jpeg`` (nvJPEG on CUDA); the loader uses it when
``data.decode`` is ``cuda``.
"""
from __future__ import annotations

import base64
import io
import warnings
from typing import Callable

import torch

from .._checks import ConfigError

__all__ = ["normalize", "random_flip", "decode_image", "set_image_decoder", "default_decoder", "check_decoder",
           "ImageDecoderError", "decode_jpeg_batch", "is_jpeg", "device_decode_available"]

Decoder = Callable[[bytes], torch.Tensor]
_decoder: Decoder | None = None
_default: tuple[str, Decoder] | None = None       # (name, decoder): default_decoder's choice, made once
_passed_over: str | None = None                   # why a broken torchvision was not chosen

INSTALL_HINT = "pip install pillow"

# The probes: a 4x4 PNG (pixel (y, x) = (60 x + 10, 70 y + 5, 255 - 16 (x + 4 y))) and a
# 16x16 JPEG of one colour, (200, 100, 50); both written by Pillow.
_PROBE_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAQAAAAECAIAAAAmkwkpAAAAG0lEQVR42mPkYv1vw/ABglgY3A4wMHyAINwcAKTqECJEbEw0AAAAAElFTkSuQmCC")
_PROBE_JPEG = base64.b64decode(
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAMCAgMCAgMDAwMEAwMEBQgFBQQEBQoHBwYIDAoMDAsKCwsNDhIQDQ4RDgsLEBYQERMUFRUVDA8X"
    "GBYUGBIUFRT/2wBDAQMEBAUEBQkFBQkUDQsNFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBT/wAAR"
    "CAAQABADASIAAhEBAxEB/8QAHwAAAQUBAQEBAQEAAAAAAAAAAAECAwQFBgcICQoL/8QAtRAAAgEDAwIEAwUFBAQAAAF9AQIDAAQRBRIhMUEG"
    "E1FhByJxFDKBkaEII0KxwRVS0fAkM2JyggkKFhcYGRolJicoKSo0NTY3ODk6Q0RFRkdISUpTVFVWV1hZWmNkZWZnaGlqc3R1dnd4eXqDhIWG"
    "h4iJipKTlJWWl5iZmqKjpKWmp6ipqrKztLW2t7i5usLDxMXGx8jJytLT1NXW19jZ2uHi4+Tl5ufo6erx8vP09fb3+Pn6/8QAHwEAAwEBAQEB"
    "AQEBAQAAAAAAAAECAwQFBgcICQoL/8QAtREAAgECBAQDBAcFBAQAAQJ3AAECAxEEBSExBhJBUQdhcRMiMoEIFEKRobHBCSMzUvAVYnLRChYk"
    "NOEl8RcYGRomJygpKjU2Nzg5OkNERUZHSElKU1RVVldYWVpjZGVmZ2hpanN0dXZ3eHl6goOEhYaHiImKkpOUlZaXmJmaoqOkpaanqKmqsrO0"
    "tba3uLm6wsPExcbHyMnK0tPU1dbX2Nna4uPk5ebn6Onq8vP09fb3+Pn6/9oADAMBAAIRAxEAPwCpRRRX4ef0gf/Z")
_JPEG_TOLERANCE = 8          # pixel levels a JPEG decoder may differ by (IDCT and upsampling variants)


class ImageDecoderError(ConfigError):
    """No working image decoder for data that needs one; the message names the decoder,
    what failed and the fix."""


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
        return default_decoder()[1](bytes(data))
    out = fn(bytes(data))
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 3 or out.shape[0] != 3:
        got = f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"decoder must return a uint8 [3, H, W] tensor, got {got}")
    return out


def default_decoder() -> tuple[str, Decoder]:
    """``(name, decoder)`` that :func:`decode_image` uses when none is passed or set:
    ``("torchvision", ...)`` when torchvision imports and decodes the probe images, else
    ``("Pillow", ...)``. Chosen on the first call and kept for the process; a torchvision
    that is installed but fails (any exception) is passed over with one warning. The Pillow
    decoder raises :class:`ImageDecoderError` when Pillow is missing."""
    global _default
    if _default is None:
        _default = _choose_decoder()
    return _default


def _choose_decoder() -> tuple[str, Decoder]:
    global _passed_over
    try:
        from torchvision.io import ImageReadMode, decode_image as tv_decode

        def torchvision_decode(data: bytes) -> torch.Tensor:
            return tv_decode(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        _probe(torchvision_decode)
    except ImportError:
        pass                              # not installed: Pillow, silently
    except Exception as err:              # noqa: BLE001 - installed but broken: any error at all
        _passed_over = f"torchvision is installed but does not work ({type(err).__name__}: {_one_line(err)})"
        warnings.warn(f"{_passed_over}; decoding images with Pillow instead (install a torchvision built for "
                      f"torch {torch.__version__}, or uninstall it)", RuntimeWarning, stacklevel=3)
    else:
        return "torchvision", torchvision_decode
    return "Pillow", _pillow_decode


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _probe(decode: Decoder) -> None:
    """Decode the probe JPEG and PNG with ``decode``; raises (whatever ``decode`` raises,
    or ``ValueError``) unless both come out right."""
    png = decode(_PROBE_PNG)
    x = torch.arange(4).view(1, 4)
    y = torch.arange(4).view(4, 1)
    want = torch.stack([(60 * x + 10).expand(4, 4), (70 * y + 5).expand(4, 4), 255 - 16 * (x + 4 * y)])
    if not (isinstance(png, torch.Tensor) and png.dtype == torch.uint8 and tuple(png.shape) == (3, 4, 4)
            and torch.equal(png.to(torch.int64), want)):
        raise ValueError(f"the test PNG decoded to {_describe(png)}, not its 3x4x4 pixels")
    jpeg = decode(_PROBE_JPEG)
    if not (isinstance(jpeg, torch.Tensor) and jpeg.dtype == torch.uint8 and tuple(jpeg.shape) == (3, 16, 16)):
        raise ValueError(f"the test JPEG decoded to {_describe(jpeg)}, not uint8 [3, 16, 16]")
    error = (jpeg.to(torch.int64) - torch.tensor([200, 100, 50]).view(3, 1, 1)).abs().max().item()
    if error > _JPEG_TOLERANCE:
        raise ValueError(f"the test JPEG decoded to pixels {error} levels off its colour")


def _describe(out) -> str:
    return f"{out.dtype} {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__


def check_decoder(what: str, decoder: Decoder | None = None) -> str:
    """Decode a tiny in-memory JPEG and PNG with the decoder :func:`decode_image` would
    use (``decoder``, else the one set with :func:`set_image_decoder`, else
    :func:`default_decoder`'s); returns its name. Raises :class:`ImageDecoderError`
    naming ``what`` needs decoding (e.g. ``"ds_pfc.data.source recordio"``), the decoder,
    what failed and the fix."""
    if not isinstance(what, str) or not what:
        raise TypeError(f"what must be a non-empty string, got {what!r}")
    if decoder is not None or _decoder is not None:
        fn, name = decoder or _decoder, "the decoder passed in" if decoder is not None else \
            "the decoder set with ds_pfc.data.transforms.set_image_decoder"
        fix = "fix that decoder, or unset it (set_image_decoder(None)) to use Pillow"
    else:
        name, fn = default_decoder()
        fix = f"install Pillow: {INSTALL_HINT}"
    note = f" ({_passed_over}, so it is not used)" if _passed_over is not None and fn is _pillow_decode else ""
    try:
        _probe(lambda data: decode_image(data, decoder=fn))
    except ImageDecoderError as err:
        raise ImageDecoderError(f"{what} needs an image decoder: {err}{note}") from err
    except Exception as err:          # noqa: BLE001 - whatever the decoder raises is the finding
        raise ImageDecoderError(f"{what} needs an image decoder, and {name} failed to decode a test image "
                                f"({type(err).__name__}: {_one_line(err)}); {fix}{note}") from err
    return name


def _pillow_decode(data: bytes) -> torch.Tensor:
    try:
        from PIL import Image
    except ImportError as err:
        raise ImageDecoderError(f"Pillow, the image decoder, cannot be imported ({type(err).__name__}: "
                                f"{_one_line(err)}); install it: {INSTALL_HINT} (or pass decoder= or call "
                                "ds_pfc.data.transforms.set_image_decoder(fn))") from None
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
    except Exception as err:              # noqa: BLE001 - installed but broken
        return f"torchvision does not import ({type(err).__name__}: {_one_line(err)})"
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
