"""A row optimizer for tests: records what the head hands it and changes nothing.

The public way to observe the centers' gradient: ``PartialFC(..., optimizer=CaptureRows())``.
"""
from ds_pfc.core.optim import RowOptimizer


class CaptureRows(RowOptimizer):
    state_specs = ()

    def __init__(self):
        self.calls = []   # (rows or None for all rows, gradient) per step

    def update(self, bank, rows, grad, lr, staged_weight=None, block_bytes=None):
        self.calls.append((None if rows is None else rows.clone(), grad.clone()))

    def update_rows(self, bank, rows, grad, lr, weight=None):
        raise AssertionError("CaptureRows.update_rows is not expected to be called: update() replaces it")

    def config(self):
        return {}
