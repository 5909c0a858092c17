"""The 4-bit matmul's dot kernel (``ops/quant_matmul/triton_dot.py``: the MMA layout's words
as Triton dots, for x of 17..64 rows) against the reference on fresh random inputs: x's rows
padded to 32 and 64, split-K on and off, the weight dequantized per element and the codes
path, bf16 and fp16 scales and x, groups of 64 and 128, rows not a multiple of the tile and a
chunk count that pads a chunk past K.

On a GPU the kernel runs as compiled; without one under Triton's CPU interpreter (conftest),
else the module skips. Tolerances are ``tests/test_quant_matmul_mma.py``'s.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from headstart.ops.quant_matmul import reference, triton_dot
from headstart.ops.quant_matmul.triton import QmmConfig, prepare, quant_matmul
from headstart.quant import quantize

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run(n, k, m, group, seed, *, deq, x_dtype=torch.bfloat16, scale_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEV)
    qt = quantize(w, bits=4, group_size=group, scale_dtype=scale_dtype)
    p = prepare(qt, layout="mma")
    x = torch.randn(m, k, generator=g).to(x_dtype).to(DEV)
    y = torch.empty(m, n, dtype=x_dtype, device=DEV)
    triton_dot.quant_matmul_dot(x, p, y, deq=deq)
    ref = reference.quant_matmul(x.float(), qt)
    assert torch.isfinite(y).all()
    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= 6e-3, f"relative error {err:.2e}"
    assert (y.float() - ref).abs().max() <= 3e-2 * ref.abs().max()
    assert not p.counters.any()  # split-K counters back at zero
    y2 = torch.empty_like(y)
    triton_dot.quant_matmul_dot(x, p, y2, deq=deq)
    assert torch.equal(y, y2)  # deterministic, split or not


@pytest.fixture
def sms(monkeypatch):
    def set_sms(n: int) -> None:
        monkeypatch.setattr(triton_dot, "sm_count", lambda device: n)

    return set_sms


@pytest.mark.parametrize("m", [17, 31, 32, 33, 64])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("deq", [True, False])
def test_dot_rows_split_and_dequant(m, split, deq, sms):
    sms(1000 if split else 1)
    assert (triton_dot.dot_split(2, 6, 2000 if split else 2)[0] > 1) == split
    # 192 rows: a tile and a half of 128; K = 384: 6 chunks.
    run(192, 384, m, 64, seed=m + 10 * split, deq=deq)


@pytest.mark.parametrize("deq", [True, False])
def test_dot_fp16_groups_of_128_and_a_padded_chunk(deq, sms):
    sms(1000)
    # K = 320: 5 chunks, padded to 6 (zero codes and scales, x read as zero past K).
    run(128, 320, 24, 64, seed=3, deq=deq, x_dtype=torch.float16, scale_dtype=torch.float16)
    run(130, 256, 40, 128, seed=4, deq=deq)


def test_dot_split_keeps_two_chunks_a_split():
    assert triton_dot.dot_split(96, 80, 264) == (3, 27)
    assert triton_dot.dot_split(96, 80, 96) == (1, 80)
    assert triton_dot.dot_split(1, 6, 1000) == (3, 2)


def test_quant_matmul_takes_the_dot_kernel_from_dot_min_rows():
    """``QmmConfig.dot_min_rows``: x of that many rows or more (and more than 16) through the
    dot kernel, bit for bit its output; fewer through the MMA kernel (within tolerance)."""
    g = torch.Generator().manual_seed(7)
    qt = quantize((torch.randn(128, 256, generator=g) * 0.05).to(DEV), bits=4, group_size=64)
    cfg = QmmConfig(dot_min_rows=24, dot_dequant=False, dot_stages=2)
    p = prepare(qt, cfg, layout="mma")
    for m in (16, 23, 24, 40):
        x = torch.randn(m, 256, generator=g).to(torch.bfloat16).to(DEV)
        y = quant_matmul(x, p)
        direct = torch.empty_like(y)
        triton_dot.quant_matmul_dot(x, p, direct, deq=False, num_stages=2)
        mma = quant_matmul(x, p, QmmConfig())
        if m >= 24:
            assert torch.equal(y, direct)
        else:
            assert torch.equal(y, mma)
