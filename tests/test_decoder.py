"""The image decoder the install brings (Pillow) and the start-up check of the training app.

JPEG and PNG bytes are written by Pillow's encoder from known pixels and decoded by
``ds_pfc.data.transforms.decode_image`` (PNG exactly, JPEG within its rounding). With
the decoder made unavailable (its import raising ``ImportError``, and a torchvision that
raises ``RuntimeError`` at import as a build for another torch does) a tiny RecordIO
training job ends with one ``error:`` line naming ``pip install pillow`` before any model
is built; with it, the same job trains."""
from __future__ import annotations

import builtins
import configparser
import copy
import importlib.metadata
import io
import json
import os
import re
import sys

import numpy as np
import pytest
import torch

from _dist import one_process_world
from _inprocess import call_main
from _recordio_writers import ir_pack, write_rec
from ds_pfc.data import transforms
from ds_pfc.data.recordio import InsightFaceRecord
from ds_pfc.data.transforms import ImageDecoderError, check_decoder, decode_image, default_decoder

PIL = pytest.importorskip("PIL.Image")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _faces(count: int, size: int = 112, seed: int = 0) -> list[torch.Tensor]:
    """Smooth RGB fields (bilinear upsampling of 8x8 noise), as face crops compress."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(count, 3, 8, 8, generator=g) * 255
    fine = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    return list(fine.round().clamp(0, 255).to(torch.uint8))


def _encode(x: torch.Tensor, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    PIL.fromarray(x.permute(1, 2, 0).contiguous().numpy()).save(buf, format=fmt, **options)
    return buf.getvalue()


@pytest.fixture
def fresh_choice(monkeypatch):
    """The default decoder chosen again in this test (and the earlier choice restored after it)."""
    monkeypatch.setattr(transforms, "_default", None)
    monkeypatch.setattr(transforms, "_passed_over", None)
    monkeypatch.setattr(transforms, "_decoder", None)


def _break_imports(monkeypatch, **errors):
    """``import <name>`` (and its submodules) raises ``errors[name]`` from now on."""
    real = builtins.__import__

    def fake(name, globals=None, locals=None, fromlist=(), level=0):
        top = name.split(".")[0] if level == 0 else None
        if top in errors:
            raise errors[top]
        return real(name, globals, locals, fromlist, level)
    monkeypatch.setattr(builtins, "__import__", fake)


NO_PILLOW = ImportError("No module named 'PIL'")
NO_TORCHVISION = ImportError("No module named 'torchvision'")
BROKEN_TORCHVISION = RuntimeError("operator torchvision::nms does not exist")


# -- decoding ------------------------------------------------------------------------------
def test_png_decodes_to_its_pixels_exactly():
    for x in _faces(3) + [torch.randint(0, 256, (3, 7, 5), generator=torch.Generator().manual_seed(1),
                                        dtype=torch.uint8)]:
        out = decode_image(_encode(x, "PNG"))
        assert out.dtype == torch.uint8 and torch.equal(out, x)


@pytest.mark.parametrize("subsampling", [0, 2])          # 4:4:4 and 4:2:0 (most face sets)
def test_jpeg_decodes_to_its_pixels_within_jpeg_rounding(subsampling):
    for x in _faces(3, seed=2):
        out = decode_image(_encode(x, "JPEG", quality=95, subsampling=subsampling))
        assert out.shape == x.shape and out.dtype == torch.uint8
        err = (out.to(torch.int64) - x.to(torch.int64)).abs()
        assert err.float().mean() < 1.5 and err.max() <= 16, (err.float().mean(), err.max())


def test_grey_and_palette_images_decode_to_rgb():
    x = _faces(1)[0]
    grey = PIL.fromarray(x[0].numpy())
    assert grey.mode == "L"
    buf = io.BytesIO()
    grey.save(buf, format="PNG")
    assert torch.equal(decode_image(buf.getvalue()), x[0].expand(3, -1, -1))


def test_recordio_payloads_decode_to_their_pixels(tmp_path):
    faces = _faces(4, seed=3)
    records = [(k, ir_pack(float(k % 2), _encode(x, "PNG"), id1=k)) for k, x in enumerate(faces)]
    rec, idx, _ = write_rec(tmp_path, records)
    ds = InsightFaceRecord(rec, idx, decode=decode_image)
    for k, x in enumerate(faces):
        image, label = ds[k]
        assert torch.equal(image, x) and label == k % 2


# -- the choice and the check ---------------------------------------------------------------
def test_the_default_here_passes_the_check():
    name, _ = default_decoder()
    assert check_decoder("a test") == name and name in ("torchvision", "Pillow")


def test_missing_pillow_is_an_error_naming_the_install(fresh_choice, monkeypatch):
    _break_imports(monkeypatch, PIL=NO_PILLOW, torchvision=NO_TORCHVISION)
    assert default_decoder()[0] == "Pillow"
    with pytest.raises(ImageDecoderError, match=r"^ds_pfc\.data\.source recordio \(x\.rec\) needs an image "
                                                r"decoder: Pillow.*No module named 'PIL'.*pip install pillow"):
        check_decoder("ds_pfc.data.source recordio (x.rec)")
    with pytest.raises(ImageDecoderError, match="pip install pillow"):
        decode_image(_encode(_faces(1)[0], "PNG"))


def test_broken_torchvision_falls_back_to_pillow_with_one_warning(fresh_choice, monkeypatch):
    _break_imports(monkeypatch, torchvision=BROKEN_TORCHVISION)
    x = _faces(1)[0]
    with pytest.warns(RuntimeWarning, match="torchvision is installed but does not work.*torchvision::nms") as seen:
        first = decode_image(_encode(x, "PNG"))
        second = decode_image(_encode(x, "PNG"))
        assert check_decoder("a test") == "Pillow"
    assert torch.equal(first, x) and torch.equal(second, x)
    assert len([w for w in seen if "torchvision" in str(w.message)]) == 1
    assert default_decoder()[0] == "Pillow"


def _fake_torchvision(monkeypatch, decode):
    """``torchvision.io`` whose ``decode_image(uint8 tensor, mode=)`` is ``decode(bytes)``."""
    import types
    io_module = types.ModuleType("torchvision.io")
    io_module.ImageReadMode = types.SimpleNamespace(RGB="RGB")
    io_module.decode_image = lambda buf, mode: decode(bytes(buf.tolist()))
    package = types.ModuleType("torchvision")
    package.io = io_module
    monkeypatch.setitem(sys.modules, "torchvision", package)
    monkeypatch.setitem(sys.modules, "torchvision.io", io_module)


def _pillow_pixels(data: bytes) -> torch.Tensor:
    with PIL.open(io.BytesIO(data)) as image:
        return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)


def test_a_working_torchvision_is_chosen(fresh_choice, monkeypatch, recwarn):
    _fake_torchvision(monkeypatch, _pillow_pixels)
    assert default_decoder()[0] == "torchvision" and check_decoder("a test") == "torchvision"
    x = _faces(1)[0]
    assert torch.equal(decode_image(_encode(x, "PNG")), x)
    assert not [w for w in recwarn if "torchvision" in str(w.message)]


def test_a_torchvision_that_imports_but_cannot_decode_is_passed_over(fresh_choice, monkeypatch):
    def broken(data):
        raise RuntimeError("image.so: undefined symbol")
    _fake_torchvision(monkeypatch, broken)
    with pytest.warns(RuntimeWarning, match="undefined symbol"):
        assert default_decoder()[0] == "Pillow"
    x = _faces(1)[0]
    assert torch.equal(decode_image(_encode(x, "PNG")), x)


def test_broken_torchvision_and_no_pillow_names_both(fresh_choice, monkeypatch):
    _break_imports(monkeypatch, PIL=NO_PILLOW, torchvision=BROKEN_TORCHVISION)
    with pytest.warns(RuntimeWarning, match="torchvision"):
        with pytest.raises(ImageDecoderError, match=r"pip install pillow.*torchvision::nms does not exist"):
            check_decoder("a test")


def test_a_set_decoder_that_fails_is_named(fresh_choice):
    transforms.set_image_decoder(lambda data: torch.zeros(3, 4, 4, dtype=torch.uint8))
    try:
        with pytest.raises(ImageDecoderError, match="set_image_decoder.*test PNG.*unset it"):
            check_decoder("a test")
    finally:
        transforms.set_image_decoder(None)
    with pytest.raises(TypeError, match="what"):
        check_decoder("")


# -- the install ----------------------------------------------------------------------------
def test_setup_cfg_installs_the_decoder():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    requires = [line.strip() for line in cfg["options"]["install_requires"].splitlines() if line.strip()]
    names = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower(): r for r in requires}
    assert "pillow" in names and re.search(r">=\s*10", names["pillow"]), requires
    # the distribution named there is the one that provides the module the decoder imports
    assert "pillow" in [d.lower() for d in importlib.metadata.packages_distributions().get("PIL", [])]


# -- the training app ------------------------------------------------------------------------
def _recordio_job(tmp_path, classes: int = 4, per_class: int = 4) -> tuple[str, str]:
    data = tmp_path / "data"
    data.mkdir()
    faces = _faces(classes * per_class, seed=4)
    records = [(k, ir_pack(float(k % classes), _encode(x, "JPEG", quality=90), id1=k)) for k, x in enumerate(faces)]
    rec, _, _ = write_rec(data, records)
    from test_train_app import TINY
    config = copy.deepcopy(TINY)
    pfc = config["ds_pfc"]
    pfc["head"]["num_classes"] = classes
    pfc["data"] = {"source": "recordio", "path": rec, "workers": 0}
    pfc["evaluation"] = {"synthetic_pairs": 0}
    pfc["train"].update(max_steps=1, epochs=1)
    pfc["checkpoint"] = {"every_steps": 0, "keep": 0}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(config))
    return str(path), str(tmp_path / "run")


def _train(job: str, out: str, monkeypatch) -> tuple[int, str, list]:
    """The training command in this process: ``(exit status, stderr, model builds)``."""
    from ds_pfc.app import config as app_config
    from ds_pfc.cli.train import main
    builds = []
    for cls in (app_config.BackboneConfig, app_config.HeadConfig):
        real = cls.build

        def spy(self, *args, _real=real, _name=cls.__name__, **kwargs):
            builds.append(_name)
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(cls, "build", spy)
    monkeypatch.setenv("DS_PFC_CACHE_DIR", os.path.join(os.path.dirname(out), "index-cache"))
    with one_process_world():
        code, _, err = call_main(main, ["--deepspeed_config", job, "--output_dir", out])
    return code, err, builds


@pytest.mark.filterwarnings("ignore:torchvision is installed but does not work")
@pytest.mark.parametrize("torchvision", [NO_TORCHVISION, BROKEN_TORCHVISION], ids=["no-torchvision",
                                                                                     "broken-torchvision"])
def test_training_without_a_decoder_stops_with_one_error_line_before_any_model(tmp_path, monkeypatch, fresh_choice,
                                                                              torchvision):
    job, out = _recordio_job(tmp_path)
    _break_imports(monkeypatch, PIL=NO_PILLOW, torchvision=torchvision)
    code, err, builds = _train(job, out, monkeypatch)
    assert code == 1
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert "Traceback" not in err and "please report it" not in err
    assert "pip install pillow" in errors[0] and "ds_pfc.data.source recordio" in errors[0]
    assert "Pillow" in errors[0]
    if isinstance(torchvision, RuntimeError):
        assert "torchvision::nms does not exist" in errors[0]
    assert builds == []                                       # neither backbone nor head was built
    log = os.path.join(out, "training.log")
    assert not os.path.exists(log) or "building the DeepSpeed engine" not in open(log).read()


def test_training_on_recordio_with_the_installed_decoder(tmp_path, monkeypatch, fresh_choice):
    job, out = _recordio_job(tmp_path)
    code, err, builds = _train(job, out, monkeypatch)
    assert code == 0, err[-3000:]
    assert sorted(builds) == ["BackboneConfig", "HeadConfig"]
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["steps"] == 1 and summary["final_loss"] is not None
