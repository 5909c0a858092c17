"""``y = x @ W^T`` for x of 17..64 rows from the MMA layout's words, as Triton dots (GPU).

Contract: :func:`quant_matmul_dot` is :func:`headstart.ops.quant_matmul.triton.quant_matmul`'s
for a weight prepared in the "mma" layout (4-bit, groups of a multiple of 64) and x of at most
64 rows in bf16 or fp16; the spec is :func:`headstart.ops.quant_matmul.reference.quant_matmul`.

Why a second kernel on the same words: the MMA kernel keeps everything in registers and unpacks
every weight word once per 16 rows of x, so at 17..32 rows it unpacks each word twice and is
bound by instruction issue (BENCHMARKS.md, session 27); its 32-row programs need so many
registers that one fits an SM. Here each word is unpacked once for all rows of x, and
Triton's pipeliner (``num_stages``) streams the words through shared memory several chunks
ahead, which holds more bytes in flight than registers can.

The product is transposed (``y^T = W x^T``): the weight's rows are the dots' M side (a tile of
``BN / 2`` rows, the tensor cores' large dimension) and x's rows their N side (16..64). A chunk
of the layout (``BN`` rows x 64 elements) is a dense ``[BN / 2, 16]`` int32 matrix (row ``r =
8 blk + g``, column ``4 t + j``: the module doc of ``triton.py``), whose nibble ``half + 2 khi +
4 e`` holds weight row ``16 (r // 8) + 8 half + r % 8`` at element ``4 (4 t + j) + 2 khi + e``.
So each of the 8 nibble planes is one ``[BN / 2, 16]`` operand, multiplied by the 16 columns of
x at ``4 col + 2 khi + e``: 8 dots of K = 16 per chunk, into two accumulators (``half``), with
no reshuffle of the weight.

The weight is dequantized per element, ``s q + b`` rounded once to x's dtype, as a dequantize +
matmul rounds it (``DEQ``); or the dots take the codes and the affine term is applied per chunk
(``acc += s D + (b - 128 s) sum(x)``, D the dot of ``128 + q``, exact in bf16 and fp16). Split-K
as in ``triton.py``: the last program of a tile to arrive sums the fp32 partials in split order
and resets the tile's counter.
"""

from __future__ import annotations

import torch

from headstart.ops.triton_support import (
    HAVE_TRITON,
    INTERPRET,
    pdl_options,
    sm_count,
    tl,
    triton,
)

if HAVE_TRITON:
    from headstart.ops.triton_support import pdl_wait

    @triton.jit
    def _nibble_plane(wc, P: tl.constexpr, s, b, DEQ: tl.constexpr, dt: tl.constexpr):
        """Nibble plane ``P`` of the chunk's words as a dot operand in x's dtype: the weight
        ``s q + b`` (DEQ) or ``128 + q``, both built from the bits of an fp32 (no int->float
        conversion instruction)."""
        if DEQ:
            # 2^23 + q exactly, minus 2^23: q as fp32 from a shift, a LOP3 and an add.
            f = ((wc >> (4 * P)) & 0xF | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            return (f * s[:, None] + b[:, None]).to(dt)
        else:
            # fp32 128 + q (q in the top mantissa bits' low nibble): exact in bf16 and fp16.
            if P >= 4:
                bits = (wc >> (4 * P - 16)) & 0x000F0000
            else:
                bits = (wc << (16 - 4 * P)) & 0x000F0000
            return (bits | 0x43000000).to(tl.float32, bitcast=True).to(dt)

    @triton.jit
    def _dot(a, b, acc, F32: tl.constexpr):
        """``acc + a @ b``; F32 (Triton's CPU interpreter, whose dot reads bf16 as integers):
        on the same values widened to fp32."""
        if F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _scale_bias(sbw, SB_BF16: tl.constexpr):
        """(scale | bias << 16) words -> fp32 scale and bias."""
        if SB_BF16:
            s = (sbw << 16).to(tl.float32, bitcast=True)
            b = (sbw & -65536).to(tl.float32, bitcast=True)
        else:
            s = (sbw & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            b = (sbw >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return s, b

    @triton.jit
    def _dot_kernel(
        x_ptr,
        w_ptr,
        sb_ptr,
        y_ptr,
        ws_ptr,
        cnt_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_ym,
        CHUNKS_PER_SPLIT,
        NUM_CHUNKS,
        N_TILES,
        SPLIT_K,
        BN: tl.constexpr,
        BM: tl.constexpr,
        SB_BF16: tl.constexpr,
        DEQ: tl.constexpr,
        F32: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """Program (n tile, K split): rows [pid_n BN, +BN) of y^T for chunks [pid_k
        CHUNKS_PER_SPLIT, +CHUNKS_PER_SPLIT) (module doc)."""
        R: tl.constexpr = BN // 2
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        r = tl.arange(0, R)
        col = tl.arange(0, 16)
        m = tl.arange(0, BM)
        dt = x_ptr.dtype.element_ty
        w_tile = w_ptr + pid_n.to(tl.int64) * NUM_CHUNKS * (BN * 8) + r[:, None] * 16 + col[None, :]
        sb_tile = sb_ptr + pid_n.to(tl.int64) * (NUM_CHUNKS // 2) * (BN * 2) + (r // 8) * 32
        sb_tile += (r % 8) * 4
        x_cols = x_ptr + m[None, :] * stride_xm + 4 * col[:, None]  # [16, BM]: x^T
        m_ok = m[None, :] < M
        acc0 = tl.zeros([R, BM], dtype=tl.float32)
        acc1 = tl.zeros([R, BM], dtype=tl.float32)
        zero = tl.zeros([R, BM], dtype=tl.float32)
        c0 = pid_k * CHUNKS_PER_SPLIT
        c1 = tl.minimum(c0 + CHUNKS_PER_SPLIT, NUM_CHUNKS)
        pdl_wait(PDL)
        for c in tl.range(c0, c1):
            wc = tl.load(w_tile + c * (BN * 8))
            sbp = sb_tile + (c // 2) * (BN * 2) + 2 * (c % 2)
            s0, b0 = _scale_bias(tl.load(sbp), SB_BF16)
            s1, b1 = _scale_bias(tl.load(sbp + 1), SB_BF16)
            # The layout's last chunk may be padding past K (zero codes and scales): its x
            # reads as zero.
            x_ok = m_ok & (c * 64 < K)
            xc = x_cols + c * 64
            x00 = tl.load(xc, mask=x_ok, other=0.0)
            x01 = tl.load(xc + 1, mask=x_ok, other=0.0)
            x10 = tl.load(xc + 2, mask=x_ok, other=0.0)
            x11 = tl.load(xc + 3, mask=x_ok, other=0.0)
            # Nibble P = half + 2 khi + 4 e pairs with the columns 2 khi + e (x_{khi e}).
            d0 = _dot(_nibble_plane(wc, 0, s0, b0, DEQ, dt), x00, zero, F32)
            d0 = _dot(_nibble_plane(wc, 2, s0, b0, DEQ, dt), x10, d0, F32)
            d0 = _dot(_nibble_plane(wc, 4, s0, b0, DEQ, dt), x01, d0, F32)
            d0 = _dot(_nibble_plane(wc, 6, s0, b0, DEQ, dt), x11, d0, F32)
            d1 = _dot(_nibble_plane(wc, 1, s1, b1, DEQ, dt), x00, zero, F32)
            d1 = _dot(_nibble_plane(wc, 3, s1, b1, DEQ, dt), x10, d1, F32)
            d1 = _dot(_nibble_plane(wc, 5, s1, b1, DEQ, dt), x01, d1, F32)
            d1 = _dot(_nibble_plane(wc, 7, s1, b1, DEQ, dt), x11, d1, F32)
            if DEQ:
                acc0 += d0
                acc1 += d1
            else:
                xs = tl.sum(x00.to(tl.float32) + x01 + x10 + x11, 0)[None, :]
                acc0 += s0[:, None] * d0 + (b0 - 128.0 * s0)[:, None] * xs
                acc1 += s1[:, None] * d1 + (b1 - 128.0 * s1)[:, None] * xs
        # Row of y^T: 16 (r // 8) + 8 half + r % 8 of the tile.
        n0 = pid_n * BN + 16 * (r // 8) + r % 8
        y0 = y_ptr + m[None, :] * stride_ym + n0[:, None]
        om0 = m_ok & (n0[:, None] < N)
        om1 = m_ok & (n0[:, None] + 8 < N)
        if SPLIT_K == 1:
            tl.store(y0, acc0.to(dt), mask=om0)
            tl.store(y0 + 8, acc1.to(dt), mask=om1)
        else:
            # Workspace [SPLIT_K, N_TILES, 2, R, BM] fp32 (deterministic order; triton.py).
            ri = r[:, None] * BM + m[None, :]
            ws_tile = ws_ptr + pid_n.to(tl.int64) * (2 * R * BM) + ri
            stride_k = N_TILES * (2 * R * BM)
            tl.store(ws_tile + pid_k * stride_k, acc0)
            tl.store(ws_tile + pid_k * stride_k + R * BM, acc1)
            tl.debug_barrier()  # every thread's partial before the single-thread release
            ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT_K - 1:
                tot0 = tl.zeros([R, BM], dtype=tl.float32)
                tot1 = tl.zeros([R, BM], dtype=tl.float32)
                for sk in range(SPLIT_K):
                    tot0 += tl.load(ws_tile + sk * stride_k, cache_modifier=".cg")
                    tot1 += tl.load(ws_tile + sk * stride_k + R * BM, cache_modifier=".cg")
                tl.store(y0, tot0.to(dt), mask=om0)
                tl.store(y0 + 8, tot1.to(dt), mask=om1)
                tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def dot_split(n_tiles: int, chunks: int, programs: int) -> tuple[int, int]:
    """(K splits, chunks per split) so that about ``programs`` programs run: the N tiles
    alone, else split K (each split at least two chunks)."""
    want = max(1, min(-(-programs // n_tiles), chunks // 2))
    per = -(-chunks // want)
    return -(-chunks // per), per


def quant_matmul_dot(
    x2: torch.Tensor,
    p,
    y: torch.Tensor,
    *,
    deq: bool = True,
    programs_per_sm: int = 2,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """``y [M, N] = x2 [M, K] @ W^T`` for a "mma"-layout :class:`PreparedQuant` ``p`` and M <=
    64 (module doc); y in x2's dtype. ``deq``: the weight dequantized per element (else the
    codes path); ``programs_per_sm``: how many programs the K split aims at per SM."""
    M, K = x2.shape
    if p.layout != "mma" or M > 64 or x2.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError("quant_matmul_dot takes a 4-bit mma-layout weight and <= 64 rows")
    if M == 0:
        return y
    BM = 16 if M <= 16 else 32 if M <= 32 else 64
    n_tiles, chunks = p.words.shape[0], p.words.shape[1]
    split, per = dot_split(n_tiles, chunks, programs_per_sm * sm_count(x2.device))
    ws = (
        torch.empty(split * n_tiles * p.block_n * BM, dtype=torch.float32, device=x2.device)
        if split > 1
        else y
    )
    _dot_kernel[(n_tiles, split)](
        x2,
        p.words,
        p.sb,
        y,
        ws,
        p.counters,
        M,
        p.n,
        K,
        x2.stride(0),
        y.stride(0),
        per,
        chunks,
        n_tiles,
        split,
        BN=p.block_n,
        BM=BM,
        SB_BF16=p.sb_bf16,
        DEQ=deq,
        F32=INTERPRET,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_options(x2.device),
    )
    return y
