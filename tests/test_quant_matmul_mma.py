"""The 4-bit matmul's MMA-layout kernel (``ops/quant_matmul/triton.py``) against the reference
(``ops/quant_matmul/reference.py``) on fresh random inputs, at every tiling of x's rows: one n8
tile (M <= 8), two (M <= 16), and four (with ``QmmConfig(mma_rows=32)``, 32-row programs for
M = 17..64: one program column up to 32 rows, two above; the default 16: columns of 16 rows),
with split-K on and off.

On a GPU the kernel runs as compiled; without one, under Triton's CPU interpreter (conftest sets
``TRITON_INTERPRET=1``; the inline PTX is replaced by the kernel's plain-Triton stand-ins) when
Triton is installed, else the module skips. The split is forced by standing in for the SM count
the grid is sized from (``ctas_per_sm=1``: one program per SM). Tolerances are those of
``tests/test_gpu_ops.py``: relative Frobenius error <= 6e-3 and every element within
3e-2 * max|ref| (y is rounded to x's dtype; the interpreter rounds toward zero).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from headstart.ops.quant_matmul import reference
from headstart.ops.quant_matmul import triton as qmm
from headstart.ops.quant_matmul.triton import QmmConfig, prepare, quant_matmul, split_for
from headstart.quant import quantize

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_weight(n: int, k: int, group: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEV)
    return quantize(w, bits=4, group_size=group, scale_dtype=torch.bfloat16)


def check(qt, p, m: int, seed: int, x_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    n, k = qt.shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(x_dtype).to(DEV)
    y = quant_matmul(x, p)
    assert y.shape == (m, n) and y.dtype == x_dtype
    ref = reference.quant_matmul(x.float(), qt)  # fp32: the product of the same inputs
    assert torch.isfinite(y).all()
    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= 6e-3, f"relative error {err:.2e}"
    assert (y.float() - ref).abs().max() <= 3e-2 * ref.abs().max()
    # The split-K counters are back at zero: a second call gives the same bits.
    assert not p.counters.any()
    assert torch.equal(quant_matmul(x, p), y)
    return y


@pytest.fixture
def sms(monkeypatch):
    """``sms(n)``: the grid is sized as for a GPU of n SMs (n = 1 with ctas_per_sm=1: no
    split-K; many: as many K splits as there are chunk pairs)."""

    def set_sms(n: int) -> None:
        monkeypatch.setattr(qmm, "sm_count", lambda device: n)

    return set_sms


# 1, 9, 16: one and two n8 tiles; 17..32: one 32-row program column; 33..64: two (the second
# partly beyond M)
@pytest.mark.parametrize("m", [1, 9, 16, 17, 24, 31, 32, 33, 50, 64])
@pytest.mark.parametrize("split", [False, True])
def test_mma_rows_and_split_k(m, split, sms):
    qt = make_weight(256, 256, 64, seed=m)
    cfg = QmmConfig(ctas_per_sm=1, mma_rows=32)
    p = prepare(qt, cfg, layout="mma")
    sms(1000 if split else 1)
    rows, n_split, _ = split_for(p, m)
    assert rows == (8 if m <= 8 else 16 if m <= 16 else 32)
    assert n_split == (p.sb.shape[1] if split else 1) and (n_split > 1) == split
    check(qt, p, m, seed=m + 100)


@pytest.mark.parametrize("m", [31, 50])
@pytest.mark.parametrize("split", [False, True])
def test_mma_rows_16_runs_columns_of_16(m, split, sms):
    """mma_rows=16 (the default: 16-row columns of two n8 tiles) against 32-row programs on the
    same weight and x."""
    qt = make_weight(256, 256, 64, seed=7)
    p16 = prepare(qt, QmmConfig(ctas_per_sm=1, mma_rows=16), layout="mma")
    p32 = prepare(qt, QmmConfig(ctas_per_sm=1, mma_rows=32), layout="mma")
    sms(1000 if split else 1)
    assert split_for(p16, m)[0] == 16 and split_for(p32, m)[0] == 32
    y16 = check(qt, p16, m, seed=m)
    y32 = check(qt, p32, m, seed=m)
    # Each output element sums the same products in the same order either way.
    assert torch.equal(y16, y32)
    # Above 16 rows x comes a chunk ahead by default (x_chunk_ahead_wide); the pair prefetch
    # of M <= 16 gives the same sums.
    pair = prepare(qt, QmmConfig(ctas_per_sm=1, x_chunk_ahead_wide=False), layout="mma")
    assert torch.equal(check(qt, pair, m, seed=m), y16)


@pytest.mark.parametrize(
    "k,group,block_n,cfg,x_dtype",
    [
        (
            320,
            64,
            128,
            QmmConfig(mma_rows=32),
            torch.bfloat16,
        ),  # K not a whole chunk pair (x masks)
        (384, 128, 128, QmmConfig(mma_rows=32), torch.float16),  # fp16 x, groups of two chunks
        (256, 64, 64, QmmConfig(mma_rows=32), torch.bfloat16),  # 4 warps, a 16-row block each
        (256, 64, 256, QmmConfig(mma_rows=32), torch.bfloat16),  # 16 warps, a 16-row block each
        (256, 64, 128, QmmConfig(prefetch=False, mma_rows=32), torch.bfloat16),
        (256, 64, 128, QmmConfig(prefetch_x=False, mma_rows=32), torch.bfloat16),
        (
            320,
            64,
            128,
            QmmConfig(prefetch_x=False, x_chunk_ahead=True, mma_rows=32),
            torch.bfloat16,
        ),  # x a chunk ahead, K not a whole chunk pair
        (256, 64, 128, QmmConfig(num_stages=3, mma_rows=32), torch.bfloat16),  # Triton's pipeliner
    ],
)
def test_mma_32_row_programs_other_shapes_and_configs(k, group, block_n, cfg, x_dtype, sms):
    qt = make_weight(200, k, group, seed=k + block_n)  # 200: rows padded to the tile
    p = prepare(qt, cfg, block_n=block_n, layout="mma")
    sms(8)
    assert split_for(p, 31)[0] == 32
    # one warp per 16-row block; with the weight dequantized in the A registers, num_warps
    f16 = x_dtype == torch.float16
    want = min(cfg.num_warps, block_n // 16) if qmm._dequant_a(p, cfg, f16) else block_n // 16
    assert qmm._mma_warps(p, p.config, 4, f16) == want
    check(qt, p, 31, seed=k + block_n + 1, x_dtype=x_dtype)


def test_mma_rows_must_be_16_or_32():
    p = prepare(make_weight(128, 256, 64, seed=1), QmmConfig(mma_rows=64), layout="mma")
    with pytest.raises(ValueError, match="mma_rows"):
        quant_matmul(torch.zeros(20, 256, dtype=torch.bfloat16, device=DEV), p)


@pytest.mark.parametrize("m", [1, 16, 31])
@pytest.mark.parametrize("rows", [16, 32])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("x_ahead", ["pair", "chunk", "none"])
def test_weight_dequantized_in_the_a_registers(m, rows, split, x_ahead, sms):
    """``QmmConfig(dequant_a=True)``: the A registers hold ``s q + b`` rounded once to x's
    dtype and the MMAs accumulate into y; within the same tolerances, at one, two and four n8
    tiles, split or not, with x prefetched a pair ahead, a chunk ahead or not at all."""
    qt = make_weight(256, 256, 64, seed=m + rows)
    cfg = QmmConfig(
        ctas_per_sm=1,
        mma_rows=rows,
        dequant_a=True,
        prefetch_x=x_ahead == "pair",
        x_chunk_ahead=x_ahead == "chunk",
    )
    p = prepare(qt, cfg, layout="mma")
    sms(1000 if split else 1)
    check(qt, p, m, seed=m + 5)


@pytest.mark.parametrize(
    "k,group,x_dtype,scale_dtype",
    [
        (320, 64, torch.bfloat16, torch.bfloat16),  # K not a whole chunk pair
        (384, 128, torch.float16, torch.float16),  # fp16 x and scales, groups of two chunks
        (256, 64, torch.float16, torch.bfloat16),  # scales not in x's dtype: the codes path
    ],
)
def test_weight_dequantized_other_formats(k, group, x_dtype, scale_dtype, sms):
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(200, k, generator=g) * 0.05).to(DEV)
    qt = quantize(w, bits=4, group_size=group, scale_dtype=scale_dtype)
    p = prepare(qt, QmmConfig(dequant_a=True), layout="mma")
    sms(8)
    check(qt, p, 31, seed=k + 1, x_dtype=x_dtype)
