"""8-bit optimizer moments with a scale per row (``Placement(tier, "int8_rowwise")``).

References, independent of the code under test:

* the code itself against numpy float32 arithmetic written from the definition
  (``s = max|v| / 127``, ``q = rint(v / s)``), and the error bound it implies;
* every trajectory against the plain device bank (``bank=None``) whose momentum rows are
  quantized and dequantized (by the numpy reference) after each step, at the rows that
  step updated: bitwise, for the staged and the mapped paths, on the device and host
  tiers, with and without prefetch, with the plain CPU runtime and the stream emulator.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ds_pfc import ArcFace, PartialFC
from ds_pfc.app.config import BankConfig, ConfigError
from ds_pfc.bank import Placement, TieredBank
from ds_pfc.bank.quantized import INT8_ROWWISE, dequantize_rows, quantize_rows
from ds_pfc.bank.streams import DEBUG_ENV

C, D, STEPS = 1021, 16, 10


def _np_round_trip(v: torch.Tensor) -> torch.Tensor:
    """Quantize and dequantize float32 rows in numpy float32, from the definition."""
    a = v.numpy().astype(np.float32)
    out = np.empty_like(a)
    for i, row in enumerate(a):
        s = np.float32(np.max(np.abs(row))) / np.float32(127.0)
        q = np.zeros_like(row) if s == 0 else np.clip(np.rint(row / s), -127, 127)
        out[i] = q.astype(np.float32) * s
    return torch.from_numpy(out)


def test_codes_follow_the_definition_and_its_error_bound():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(257, 37, generator=g) * torch.logspace(-6, 3, 257)[:, None]
    v[3] = 0.0
    v[5, 7] = 1e4                      # one large entry: that row's scale, not the others'
    q, scale = quantize_rows(v)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.abs().max() <= 127
    back = dequantize_rows(q, scale)
    assert torch.equal(back, _np_round_trip(v))
    assert torch.equal(back[3], torch.zeros(37))
    err = (back - v).abs().amax(dim=1)
    bound = v.abs().amax(dim=1) / 127 / 2 * (1 + 1e-5)
    assert bool((err <= bound).all())
    assert float(err[6]) < 1e-2 * float(err[5])      # rows do not share a scale


# ---------------------------------------------------------------- trajectories
def _batches(steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(C, generator=g)[:120]
    proto = torch.randn(C, D, generator=g)
    out = []
    for t in range(steps):
        y = pool[torch.randint(0, pool.numel(), (5 + (3 * t) % 7,), generator=g)]
        out.append((proto[y] + 0.3 * torch.randn(y.numel(), D, generator=g), y))
    return out


def _head(bank=None):
    return PartialFC(C, D, sample_rate=0.2, margin=ArcFace(16.0, 0.3), seed=7, bank=bank, optimizer="sgd",
                     momentum=0.9, weight_decay=5e-4)


def _train(head, batches, *, prefetch, after_step=None):
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = head(x, y)
        loss.backward()
        losses.append(loss.item())
        if prefetch and i + 1 < len(batches):
            head.prefetch(batches[i + 1][1])
        head.step(2.0)
        if after_step is not None:
            after_step(head, i)
    return losses


def _reference(batches):
    """The device bank; after each step its momentum rows of that step's active set go
    through the numpy round trip."""
    head = _head()
    sets = [head.active_set(head.partition.to_local(y, 0), t) for t, (_, y) in enumerate(batches)]

    def code(h, i):
        rows = sets[i]
        h.bank.write("momentum_buffer", rows, _np_round_trip(h.bank.read("momentum_buffer", rows)))
    losses = _train(head, batches, prefetch=False, after_step=code)
    return losses, head.centers(), head.state_dict()["momentum_buffer"].clone() \
        if "momentum_buffer" in head.state_dict() else head.bank.export("momentum_buffer")


@pytest.mark.parametrize("streams", ["sync", "emulated"])
@pytest.mark.parametrize("access", ["staged", "mapped"])
@pytest.mark.parametrize("tier", ["device", "host"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
def test_int8_momentum_matches_the_coded_device_bank_bitwise(monkeypatch, streams, access, tier, prefetch):
    monkeypatch.setenv(DEBUG_ENV, "1" if streams == "emulated" else "0")
    b = _batches(STEPS)
    ref_losses, ref_centers, ref_momentum = _reference(b)
    bank = TieredBank.factory({"momentum_buffer": (tier, INT8_ROWWISE)}, default="host", host_access=access)
    head = _head(bank)
    assert type(head.bank.store("momentum_buffer")).__name__ == "RowwiseInt8Store"
    losses = _train(head, b, prefetch=prefetch)
    centers, momentum = head.centers(), head.bank.export("momentum_buffer")
    head.close()
    assert losses == ref_losses
    assert torch.equal(centers, ref_centers)
    assert torch.equal(momentum, ref_momentum)
    assert sum(losses[-3:]) < sum(losses[:3])


def test_int8_momentum_memory_and_traffic():
    """d + 4 bytes per row of momentum, in the placed tier; traffic counts those bytes."""
    head = _head(TieredBank.factory({"momentum_buffer": ("device", INT8_ROWWISE)}, default="host"))
    report = head.memory_report()["resident"]
    assert report["device"] == C * (D + 4)
    x, y = _batches(1)[0]
    active = head.active_set(head.partition.to_local(y, 0), 0)
    head(x, y).backward()
    head.step(0.1)
    assert head.last_step_traffic["staged_in"] == active.numel() * (D * 4 + D + 4)
    head.close()


def test_int8_storage_is_refused_where_it_does_not_belong(tmp_path):
    with pytest.raises(ValueError, match="cannot be stored as 'int8_rowwise'"):
        _head(TieredBank.factory({"weight": ("host", INT8_ROWWISE)}))
    with pytest.raises(ValueError, match="not a per-step tier"):
        Placement("nvme", INT8_ROWWISE)
    with pytest.raises(TypeError, match="int8_rowwise"):
        Placement("host", "int4")
    with pytest.raises(ConfigError, match="ds_pfc.head.bank.placements.weight"):
        BankConfig(default="host", placements={"weight": ["host", "int4"]})
    factory = BankConfig(default="host", placements={"momentum_buffer": ["device", "int8_rowwise"]}).build()
    head = _head(factory)
    assert head.bank.store("momentum_buffer").tier == "device"
    head.close()


def test_int8_rows_in_host_memory_are_not_mapped_on_cuda_without_the_kernel():
    """On CUDA, mapped access needs the GPU to decode host rows in place (the row-move kernel); a bank
    without it refuses before allocating anything (no CUDA device is needed to see it)."""
    bank = TieredBank(10, torch.device("cuda"), placements={"momentum_buffer": Placement("host", INT8_ROWWISE)},
                      default=Placement("host"), host_access="mapped")
    with pytest.raises(ValueError, match="row-move kernel .* place them on the device tier or use host_access=.staged."):
        bank.add_state("momentum_buffer", 4, torch.float32)
    assert bank.state_names() == []
