"""Decode rate of the JPEG/PNG decoders ds_pfc can use, on 112x112 face-sized images.

    python benchmarks/decode_rate.py [--images 2000] [--repeats 9] [--out rate.json]

Each decoder turns encoded bytes into the ``uint8 [3, 112, 112]`` RGB tensor the loader
needs (the conversion is part of the time). The images are smooth random fields (a face
crop compresses like one: a JPEG of 3-5 KB at quality 95), encoded once with Pillow.
Decoders that are not installed are skipped: Pillow (``pillow``), torchvision
(``torchvision.io.decode_image``), simplejpeg (JPEG only) and OpenCV
(``opencv-python-headless``). One process, one thread (``torch.set_num_threads(1)``;
OpenCV's threads set to 1): the rate of one data-loader worker. Prints images per
second, median of the repeats (the decoders take turns within each repeat)."""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import time

import torch


def _images(count: int, size: int = 112) -> list[torch.Tensor]:
    """``count`` smooth RGB fields (bilinear upsampling of 8x8 noise plus mild noise)."""
    g = torch.Generator().manual_seed(0)
    coarse = torch.rand(count, 3, 8, 8, generator=g) * 255
    fine = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    fine = fine + torch.randn(fine.shape, generator=g) * 6
    return list(fine.clamp(0, 255).round().to(torch.uint8))


def _encode(images, fmt: str) -> list[bytes]:
    from PIL import Image
    out = []
    for x in images:
        buf = io.BytesIO()
        options = {"quality": 95} if fmt == "JPEG" else {}
        Image.fromarray(x.permute(1, 2, 0).contiguous().numpy()).save(buf, format=fmt, **options)
        out.append(buf.getvalue())
    return out


def _decoders() -> dict:
    found = {}
    try:
        from PIL import Image

        def pillow(data: bytes) -> torch.Tensor:
            with Image.open(io.BytesIO(data)) as image:
                rgb = image.convert("RGB")
                return torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(
                    rgb.height, rgb.width, 3).permute(2, 0, 1).contiguous()
        found["pillow " + Image.__version__] = (pillow, ("JPEG", "PNG"))
    except ImportError:
        pass
    try:
        import torchvision
        from torchvision.io import ImageReadMode, decode_image

        def tv(data: bytes) -> torch.Tensor:
            return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        found["torchvision " + torchvision.__version__] = (tv, ("JPEG", "PNG"))
    except Exception:         # noqa: BLE001 - absent or broken: not measured
        pass
    try:
        import simplejpeg

        def sj(data: bytes) -> torch.Tensor:
            return torch.from_numpy(simplejpeg.decode_jpeg(data, colorspace="RGB")).permute(2, 0, 1).contiguous()
        found["simplejpeg " + simplejpeg.__version__] = (sj, ("JPEG",))
    except ImportError:
        pass
    try:
        import cv2
        import numpy as np
        cv2.setNumThreads(1)

        def opencv(data: bytes) -> torch.Tensor:
            bgr = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR)
            return torch.from_numpy(bgr[:, :, ::-1].copy()).permute(2, 0, 1).contiguous()
        found["opencv " + cv2.__version__] = (opencv, ("JPEG", "PNG"))
    except ImportError:
        pass
    return found


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(images: int = 2000, repeats: int = 5) -> dict:
    torch.set_num_threads(1)
    pixels = _images(images)
    encoded = {fmt: _encode(pixels, fmt) for fmt in ("JPEG", "PNG")}
    result = {"machine": f"{_cpu()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "images": images, "repeats": repeats, "size": "112x112",
              "bytes_per_image": {fmt: statistics.mean(map(len, data)) for fmt, data in encoded.items()},
              "images_per_s": {}}
    runs = []
    for name, (decode, formats) in _decoders().items():
        for fmt in formats:
            first = decode(encoded[fmt][0])
            if first.shape != (3, 112, 112) or first.dtype != torch.uint8:
                raise RuntimeError(f"{name} decoded {fmt} to {first.dtype} {list(first.shape)}")
            if fmt == "PNG" and not torch.equal(first, pixels[0]):
                raise RuntimeError(f"{name} decoded a PNG to other pixels")
            runs.append((name, fmt, decode, []))
    # The decoders take turns within each repeat, so that other load on the machine
    # slows them alike; the median over repeats is reported.
    for _ in range(repeats):
        for name, fmt, decode, rates in runs:
            data = encoded[fmt]
            started = time.perf_counter()
            for item in data:
                decode(item)
            rates.append(len(data) / (time.perf_counter() - started))
    for name, fmt, _, rates in runs:
        result["images_per_s"].setdefault(name, {})[fmt] = round(statistics.median(rates))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default=None, help="also write the numbers to this JSON file")
    args = p.parse_args(argv)
    if args.images < 1 or args.repeats < 1:
        p.error("--images and --repeats must be >= 1")
    result = measure(args.images, args.repeats)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
