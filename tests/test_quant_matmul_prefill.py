"""The 4-bit matmul's prefill kernel (``ops/quant_matmul/prefill.py``: x of more than 64 rows
times a weight in the MMA layout, dequantized tile by tile) against the reference
(``ops/quant_matmul/reference.py``) and against dequantize + matmul, on fresh random inputs: both
dot orientations, every tile height of the layout, rows and features that are not whole tiles,
groups of 64 and 128, bf16 and fp16.

On a GPU the kernel runs as compiled; without one, under Triton's CPU interpreter (conftest sets
``TRITON_INTERPRET=1``). Tolerances are those of ``tests/test_quant_matmul_mma.py``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from headstart.ops.quant_matmul import reference
from headstart.ops.quant_matmul.prefill import PrefillConfig, prefill_matmul
from headstart.ops.quant_matmul.triton import QmmConfig, dequantize_prepared, prepare, quant_matmul
from headstart.quant import quantize

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check(n, k, m, group, block_n, cfg, x_dtype=torch.bfloat16, scale_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEV)
    qt = quantize(w, bits=4, group_size=group, scale_dtype=scale_dtype)
    p = prepare(qt, block_n=block_n, layout="mma")
    x = torch.randn(m, k, generator=g).to(x_dtype).to(DEV)
    y = prefill_matmul(x, p, cfg)
    assert y.shape == (m, n) and y.dtype == x_dtype
    ref = reference.quant_matmul(x.float(), qt)
    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= 6e-3, f"relative error {err:.2e}"
    assert (y.float() - ref).abs().max() <= 3e-2 * ref.abs().max()
    # The weight it multiplies is the dequantized one, rounded to x's dtype: against that
    # product in fp32 only the summation order differs.
    dense = dequantize_prepared(p, x_dtype).float()
    exact = (x.float() @ dense.T).to(x_dtype).float()
    assert (y.float() - exact).abs().max() <= 2e-2 * exact.abs().max() + 1e-6


@pytest.mark.parametrize("w_as_a", [False, True])
@pytest.mark.parametrize(
    ("n", "k", "m", "block_n"),
    [(200, 320, 70, 128), (130, 256, 129, 64), (256, 128, 65, 256), (384, 192, 200, 128)],
)
def test_against_reference(n, k, m, block_n, w_as_a):
    check(n, k, m, 64, block_n, PrefillConfig(w_as_a=w_as_a))


@pytest.mark.parametrize(
    ("group", "x_dtype", "scale_dtype"),
    [
        (128, torch.bfloat16, torch.bfloat16),
        (64, torch.float16, torch.float16),
        (64, torch.bfloat16, torch.float16),
    ],
)
def test_other_formats(group, x_dtype, scale_dtype):
    check(160, 384, 80, group, 128, PrefillConfig(), x_dtype, scale_dtype, seed=1)


def test_grouped_order_and_tile_heights():
    # Several groups of x tiles (group_m 2 over 3 tiles of 64 rows: a partial last group).
    check(300, 128, 150, 64, 128, PrefillConfig(block_m=64, group_m=2), seed=2)
    check(300, 128, 150, 64, 128, PrefillConfig(block_m=32, group_m=1, w_as_a=True), seed=3)


def test_quant_matmul_routes_prefill_rows():
    """Above 64 rows ``quant_matmul`` multiplies through the prefill kernel (the same bits),
    through dequantize + matmul with ``prefill_kernel`` off or above ``prefill_kernel_rows``,
    and through the dense copy where
    the weight keeps one; at 64 rows and fewer through the MMA kernel, whatever the knob."""
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(192, 256, generator=g) * 0.05).to(DEV)
    qt = quantize(w, bits=4, group_size=64, scale_dtype=torch.bfloat16)
    p = prepare(qt, layout="mma")
    x = torch.randn(3, 40, 256, generator=g).to(torch.bfloat16).to(DEV)  # 120 rows
    y = quant_matmul(x, p)
    assert y.shape == (3, 40, 192)
    assert torch.equal(y, prefill_matmul(x.reshape(120, 256), p).reshape(3, 40, 192))
    dense = dequantize_prepared(p)
    off = quant_matmul(x, p, QmmConfig(prefill_kernel=False))
    assert torch.equal(off, (x.reshape(120, 256) @ dense.T).reshape(3, 40, 192))
    capped = quant_matmul(x, p, QmmConfig(prefill_kernel_rows=119))
    assert torch.equal(capped, off)
    kept = prepare(qt, layout="mma", dense=torch.bfloat16)
    assert torch.equal(quant_matmul(x, kept), off)
    small = x.reshape(120, 256)[:64]
    assert torch.equal(
        quant_matmul(small, p), quant_matmul(small, p, QmmConfig(prefill_kernel=False))
    )
