"""Regression guard on training quality: several seeds of a small training run must
reach the held-out accuracy recorded in benchmarks/results/accuracy_guard.json.

A change of training semantics (a margin on the wrong logit, momentum or weight
decay on the wrong rows, a wrong loss scale) can pass every exactness test that
does not cover it and only shows as lower accuracy. Single runs cannot show it: the
accuracy of one seed moves by several points with float32 rounding alone (see
ds_pfc.bench.accuracy). This test trains the ``guard`` config (200 identities x 10
images at 32 x 32, 148 steps) for 6 seeds, two processes at a time, and fails when
their mean falls more than ``3 sigma sqrt(1/6 + 1/n)`` below the recorded mean of
``n`` seeds with spread ``sigma``. About a minute and a half on 2 idle cores.

Re-record after an intended change of training behaviour:
``python launch/bench.py accuracy --config guard --seeds 0-9 --label main --out
benchmarks/results/accuracy_guard.json`` (the file keeps one entry per label).
"""
from __future__ import annotations

import pytest

from ds_pfc.bench import accuracy


@pytest.mark.slow
def test_guard_config_reaches_recorded_accuracy():
    res = accuracy.guard_check(jobs=2)
    per_seed = ", ".join(f"{r['seed']}: {r['accuracy']:.3f}" for r in res["runs"])
    assert res["recorded_std"] > 0 and res["tolerance"] < 0.1, "the record must have a usable spread"
    assert res["passed"], (
        f"held-out accuracy dropped: mean {res['mean']:.4f} over {len(res['runs'])} seeds ({per_seed}) < "
        f"threshold {res['threshold']:.4f} (recorded {res['recorded_mean']:.4f} +- {res['recorded_std']:.4f} "
        f"over {res['recorded_seeds']} seeds, tolerance {res['tolerance']:.4f})")
