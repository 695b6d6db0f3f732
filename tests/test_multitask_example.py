"""``launch/multitask_tp.py`` end to end: 4 CPU ranks through the deepspeed launcher,
a backbone split by AutoTP (TP 2 x DP 2) and two heads built inside ``initialize``."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from _dist import free_port

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_multitask_tp_example_trains_with_the_documented_layout():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    launcher = shutil.which("deepspeed") or os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [launcher, "--num_gpus", "4", "--master_port", str(free_port()),
           os.path.join(ROOT, "launch", "multitask_tp.py"), "--tp", "2", "--steps", "30"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # identity: 41 classes over all 4 ranks; attribute: 5 classes over the 2 data-parallel positions
    for rank, (lo, hi) in enumerate([(0, 11), (11, 21), (21, 31), (31, 41)]):
        assert f"[rank {rank}] identity: classes [{lo}, {hi}) of 41 (rank {rank} of 4" in out
    for rank, (lo, hi) in enumerate([(0, 3), (0, 3), (3, 5), (3, 5)]):
        assert f"[rank {rank}] attribute: classes [{lo}, {hi}) of 5 (rank {rank // 2} of 2" in out
    losses = [float(v) for v in re.findall(r"^step \d+/30 loss ([0-9.]+)", out, re.M)]
    assert len(losses) == 4 and losses[-1] < 0.6 * losses[0], losses
