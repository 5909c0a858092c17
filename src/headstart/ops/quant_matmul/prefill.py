"""``y = x @ W^T`` for prefill-sized x (M > 64 rows) straight from the MMA layout (GPU).

Contract: :func:`prefill_matmul` computes what ``triton.quant_matmul`` (this package) computes
for a weight prepared in the "mma" layout (``triton.prepare``) and x in bf16 or fp16:
``x [M, K] @ W^T -> [M, N]`` in x's dtype, fp32 accumulation, each weight
``s q + b`` rounded once to x's dtype before it is multiplied (as dequantize + cuBLAS rounds it).
The spec is :func:`headstart.ops.quant_matmul.reference.quant_matmul`; only the summation order
differs from dequantize + cuBLAS.

Job: above 64 rows a projection is compute-bound, and the alternative it replaces writes the whole
weight unpacked to bf16 (4 bytes a weight of extra memory traffic, a write and cuBLAS's read) on
every call, or keeps a dense bf16 copy of every weight (four times the 4-bit weights' memory).
Here each program dequantizes a ``BN x 64`` tile of the weight in registers, once per chunk, and
feeds it to ``tl.dot`` beside a ``BM x 64`` tile of x: the weight is read packed (half a byte a
weight), and the dequantize is amortized over ``BM`` rows of x.

Tile decode: a chunk of the MMA layout's tile (``words[tile, c]``, ``BN / 16`` blocks of 32 lanes
of 4 words) is the contiguous 2-D array ``[BN / 2 rows (blk, g), 16 words (t, j)]``; word ``(t,
j)`` of row ``(blk, g)`` holds, in nibble ``half + 2 khi + 4 e``, the code of weight row ``16 blk
+ 8 half + g`` at element ``16 t + 4 j + 2 khi + e`` of the chunk. Broadcast against the shifts
``4 (half + 2 khi + 4 e)`` that array becomes ``[BN / 2, 2 (half), 16, 2 (khi), 2 (e)]``, which is
``[BN rows, 64 elements]`` in the chunk's natural element order (so x's tile is loaded as it is
stored) with the rows in the order ``(blk, g, half)``: the store puts each row's column of y at
its own n. Scales and biases: the chunk pair's entries ``[BN / 2 rows (blk, g), 4 (2 sel +
half)]``.

Non-goals: M <= 64 (the MMA kernel in ``triton.py`` reads each weight once per 16 rows there),
the tiled layout (2/8-bit; dequantize + cuBLAS), fp32 x.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headstart.ops.triton_support import HAVE_TRITON, INTERPRET, tl, triton

MMA_CHUNK = 64  # K elements per chunk of the MMA layout (one scale/bias per row and chunk)


@dataclass(frozen=True)
class PrefillConfig:
    """Launch knobs of :func:`prefill_matmul` (defaults: ``benchmarks/qmm_prefill.py`` on the GPU).

    ``block_m``: rows of x per program (0: 64 up to 128 rows, else 128). ``w_as_a``: the
    dequantized weight is the dot's A operand (``acc[BN, BM] = W x^T``), which Hopper's wgmma may
    take from registers, instead of B (``acc[BM, BN] = x W^T``, through shared memory).
    ``group_m``: programs walk ``group_m`` tiles of x for each weight tile before the next weight
    tile (both stay in L2)."""

    block_m: int = 0
    num_warps: int = 8
    num_stages: int = 3
    w_as_a: bool = False
    group_m: int = 8


if HAVE_TRITON:

    @triton.jit
    def _halves(v, F16: tl.constexpr):
        """int32 holding two bf16 (or fp16) -> (low, high) as fp32."""
        if F16:
            lo = v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            return lo, hi
        else:
            return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)

    # Shape-only integers are not specialized: one compile serves every weight shape and M (a
    # burst of any size compiles nothing new); stride_xm is, for its 16-byte divisibility.
    @triton.jit(do_not_specialize=["M", "N", "K", "stride_ym", "CHUNKS"])
    def _prefill_kernel(
        x_ptr,
        w_ptr,
        sb_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_ym,
        CHUNKS,  # chunks of 64 per tile (a whole number of pairs)
        BN: tl.constexpr,
        BM: tl.constexpr,
        GROUP_M: tl.constexpr,
        SB_F16: tl.constexpr,
        W_AS_A: tl.constexpr,
        FP32_DOT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        m_tiles = tl.cdiv(M, BM)
        n_tiles = tl.cdiv(N, BN)
        # Grouped order: GROUP_M tiles of x for each weight tile, then the next weight tile.
        per_group = GROUP_M * n_tiles
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(m_tiles - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m

        R: tl.constexpr = BN // 2  # rows (blk, g) of a chunk's word array
        r = tl.arange(0, R)
        words = r[:, None] * 16 + tl.arange(0, 16)[None, :]  # [R, 16 (t, j)]
        half = tl.arange(0, 2)
        entries = r[:, None] * 4 + half[None, :]  # [R, 2]: entry 2 sel + half, sel added below
        shifts = (
            4 * half[None, :, None, None, None]
            + 8 * tl.arange(0, 2)[None, None, None, :, None]
            + 16 * tl.arange(0, 2)[None, None, None, None, :]
        )  # [1, 2 (half), 1, 2 (khi), 2 (e)]
        tile = pid_n.to(tl.int64)
        w_base = w_ptr + tile * CHUNKS * (BN * 8)
        sb_base = sb_ptr + tile * (CHUNKS // 2) * (BN * 2)
        m = pid_m * BM + tl.arange(0, BM)
        kk = tl.arange(0, 64)  # MMA_CHUNK (a kernel reads only constexpr globals)
        x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
        if W_AS_A:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for c in range(0, CHUNKS):
            w = tl.load(w_base + c * (BN * 8) + words)
            sbw = tl.load(sb_base + (c // 2) * (BN * 2) + entries + 2 * (c % 2))
            s, b = _halves(sbw, SB_F16)
            q = (w[:, None, :, None, None] >> shifts) & 15  # [R, 2, 16, 2, 2]
            wt = q.to(tl.float32) * s[:, :, None, None, None] + b[:, :, None, None, None]
            wt = tl.reshape(wt.to(x_ptr.dtype.element_ty), (BN, 64))
            k = c * 64 + kk
            xt = tl.load(x_rows + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
            if FP32_DOT:  # Triton's CPU interpreter multiplies bf16 dots' raw bits
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
            if W_AS_A:
                acc = tl.dot(wt, tl.trans(xt), acc)
            else:
                acc = tl.dot(xt, tl.trans(wt), acc)
        # Row i of the tile is weight row (blk, g, half) = 16 blk + 8 half + g.
        i = tl.arange(0, BN)
        n = pid_n * BN + (i // 16) * 16 + (i % 2) * 8 + (i // 2) % 8
        out = acc.to(y_ptr.dtype.element_ty)
        if W_AS_A:
            ptrs = y_ptr + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
            tl.store(ptrs, out, mask=(n[:, None] < N) & (m[None, :] < M))
        else:
            ptrs = y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
            tl.store(ptrs, out, mask=(m[:, None] < M) & (n[None, :] < N))


def block_m_for(m: int, config: PrefillConfig) -> int:
    """Rows of x per program for ``m`` rows."""
    return config.block_m or (64 if m <= 128 else 128)


def prefill_matmul(x2: torch.Tensor, p, config: PrefillConfig | None = None) -> torch.Tensor:
    """``x2 [M, K] @ W^T -> [M, N]`` in x2's dtype (bf16 or fp16) for ``p`` a
    :class:`~headstart.ops.quant_matmul.triton.PreparedQuant` in the "mma" layout."""
    cfg = config or PrefillConfig()
    if p.layout != "mma":
        raise ValueError("prefill_matmul reads the mma layout")
    if x2.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bf16 or fp16, not {x2.dtype}")
    M = x2.shape[0]
    y = torch.empty(M, p.n, dtype=x2.dtype, device=x2.device)
    if M == 0:
        return y
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    BM = block_m_for(M, cfg)
    grid = (triton.cdiv(M, BM) * p.words.shape[0],)
    _prefill_kernel[grid](
        x2,
        p.words,
        p.sb,
        y,
        M,
        p.n,
        p.k,
        x2.stride(0),
        y.stride(0),
        p.words.shape[1],
        BN=p.block_n,
        BM=BM,
        GROUP_M=cfg.group_m,
        SB_F16=not p.sb_bf16,
        W_AS_A=cfg.w_as_a,
        FP32_DOT=INTERPRET,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return y
