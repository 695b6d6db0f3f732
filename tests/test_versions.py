"""The tested torch / DeepSpeed ranges: setup.cfg states them, importing ds_pfc checks them."""
import configparser
import os
import subprocess
import sys
import warnings

import pytest

from ds_pfc import _versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _requirements():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    out = {}
    for line in cfg["options"]["install_requires"].split("\n"):
        line = line.strip()
        if line:
            name = line.split(">")[0].split("<")[0].split("=")[0]
            out[name] = line[len(name):]
    return out


def test_setup_cfg_states_the_tested_ranges():
    reqs = _requirements()
    for package, (low, high) in _versions.TESTED.items():
        assert reqs[package] == f">={low},<{high}", (package, reqs[package])


@pytest.mark.parametrize("text, expected", [("2.13.0+cpu", (2, 13, 0)), ("0.19.5rc1", (0, 19, 5)), ("2.14", (2, 14)),
                                            ("v1.2.3.dev0", (1, 2, 3))])
def test_parse_version(text, expected):
    assert _versions.parse_version(text) == expected


def test_parse_version_refuses_garbage():
    with pytest.raises(ValueError, match="version"):
        _versions.parse_version("nightly")


def test_check_version_floor_ceiling_and_inside():
    with pytest.raises(ImportError, match=r"deepspeed>=0\.19\.8,<0\.20.*installed: deepspeed 0\.19\.7"):
        _versions.check_version("deepspeed", "0.19.7")
    with pytest.raises(ImportError, match=r"torch 2\.12\.1\+cu128"):
        _versions.check_version("torch", "2.12.1+cu128")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _versions.check_version("deepspeed", "0.19.8")
        _versions.check_version("torch", "2.13.0+cpu")
    with pytest.warns(RuntimeWarning, match=r"deepspeed>=0\.19\.8,<0\.20; installed: deepspeed 0\.20\.0"):
        _versions.check_version("deepspeed", "0.20.0")


def _import_with_deepspeed_version(version):
    code = ("import importlib.metadata as m\n"
            "real = m.version\n"
            f"m.version = lambda name: {version!r} if name == 'deepspeed' else real(name)\n"
            "import ds_pfc\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_import_refuses_an_old_deepspeed_naming_version_and_range():
    proc = _import_with_deepspeed_version("0.16.0")
    assert proc.returncode != 0
    assert "installed: deepspeed 0.16.0" in proc.stderr and ">=0.19.8,<0.20" in proc.stderr, proc.stderr[-2000:]


def test_import_warns_on_an_untested_newer_deepspeed():
    proc = _import_with_deepspeed_version("0.21.2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "installed: deepspeed 0.21.2, which has not been tested" in proc.stderr


def test_allow_untested_turns_the_floor_into_a_warning(monkeypatch):
    monkeypatch.setenv("DS_PFC_ALLOW_UNTESTED", "1")
    with pytest.warns(RuntimeWarning, match=r"installed: torch 2\.11\.0.*DS_PFC_ALLOW_UNTESTED=1"):
        _versions.check_version("torch", "2.11.0+cu130")
    monkeypatch.setenv("DS_PFC_ALLOW_UNTESTED", "0")
    with pytest.raises(ImportError, match="DS_PFC_ALLOW_UNTESTED=1"):
        _versions.check_version("torch", "2.11.0+cu130")
