"""The wheel is the whole product: it carries the shipped configs, which an installed
(not editable) copy lists and runs by name from any directory."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """ds_pfc built as a wheel and installed into a directory of its own (no source tree)."""
    import shutil
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy of what the wheel is made of: a build writes build/ and *.egg-info
    # next to setup.cfg, which must not land in the checkout.
    source = tmp / "src"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE", "configs", "ds_pfc"):
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, source / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif os.path.exists(path):
            shutil.copy2(path, source / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            str(source), "-w", str(tmp / "dist")], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    [wheel] = glob.glob(str(tmp / "dist" / "ds_pfc-*.whl"))
    target = tmp / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                              str(target), wheel], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    return wheel, target, tmp


def _in_installed(target, tmp, *args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(target), OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch_extensions"))
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, *args], cwd=str(work), env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_wheel_holds_every_shipped_config(installed):
    wheel, _, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(os.listdir(os.path.join(ROOT, "configs")))
    assert shipped and all(f"ds_pfc/configs/{n}" in names for n in shipped)
    metadata = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("METADATA"))
    assert "Classifier: License :: OSI Approved :: Apache Software License" in metadata
    assert "Requires-Dist: deepspeed" in metadata


def test_an_installed_copy_lists_and_runs_a_shipped_recipe_by_name(installed):
    _, target, tmp = installed
    where = _in_installed(target, tmp, "-c", "import ds_pfc, sys; print(ds_pfc.__file__)")
    assert where.stdout.startswith(str(target)), where.stdout + where.stderr      # not the checkout
    listed = _in_installed(target, tmp, "-m", "ds_pfc.cli.train", "--list-configs")
    assert listed.returncode == 0, listed.stderr[-2000:]
    for name in ("arcface_ms1mv3_r50_8gpu", "cpu_quickstart", "ms1mv2_r100_8gpu_fp16"):
        assert any(line.startswith(name + " ") for line in listed.stdout.splitlines()), listed.stdout
    wrong = _in_installed(target, tmp, "-m", "ds_pfc.cli.train", "--deepspeed_config", "arcface_ms1mv3_r5_8gpu")
    assert wrong.returncode == 1 and "did you mean arcface_ms1mv3_r50_8gpu" in wrong.stderr, wrong.stderr[-2000:]

    out = tmp / "work" / "run"
    run = _in_installed(target, tmp, "-m", "ds_pfc.cli.train", "--deepspeed_config", "cpu_quickstart",
                        "--output_dir", str(out), "--max_steps", "2", "--set", "ds_pfc.evaluation.synthetic_pairs=40",
                        "--set", "ds_pfc.data.synthetic.images_per_identity=4", "--set",
                        "ds_pfc.data.synthetic.held_out_identities=20")
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.load(open(out / "summary.json"))
    assert summary["steps"] == 2 and os.path.isfile(summary["export"])
    used = json.load(open(out / "config.json"))
    assert used["ds_pfc"]["evaluation"]["synthetic_pairs"] == 40
    assert os.path.join("ds_pfc", "configs", "cpu_quickstart.json") in open(out / "training.log").read()
