"""The row mover on a GPU: its stated default launches and a few others, with host tables
mapped into the GPU's address space, bitwise against torch indexing and against the bank's
quantizer run on the CPU (``tests/test_row_mover.py`` runs the same in the interpreter)."""
from __future__ import annotations

import pytest
import torch

from ds_pfc.bank.quantized import dequantize_rows, quantize_rows
from ds_pfc.bank.stores import pinned_table, unregister_table
from ds_pfc.kernels import triton_rows as tr

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or not tr.available() or tr._INTERPRET,
                       reason="needs a CUDA device and Triton compiling for it: `python -m ds_pfc.selfcheck` runs "
                              "these on a GPU machine"),
]

LAUNCHES = [None, tr.MoverConfig(4, 1, 1, 0), tr.MoverConfig(8, 64, 32, 0), tr.MoverConfig(4, 8, 16, 256)]


def _mapped(shape, dtype):
    table, registered = pinned_table(shape, dtype, mapped=True, near=torch.device("cuda"))
    return table, (lambda: unregister_table(table)) if registered else (lambda: None)


@pytest.mark.parametrize("config", LAUNCHES, ids=str)
@pytest.mark.parametrize("width", [128, 512, 1500])
def test_mapped_rows_move_as_torch_indexing(config, width):
    g = torch.Generator().manual_seed(width)
    table, release = _mapped((5000, width), torch.bfloat16)
    try:
        table.copy_(torch.randn(5000, width, generator=g).to(torch.bfloat16))
        idx = torch.randperm(5000, generator=g)[:3001]
        slot = torch.full((3001, width), -1.0, device="cuda")
        tr.move_rows_(table, idx.cuda(), slot, None, config=config)
        torch.cuda.synchronize()
        assert torch.equal(slot.cpu(), table[idx].float())
        stepped = torch.randn(3001, width, generator=g)
        tr.move_rows_(stepped.cuda(), None, table, idx.cuda(), config=config)
        torch.cuda.synchronize()
        assert torch.equal(table[idx], stepped.to(torch.bfloat16))
    finally:
        release()


@pytest.mark.parametrize("config", LAUNCHES, ids=str)
@pytest.mark.parametrize("width", [64, 512, 1500])
def test_mapped_int8_rows_code_and_decode_as_the_bank_rounds(config, width):
    g = torch.Generator().manual_seed(width + 1)
    v = torch.randn(2001, width, generator=g) * torch.logspace(-8, 8, 2001)[:, None]
    v[0] = 0.0
    rq, rs = quantize_rows(v)
    q, release_q = _mapped((4000, width), torch.int8)
    scale, release_s = _mapped((4000,), torch.float32)
    try:
        at = torch.randperm(4000, generator=g)[:2001]
        tr.encode_rows_(v.cuda(), None, q, scale, at.cuda(), config=config)
        torch.cuda.synchronize()
        assert torch.equal(q[at], rq) and torch.equal(scale[at], rs)
        slot = torch.zeros(2001, width, device="cuda")
        tr.decode_rows_(q, scale, at.cuda(), slot, None, config=config)
        torch.cuda.synchronize()
        assert torch.equal(slot.cpu(), dequantize_rows(rq, rs))
        out = torch.zeros(2001, width, device="cuda")
        tr.move_rows_(v.cuda(), None, out, None, None, tr.INT8_ROWWISE, config=config)
        assert torch.equal(out.cpu(), dequantize_rows(rq, rs))
    finally:
        release_q()
        release_s()
