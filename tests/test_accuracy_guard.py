"""Regression guard on training quality: several seeds of a small training run must
reach the held-out accuracy and the final loss recorded in
benchmarks/results/accuracy_guard.json.

A change of training semantics (a margin on the wrong logit, momentum or weight
decay on the wrong rows, a lost gradient term, a wrong loss scale) can pass every
exactness test that does not cover it and only shows in training. Single runs
cannot show it: the accuracy of one seed moves by several points with float32
rounding alone (see ds_pfc.bench.accuracy). This test trains the ``guard`` config
(200 identities x 10 images at 32 x 32, 148 steps) for seeds 0-5, two processes at
a time, and fails when their mean accuracy falls, or their mean final loss moves,
by more than ``3 sigma sqrt(1/6 + 1/n)`` from the record of ``n`` seeds with
spread ``sigma`` (ds_pfc.bench.accuracy.guard_verdict). A run takes about 20 s on an
idle core, so the test about 70 s on 2 idle cores (5 minutes on a heavily shared one).

Re-record after an intended change of training behaviour:
``python launch/bench.py accuracy --config guard --seeds 0-9 --label main --out
benchmarks/results/accuracy_guard.json`` (the file keeps one entry per label).
"""
from __future__ import annotations

import pytest

from ds_pfc.bench import accuracy


@pytest.mark.slow
def test_guard_config_reaches_recorded_accuracy_and_loss():
    res = accuracy.guard_check(jobs=2)
    for key, check in res["checks"].items():
        assert check["recorded_std"] > 0, f"the record's {key} has no spread"
    assert res["checks"]["accuracy"]["tolerance"] < 0.1, "the record's accuracy spread is too wide to guard"
    per_seed = ", ".join(f"{r['seed']}: acc {r['accuracy']:.3f} loss {r['final_loss']:.2f}" for r in res["runs"])
    assert res["passed"], f"{accuracy.format_verdict(res)}\nper seed: {per_seed}"
