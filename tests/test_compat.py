"""The module paths of 0.1 keep importing, as the moved module itself: every entry of
``ds_pfc._compat.MOVED`` resolves to the very module object at its new path (so a patch
through either path reaches the code that runs), and a pickle naming a class under an
old path loads the class of the new one."""
from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys

import pytest

import ds_pfc
from ds_pfc._compat import MOVED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Written out, not read from MOVED: a dropped entry fails here.
OLD_PATHS = ["ds_pfc.partition", "ds_pfc.sampling", "ds_pfc.collectives", "ds_pfc.margins", "ds_pfc.softmax",
             "ds_pfc.functional", "ds_pfc.optim", "ds_pfc.head", "ds_pfc.checkpoint_tags", "ds_pfc.universal",
             "ds_pfc.config", "ds_pfc.training", "ds_pfc.experiments", "ds_pfc.export", "ds_pfc.finetune",
             "ds_pfc.resume_changes", "ds_pfc.arcface_import", "ds_pfc.eval.models"]


def test_table_is_complete():
    assert sorted(MOVED) == sorted(OLD_PATHS)


@pytest.mark.parametrize("old", OLD_PATHS)
def test_old_path_is_the_new_module(old):
    new = importlib.import_module(MOVED[old])
    assert importlib.import_module(old) is new
    assert sys.modules[old] is new
    assert new.__name__ == MOVED[old] and new.__spec__.name == MOVED[old]
    parent, _, last = old.rpartition(".")
    assert getattr(sys.modules[parent], last) is new


def test_from_import_and_patch_reach_the_same_object(monkeypatch):
    from ds_pfc.config import split_config
    from ds_pfc.app import config, training
    assert split_config is config.split_config
    monkeypatch.setattr("ds_pfc.training.bind_local_device", "patched")
    assert training.bind_local_device == "patched"


def test_old_pickle_loads():
    data = pickle.dumps(ds_pfc.ArcFace(scale=32.0, margin=0.4), protocol=2)
    assert b"ds_pfc.core.margins" in data
    old = data.replace(b"ds_pfc.core.margins", b"ds_pfc.margins")
    margin = pickle.loads(old)
    assert type(margin) is ds_pfc.ArcFace and margin.scale == 32.0


def test_fresh_interpreter():
    """``import ds_pfc.head`` first thing in a new process (no prior ``import ds_pfc``)."""
    code = "import ds_pfc.head, ds_pfc.core.head as h; assert ds_pfc.head is h; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
