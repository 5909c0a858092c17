"""``y = x @ W^T`` straight from MLX affine-quantized weights, for decode-sized batches (GPU).

Contract: :func:`quant_matmul` computes ``x [..., K] @ W^T -> [..., N]`` in x's dtype (bf16 or
fp16) with fp32 accumulation, ``W = scales * q + biases`` an MLX affine weight
(:mod:`headstart.quant`) repacked once by :func:`prepare`; the spec is
:func:`headstart.ops.quant_matmul.reference.quant_matmul`. Measurements (H200 tables, the launch
config sweep, variants tried and removed) are in ``BENCHMARKS.md``, "4-bit matmul design notes
(moved from the kernel's docstring)".

Job: the projections of a decode step multiply a handful of rows (M = 1..16) by a large quantized
weight. That is memory-bound: the time floor is the bytes of packed words + scales + biases over
the memory bandwidth. :func:`quant_matmul` reads each weight byte once per call (per 16 rows of
x, or 32 with ``QmmConfig.mma_rows``) for M <= 64 and keeps the per-weight work to about one
integer instruction, so that the arithmetic hides under the loads. Larger M (prefill) is
compute-bound and goes to cuBLAS, on a dense copy where the weight keeps one, else on the weight
dequantized for the call.

Two layouts, both made once by :func:`prepare`: "mma" for 4-bit weights with groups of 64 or 128
(the checkpoints this server runs; the fast path) and "tiled" for every other format (2/8-bit,
groups of 32).

**MMA layout** (``BN`` rows per tile, 128 by default; ``C = ceil(K / 64)`` chunks of 64 elements,
rounded up to whole chunk pairs with zero codes and zero scale/bias; rows padded to tiles):

* ``words``: int32 ``[Np / BN, C, BN / 16, 32, 4]``. Row ``n = tile*BN + 16 blk + 8 half + g``
  and element ``k = 64 c + 16 t + 4 j + 2 khi + e`` go to word ``j`` of lane ``4 g + t`` of
  block ``blk`` in chunk ``c``, nibble ``half + 2 khi + 4 e``. That is the register layout of the
  A operand of the tensor cores' ``mma.m16n8k16`` (PTX ISA: lane ``4 g + t`` holds rows ``g`` and
  ``g + 8``, columns ``2 t + {0, 1}`` and ``2 t + 8 + {0, 1}``), with the 16 columns of MMA step
  ``j`` mapped to the elements above: each lane loads 16 contiguous bytes per (block, chunk) and
  ``(w >> 4 h) & 0x000F000F | 0x43004300`` (one shift, one LOP3) is already its A register ``h``
  of step ``j``: the bf16 pair ``(128 + q, 128 + q')`` (a nibble in the low mantissa bits of bf16
  128.0 is exactly 128 + q; fp16 x uses fp16 1024.0). A lane's B registers for the chunk are then
  ``x[m, 64 c + 16 t .. + 16]`` for ``m = g``: two 16-byte loads of x.
* ``sb``: int32 ``[Np / BN, C / 2, BN / 16, 8, 4]``: entry ``2 sel + half`` of row group ``g``
  is (scale | bias << 16) of row ``16 blk + 8 half + g`` for chunk ``2 pair + sel`` (bf16 or fp16
  as the checkpoint stores them, fp32 rounded to bf16; groups of 128 repeat per chunk): the four
  entries a lane's C fragment needs for a chunk pair, one 16-byte load.

Kernel (per program: BN rows, a range of chunk pairs; one warp per 16-row block, ``BN / 16 / W``
blocks each). By default (``QmmConfig.dequant_a``, scales in x's dtype) each A register is then
turned into the weight itself, ``fma(OFF + q - OFF, s, b)``: two packed FMAs, ``s q + b`` rounded
once to x's dtype (as a dequantize + matmul rounds it), and four chained MMAs a chunk accumulate
straight into y's fp32 accumulator. Otherwise, per chunk, four chained MMAs give ``D = sum_k (128 +
q) x`` and four more with A = ones give ``E = sum_k x`` (shared by the warp's blocks); then ``acc +=
s D + (b - 128 s) E``, the affine term factored per group (fp32; the codes are exact in bf16, so the
weight is never rounded). About 7/8 integer instructions per weight plus 1/8 of an MMA instruction.
Rows of x beyond M read as zero; x up to 8 rows is one n8 tile, up to 16 two, more run one program
column per 16 rows (two tiles each), or with ``QmmConfig.mma_rows = 32`` one per 32 rows as four n8
tiles (rows 0, 8, 16, 24 of the program's 32) that share every loaded word and scale, with one warp
per 16-row block (``QmmConfig.num_warps`` warps with ``dequant_a``). Every tensor is ``[32 lanes, W
warps, blocks, 4]`` in one Triton blocked layout, so each lane's registers are exactly its
fragments: the MMAs (inline PTX, ``pack=4``) are the only place data crosses lanes, and the loop has
no shared memory, no barrier and no layout conversion. The next chunk pair's words and scales, and
its x, are loaded (16-byte vectors) while this one is multiplied (register double-buffering). With
programmatic dependent launch (``triton_support``) a program loads its first words and scales before
it waits for the kernel before it. The grid is sized to be resident in one wave (``_MMA_REGS``, by
tiling, dequant and x prefetch: by default 97 registers, 4 programs per SM for M <= 8; 129 and 3 for
M <= 16) and K is split until it fills that wave.

Split-K: when the N tiles alone do not fill the GPU, each (M tile, N tile, K split) program
writes an fp32 partial to a workspace and bumps a per-tile counter; the last one to arrive sums
the partials in a fixed order (deterministic) and writes y, then resets the counter to zero. One
launch, no memset, no host sync, launch shape depends only on tensor shapes (CUDA-graph
friendly). A prepared weight must therefore not be used by two concurrently running streams at
once.

**Tiled layout** (the previous kernel, kept for the formats above; ``PW = 32 // bits`` codes per
word, ``S = ceil(K / (PW * G))`` superblocks of ``PW`` groups, tiles of ``BN`` rows, rows padded
to 128): ``words`` int32 ``[Np / BN, S, G, BN]`` with field ``i`` of word ``j`` of superblock
``t`` = element ``t*PW*G + i*G + j``, ``sb`` int32 ``[Np / BN, S, PW, BN]``. Fields are unpacked
into fp32 with a shift, a LOP3 and an FFMA (magic-number exponent), then an FMA per weight (M == 1)
or a bf16 tensor-core dot per group (M > 1).

Non-goals: autograd, bits other than 2/4/8, M > 64 in the fused kernels (falls back), fp32 x
(the MMA layout falls back to dequantize + matmul).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from headstart.ops.triton_support import HAVE_TRITON, INTERPRET, pdl_options, sm_count, tl, triton
from headstart.quant import QuantizedTensor, unpack

# Triton's CPU interpreter cannot run inline PTX; the kernels then use plain-Triton stand-ins
# with the same semantics.
_USE_ASM = not INTERPRET
ROW_PAD = 128  # tiled layout: rows padded to a multiple of the largest BN (no load masks)
MAX_FUSED_M = 64  # above this, dequantize + cuBLAS (compute-bound regime)
_DOT_PF_RESIDENT = 5  # tiled layout: programs per SM of the dot kernel with prefetch (96 registers)
MMA_CHUNK = 64  # MMA layout: K elements per chunk (one scale/bias per row and chunk)
MMA_BLOCK_N = 128  # MMA layout: default rows per tile
_MMA_M_TILES = -(-MAX_FUSED_M // 16)  # MMA layout: split-K counters per n tile (BM >= 16)
# MMA kernel registers per thread by (16-row blocks per warp, n8 tiles, weight dequantized in
# the A registers, x prefetch: 0 none, 1 the next pair, 2 the next chunk), Triton 3.6 for
# sm_90a: how many programs fit on an SM at once. Read from ptxas for a compile without a GPU
# (BN = 128, K a whole number of chunk pairs, PDL on); the GPU runs reported the same counts
# wherever both were read (75, 133, 178, 108, 97, 129, 141, 172, 174 and 80). (4, 4, False, *)
# spill.
_MMA_REGS = {
    (1, 1, False, 0): 48,
    (1, 1, False, 1): 58,
    (1, 1, False, 2): 52,
    (1, 1, True, 0): 60,
    (1, 1, True, 1): 64,
    (1, 1, True, 2): 58,
    (1, 2, False, 0): 79,
    (1, 2, False, 1): 102,
    (1, 2, False, 2): 86,
    (1, 2, True, 0): 60,
    (1, 2, True, 1): 80,
    (1, 2, True, 2): 75,
    (1, 4, False, 0): 108,
    (1, 4, False, 1): 178,
    (1, 4, False, 2): 138,
    (1, 4, True, 0): 80,
    (1, 4, True, 1): 172,
    (1, 4, True, 2): 104,
    (2, 1, False, 0): 70,
    (2, 1, False, 1): 75,
    (2, 1, False, 2): 60,
    (2, 1, True, 0): 88,
    (2, 1, True, 1): 97,
    (2, 1, True, 2): 80,
    (2, 2, False, 0): 134,
    (2, 2, False, 1): 133,
    (2, 2, False, 2): 142,
    (2, 2, True, 0): 102,
    (2, 2, True, 1): 129,
    (2, 2, True, 2): 128,
    (2, 4, False, 0): 141,
    (2, 4, False, 1): 249,
    (2, 4, False, 2): 189,
    (2, 4, True, 0): 141,
    (2, 4, True, 1): 174,
    (2, 4, True, 2): 182,
    (4, 1, False, 0): 136,
    (4, 1, False, 1): 128,
    (4, 1, False, 2): 132,
    (4, 1, True, 0): 168,
    (4, 1, True, 1): 168,
    (4, 1, True, 2): 168,
    (4, 2, False, 0): 246,
    (4, 2, False, 1): 175,
    (4, 2, False, 2): 194,
    (4, 2, True, 0): 168,
    (4, 2, True, 1): 172,
    (4, 2, True, 2): 180,
    (4, 4, False, 0): 255,
    (4, 4, False, 1): 255,
    (4, 4, False, 2): 255,
    (4, 4, True, 0): 244,
    (4, 4, True, 1): 254,
    (4, 4, True, 2): 254,
}


@dataclass
class QmmConfig:
    """Kernel launch knobs (defaults: the best of the H200 sweep in benchmarks/gpu_ops.py).

    The tile height (BN rows) is not here: it is fixed by the layout made by :func:`prepare`."""

    # MMA layout: 32-row programs (``mma_rows``) run BN / 16 warps, one per 16-row block,
    # whatever this says.
    num_warps: int = 4
    # MMA layout: > 1 swaps the register prefetch for Triton's pipeliner (measured 3x slower)
    num_stages: int = 1
    # Split K until about this many programs per SM are in flight; 0: as many as fit at once
    # (MMA layout, from the kernel's register count) or 4 (tiled layout).
    ctas_per_sm: int = 0
    prefetch: bool = True  # register double-buffering of the next K step's words and scales
    # MMA layout: the next K step's x loaded with its words, off the MMAs' critical path (H200
    # sweep: geometric mean 1.88x the floor at M = 1 instead of 2.10, 2.47 at M = 4..16 instead
    # of ~2.9, same 75 registers at M <= 8)
    prefetch_x: bool = True
    use_dot: bool = False  # tiled layout only: M == 1 on the tensor cores too
    # MMA layout: the most rows of x per program (16 or 32). 32: x of 17..32 rows is one
    # program column (four n8 tiles sharing every weight word) instead of two; it needs 181
    # registers, one program per SM, and measured slower on the H200 (BENCHMARKS.md, session
    # 15); with dequant_a (141-182 registers) it measured no faster than two columns on an
    # H100 (session 27), so 16 (columns of 16 rows) is the default.
    mma_rows: int = 16
    # MMA layout: the A registers hold the weight ``s q + b`` rounded to x's dtype (two packed
    # FMAs per register), the MMAs accumulate into y's fp32 accumulator directly: no per-chunk
    # fp32 epilogue and no MMAs of ones for the bias term. Only where the scales are stored in
    # x's dtype; else the codes path runs. H100 sweep (BENCHMARKS.md, session 27): geometric
    # mean over the 27B projections 1.51x the floor at M = 1 instead of 1.56, 1.86 at M = 16
    # instead of 1.94, 2.91 at M = 31 instead of 2.97.
    dequant_a: bool = True
    # MMA layout, with prefetch_x off: each chunk's x is loaded while the chunk before it is
    # multiplied (half the registers of prefetch_x's whole next pair)
    x_chunk_ahead: bool = False
    # MMA layout, x of more than 16 rows (program columns of 16) with prefetch_x: x a chunk
    # ahead instead (x_chunk_ahead), which measured faster at M = 31 on all five 27B
    # projections (H100, BENCHMARKS.md, session 28: 28.7 / 26.0 / 48.7 / 41.3 / 18.7 us
    # against 29.7 / 30.1 / 49.9 / 48.0 / 20.6), while the pair prefetch stays best at M <= 16.
    x_chunk_ahead_wide: bool = True


@dataclass
class PreparedQuant:
    """A quantized weight ``[N, K]`` repacked for :func:`quant_matmul` (layouts: module doc)."""

    words: torch.Tensor  # int32, "mma": [Np/BN, C, BN/16, 32, 4]; "tiled": [Np/BN, S, G, BN]
    sb: torch.Tensor  # int32 (scale | bias << 16), "mma": [Np/BN, C/2, BN/16, 8, 4]
    block_n: int  # BN: output features per program, fixed by the tiling
    n: int
    k: int
    bits: int
    group_size: int
    sb_bf16: bool  # True: scale/bias halves are bf16, False: fp16
    counters: torch.Tensor  # int32 split-K arrival counters, all zero between calls
    config: QmmConfig = field(default_factory=QmmConfig)
    layout: str = "tiled"  # "mma" (4-bit, groups of 64 or 128) or "tiled" (any other format)
    # The weight unpacked once (``prepare(dense=...)``), for prefill-sized x: cuBLAS on it
    # instead of unpacking the whole weight again on every call. None: unpacked per call.
    dense: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    @property
    def superblocks(self) -> int:
        return self.words.shape[1]

    @property
    def padded_n(self) -> int:
        return self.words.shape[0] * self.block_n

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.sb))


def prepare(
    qt: QuantizedTensor,
    config: QmmConfig | None = None,
    block_n: int | None = None,
    rows_per_chunk: int = 2048,
    layout: str = "auto",
    dense: torch.dtype | None = None,
) -> PreparedQuant:
    """Repack an MLX affine weight (on its device) into a kernel layout. Done once at load.

    ``layout``: "mma" (4-bit with groups of 64 or 128; ``block_n`` 64, 128 (default) or 256
    rows per tile), "tiled" (any of 2/4/8 bits; ``block_n`` 16..128, default 32) or "auto" (the
    first that fits). ``rows_per_chunk`` bounds the temporary code buffers. ``dense``: also keep
    the weight unpacked to this dtype (:attr:`PreparedQuant.dense`, for prefill)."""
    if layout == "auto":
        layout = "mma" if qt.bits == 4 and qt.group_size % MMA_CHUNK == 0 else "tiled"
    if layout == "mma":
        p = _prepare_mma(qt, config, block_n or MMA_BLOCK_N, rows_per_chunk)
    elif layout == "tiled":
        p = _prepare_tiled(qt, config, block_n or 32, rows_per_chunk)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    if dense is not None:
        # Meta stand-ins (arena planning) get a meta copy of the right size.
        p.dense = (
            torch.empty(p.n, p.k, dtype=dense, device="meta")
            if p.words.is_meta
            else dequantize_prepared(p, dense)
        )
    return p


def _scale_dtype(qt: QuantizedTensor) -> torch.dtype:
    """The 16-bit float the layouts store scales and biases in: as stored, fp32 as bf16."""
    return qt.scales.dtype if qt.scales.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def _meta_prepared(
    qt: QuantizedTensor,
    config: QmmConfig | None,
    block_n: int,
    layout: str,
    words: tuple[int, ...],
    sb: tuple[int, ...],
    counters: int,
) -> PreparedQuant:
    """A layout's result for a meta stand-in (arena planning): its tensors' shapes and dtypes,
    made without running the repacking on the meta device. Why: there each of its ops goes
    through Python meta functions (tens of ms a 27B weight, seconds a 27B load; BENCHMARKS.md)
    and their first use imports torch's compiler stack."""

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.int32, device="meta")

    N, K = qt.shape
    sb_bf16 = _scale_dtype(qt) == torch.bfloat16
    return PreparedQuant(
        empty(*words),
        empty(*sb),
        block_n,
        N,
        K,
        qt.bits,
        qt.group_size,
        sb_bf16,
        empty(counters),
        config or QmmConfig(),
        layout,
    )


def _scale_bias_words(
    qt: QuantizedTensor, rows: int, cols: int, repeat: int
) -> tuple[torch.Tensor, bool]:
    """int32 ``[rows, cols]``: (scale | bias << 16) as 16-bit floats (bf16 or fp16 as stored;
    fp32 is rounded to bf16), each group repeated ``repeat`` times along K; zero padding."""
    sdt = _scale_dtype(qt)
    N, n_groups = qt.scales.shape
    dev = qt.scales.device
    s = torch.zeros(rows, cols, dtype=sdt, device=dev)
    b = torch.zeros(rows, cols, dtype=sdt, device=dev)
    s[:N, : n_groups * repeat] = qt.scales.to(sdt).repeat_interleave(repeat, dim=1)
    b[:N, : n_groups * repeat] = qt.biases.to(sdt).repeat_interleave(repeat, dim=1)
    lo = s.view(torch.int16).to(torch.int32) & 0xFFFF
    hi = b.view(torch.int16).to(torch.int32) << 16
    return lo | hi, sdt == torch.bfloat16


def _prepare_mma(
    qt: QuantizedTensor, config: QmmConfig | None, block_n: int, rows_per_chunk: int
) -> PreparedQuant:
    bits, G = qt.bits, qt.group_size
    if bits != 4 or G % MMA_CHUNK:
        raise ValueError(f"the mma layout needs 4-bit groups of a multiple of 64, not {bits}/{G}")
    if block_n not in (64, 128, 256):
        raise ValueError(f"block_n must be 64, 128 or 256 for the mma layout, not {block_n}")
    N, K = qt.shape
    if K % G:
        raise ValueError(f"in-features {K} not a multiple of the group size {G}")
    C = K // MMA_CHUNK
    Cp = C + C % 2  # whole chunk pairs (a K step): zero codes and scales pad the last
    Kp = Cp * MMA_CHUNK
    nt = -(-N // block_n)
    Np = nt * block_n
    nb = block_n // 16
    dev = qt.packed.device
    if dev.type == "meta":
        shapes = (nt, Cp, nb, 32, 4), (nt, Cp // 2, nb, 8, 4)
        return _meta_prepared(qt, config, block_n, "mma", *shapes, nt * _MMA_M_TILES)
    words = torch.empty(nt, Cp, nb, 32, 4, dtype=torch.int32, device=dev)
    rows_per_chunk = max(block_n, rows_per_chunk // block_n * block_n)
    for r0 in range(0, Np, rows_per_chunk):
        r1 = min(Np, r0 + rows_per_chunk)
        codes = torch.zeros(r1 - r0, Kp, dtype=torch.int32, device=dev)
        if r0 < N:
            codes[: min(r1, N) - r0, :K] = unpack(qt.packed[r0 : min(r1, N)], bits)
        # Row n = tile*BN + 16 blk + 8 half + g and element k = 64 c + 16 t + 4 j + 2 khi + e
        # go to word j of lane 4 g + t, nibble half + 2 khi + 4 e (module doc).
        c9 = codes.view((r1 - r0) // block_n, nb, 2, 8, Cp, 4, 4, 2, 2)
        c9 = c9.permute(0, 4, 1, 3, 5, 6, 8, 7, 2).reshape(-1, 8)  # [.., (e, khi, half)]
        w = torch.zeros(c9.shape[0], dtype=torch.int64, device=dev)
        for i in range(8):
            w |= c9[:, i].to(torch.int64) << (4 * i)
        w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)  # uint32 bits as int32
        words[r0 // block_n : r1 // block_n] = w.view(-1, Cp, nb, 32, 4)
        del codes, c9, w
    sbw, sb_bf16 = _scale_bias_words(qt, Np, Cp, G // MMA_CHUNK)
    # Row n = tile*BN + 16 blk + 8 half + g, chunk 2 pair + sel -> entry 2 sel + half of the
    # lanes 4 g .. 4 g + 3 of block blk in the pair's tile.
    sb = sbw.view(nt, nb, 2, 8, Cp // 2, 2).permute(0, 4, 1, 3, 5, 2).contiguous()
    sb = sb.view(nt, Cp // 2, nb, 8, 4)
    counters = torch.zeros(nt * _MMA_M_TILES, dtype=torch.int32, device=dev)
    return PreparedQuant(
        words, sb, block_n, N, K, bits, G, sb_bf16, counters, config or QmmConfig(), "mma"
    )


def _prepare_tiled(
    qt: QuantizedTensor, config: QmmConfig | None, block_n: int, rows_per_chunk: int
) -> PreparedQuant:
    if block_n not in (16, 32, 64, 128):
        raise ValueError(f"block_n must be 16, 32, 64 or 128, not {block_n}")
    bits, G = qt.bits, qt.group_size
    if bits not in (2, 4, 8):
        raise ValueError(f"quant_matmul supports 2/4/8-bit weights, not {bits}")
    N, K = qt.shape
    if K % G:
        raise ValueError(f"in-features {K} not a multiple of the group size {G}")
    PW = 32 // bits
    S = -(-K // (PW * G))
    Kp, Np = S * PW * G, -(-N // ROW_PAD) * ROW_PAD
    dev = qt.packed.device
    if dev.type == "meta":
        nt = Np // block_n
        shapes = (nt, S, G, block_n), (nt, S, PW, block_n)
        return _meta_prepared(qt, config, block_n, "tiled", *shapes, nt)
    words = torch.zeros(S * G, Np, dtype=torch.int32, device=dev)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=dev)
    for r0 in range(0, N, rows_per_chunk):
        r1 = min(N, r0 + rows_per_chunk)
        codes = unpack(qt.packed[r0:r1], bits)  # [r, K] int32 in [0, 2**bits)
        if Kp != K:
            codes = torch.nn.functional.pad(codes, (0, Kp - K))
        # [r, S, PW(field i), G(word j)] -> word j gets field i = code of element i*G + j.
        codes = codes.view(r1 - r0, S, PW, G).transpose(2, 3)  # [r, S, G, PW]
        w = (codes << shifts).sum(-1, dtype=torch.int64)  # disjoint fields: sum == OR
        w = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)  # uint32 bits as int32
        words[:, r0:r1] = w.reshape(r1 - r0, S * G).t()
    sbw, sb_bf16 = _scale_bias_words(qt, Np, S * PW, 1)
    sb = sbw.t()  # [S*PW, Np]
    # Tile: every program's [G, BN] word tile (and its scales) is one contiguous block, so a
    # program streams through consecutive memory instead of G rows Np words apart.
    nt = Np // block_n
    words = words.view(S, G, nt, block_n).permute(2, 0, 1, 3).contiguous()
    sb = sb.reshape(S, PW, nt, block_n).permute(2, 0, 1, 3).contiguous()
    # Split-K arrival counters: one per N tile (M <= 64 is always one M tile).
    counters = torch.zeros(nt, dtype=torch.int32, device=dev)
    return PreparedQuant(
        words, sb, block_n, N, K, bits, G, sb_bf16, counters, config or QmmConfig(), "tiled"
    )


if HAVE_TRITON:
    from headstart.ops.triton_support import pdl_wait

    @triton.jit
    def _dequant_field(w, s, b, i: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr):
        """Field ``i`` of each word of a ``[G, BN]`` tile -> ``s*q + b`` in fp32 (s, b: [1, BN])."""
        # Place the field in mantissa bits LO..LO+BITS-1 of an fp32 whose exponent makes the
        # field's lowest bit worth 1: the float is then OFFSET + q exactly, OFFSET = 2**(23-LO).
        # F fields share one shift (the compiler CSEs equal shifts), the last of each group
        # landing at bit 22.
        LO_MIN: tl.constexpr = 12  # keeps OFFSET <= 2**11 so the shifted bias stays precise
        LO_MAX: tl.constexpr = 23 - BITS
        F: tl.constexpr = (LO_MAX - LO_MIN) // BITS + 1
        L0: tl.constexpr = LO_MAX - (F - 1) * BITS
        SH: tl.constexpr = L0 - BITS * F * (i // F)
        LO: tl.constexpr = L0 + BITS * (i % F)
        MASK: tl.constexpr = ((1 << BITS) - 1) << LO
        EXP: tl.constexpr = (150 - LO) << 23  # biased exponent 127 + (23 - LO)
        OFFSET: tl.constexpr = 1 << (23 - LO)
        if SH > 0:
            v = w << SH
        elif SH < 0:
            v = w >> (-SH)  # arithmetic shift: the sign fill is masked off below
        else:
            v = w
        if USE_ASM:
            # (v & MASK) | EXP as one LOP3: left alone, ptxas emits two (one immediate per LOP3).
            bits = tl.inline_asm_elementwise(
                "lop3.b32 $0, $1, $2, $3, 0xEA;",
                "=r,r,r,r",
                [v, tl.full(v.shape, MASK, tl.int32), tl.full(v.shape, EXP, tl.int32)],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
        else:  # Triton's CPU interpreter has no inline asm
            bits = (v & MASK) | EXP
        f = bits.to(tl.float32, bitcast=True)  # == OFFSET + q
        # (OFFSET + q) * s + (b - OFFSET * s) == s * q + b: one FFMA per weight.
        return f * s + (b - s * OFFSET)

    @triton.jit
    def _load_scale_bias(sb_ptrs, SB_BF16: tl.constexpr):
        word = tl.load(sb_ptrs)
        if SB_BF16:  # bf16 -> fp32 is a 16-bit left shift of the bits
            s = (word << 16).to(tl.float32, bitcast=True)
            b = (word & -65536).to(tl.float32, bitcast=True)
        else:
            s = word.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            b = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return s, b

    @triton.jit
    def _qmm_kernel(
        x_ptr,
        w_ptr,
        sb_ptr,
        y_ptr,
        ws_ptr,
        cnt_ptr,
        M,
        N,
        K,
        NP,
        stride_xm,
        stride_ym,
        SB_PER_SPLIT,
        NUM_SB,
        BITS: tl.constexpr,
        G: tl.constexpr,
        BN: tl.constexpr,
        BM: tl.constexpr,
        SPLIT_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        USE_DOT: tl.constexpr,
        SB_BF16: tl.constexpr,
        PREFETCH: tl.constexpr,
        USE_ASM: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_wait(PDL)
        PW: tl.constexpr = 32 // BITS
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        n_offs = pid_n * BN + tl.arange(0, BN)
        j = tl.arange(0, G)
        m_offs = pid_m * BM + tl.arange(0, BM)
        m_mask = m_offs < M
        t0 = pid_k * SB_PER_SPLIT
        t1 = tl.minimum(t0 + SB_PER_SPLIT, NUM_SB)

        # Word tile [G, BN] of superblock t: one contiguous block of the tiled layout (row j =
        # word j, columns = output features).
        nn = tl.arange(0, BN)
        tile0 = (pid_n * NUM_SB + t0).to(tl.int64)
        w_ptrs = w_ptr + tile0 * (G * BN) + (j[:, None] * BN + nn[None, :])
        w_step = G * BN
        # Scales/biases loaded as [1, BN] so that they arrive in the tile's own layout (a 1-D load
        # would be re-laid out through shared memory, with barriers, for every group).
        sb_ptrs = sb_ptr + tile0 * (PW * BN) + nn[None, :]
        x_rows = x_ptr + m_offs.to(tl.int64)[:, None] * stride_xm
        xdt = x_ptr.dtype.element_ty
        if USE_DOT:
            acc = tl.zeros([BM, BN], dtype=tl.float32)
        else:
            acc2 = tl.zeros([G, BN], dtype=tl.float32)
        if PREFETCH:
            # Register double-buffering: the next tile's load is in flight while this one is
            # unpacked (the loop body has no other long-latency dependency).
            w_next = tl.load(w_ptrs, mask=t0 < t1, other=0, eviction_policy="evict_first")
        for t in range(t0, t1):
            if PREFETCH:
                w = w_next
                w_ptrs += w_step
                w_next = tl.load(w_ptrs, mask=t + 1 < t1, other=0, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                w_ptrs += w_step
            k_base = t * (PW * G)
            for i in tl.static_range(PW):
                s, b = _load_scale_bias(sb_ptrs + i * BN, SB_BF16)
                a = _dequant_field(w, s, b, i, BITS, USE_ASM)  # [G, BN] fp32: group t*PW + i
                k_offs = k_base + i * G + j
                if USE_DOT:
                    if EVEN_K:
                        xi = tl.load(x_rows + k_offs[None, :], mask=m_mask[:, None], other=0.0)
                    else:
                        xi = tl.load(
                            x_rows + k_offs[None, :],
                            mask=m_mask[:, None] & (k_offs < K)[None, :],
                            other=0.0,
                        )
                    acc = tl.dot(xi, a.to(xdt), acc)  # [BM, G] @ [G, BN]
                else:  # M == 1 on CUDA cores; reduce over the tile's rows once at the end
                    if EVEN_K:
                        xv = tl.load(x_ptr + k_offs)
                    else:
                        xv = tl.load(x_ptr + k_offs, mask=k_offs < K, other=0.0)
                    acc2 += a * xv.to(tl.float32)[:, None]
            sb_ptrs += PW * BN
        if not USE_DOT:
            acc = tl.expand_dims(tl.sum(acc2, axis=0), 0)  # [1, BN]

        n_mask = n_offs < N
        out_mask = m_mask[:, None] & n_mask[None, :]
        y_ptrs = y_ptr + m_offs.to(tl.int64)[:, None] * stride_ym + n_offs[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            # Workspace [SPLIT_K, M, NP] fp32: every split writes its rows, the last to arrive sums
            # them in split order (deterministic) and resets the tile's counter for the next call.
            ws_tile = ws_ptr + m_offs.to(tl.int64)[:, None] * NP + n_offs[None, :]
            split_stride = M * NP
            tl.store(ws_tile + pid_k * split_stride, acc, mask=out_mask)
            # Every thread's partial store must precede the (single-thread) release below.
            tl.debug_barrier()
            tile = pid_m * tl.num_programs(0) + pid_n
            ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT_K - 1:
                total = tl.zeros([BM, BN], dtype=tl.float32)
                for sk in tl.static_range(SPLIT_K):
                    # .cg: read L2, never a stale L1 line
                    total += tl.load(
                        ws_tile + sk * split_stride, mask=out_mask, other=0.0, cache_modifier=".cg"
                    )
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _dequant_kernel(
        w_ptr,
        sb_ptr,
        out_ptr,
        N,
        K,
        NUM_SB,
        stride_on,
        BITS: tl.constexpr,
        G: tl.constexpr,
        BN: tl.constexpr,
        SB_BF16: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):
        PW: tl.constexpr = 32 // BITS
        pid_n = tl.program_id(0)
        t = tl.program_id(1)
        nn = tl.arange(0, BN)
        n_offs = pid_n * BN + nn
        j = tl.arange(0, G)
        tile = (pid_n * NUM_SB + t).to(tl.int64)
        w = tl.load(w_ptr + tile * (G * BN) + j[:, None] * BN + nn[None, :])
        for i in tl.static_range(PW):
            s, b = _load_scale_bias(sb_ptr + (tile * PW + i) * BN + nn[None, :], SB_BF16)
            a = _dequant_field(w, s, b, i, BITS, USE_ASM)  # [G, BN]
            k_offs = t * (PW * G) + i * G + j
            # Transposed in registers so that the stores run along K (contiguous in out).
            tl.store(
                out_ptr + n_offs.to(tl.int64)[:, None] * stride_on + k_offs[None, :],
                tl.trans(a.to(out_ptr.dtype.element_ty)),
                mask=(n_offs < N)[:, None] & (k_offs < K)[None, :],
            )


if HAVE_TRITON:

    @functools.cache
    def _mma_asm(ones: bool, f16: bool) -> str:
        """PTX: four chained ``m16n8k16`` MMAs (bf16 or fp16 in, fp32 out) from zero: one 64-wide
        chunk of K for one 16-row block.

        Operands (pack = 4, one C fragment per instance): $0..$3 the fp32 result; then the four
        A-register tensors ($4.., $8.., $12.., $16..: element j is step j's register), then the
        pairs of x, x_lo ($20..$23) and x_hi ($24..$27), two per step. ``ones``: A is all ones
        and the only operands are x_lo ($4..$7) and x_hi ($8..$11): every row of the result is
        then the chunk's column sum ``sum_k x[m, k]``."""
        ty = "f16" if f16 else "bf16"
        lines = [
            "{",
            ".reg .f32 d<4>;",
            ".reg .b32 one;",
            f"mov.b32 one, {'0x3C003C00' if f16 else '0x3F803F80'};",
        ]
        lines += [f"mov.f32 d{i}, 0f00000000;" for i in range(4)]
        for j in range(4):
            if ones:
                a, b = "one, one, one, one", f"${4 + 2 * j}, ${5 + 2 * j}"
            else:
                a = f"${4 + j}, ${8 + j}, ${12 + j}, ${16 + j}"
                b = f"${20 + 2 * j}, ${21 + 2 * j}"
            lines.append(
                f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 "
                f"{{d0, d1, d2, d3}}, {{{a}}}, {{{b}}}, {{d0, d1, d2, d3}};"
            )
        lines += [f"mov.f32 ${i}, d{i};" for i in range(4)]
        lines.append("}")
        return "\n".join(lines)

    @functools.cache
    def _scale_asm(sel: int, sb_bf16: bool, x_f16: bool) -> str:
        """PTX: ``acc += s * D + (b - OFF s) * E`` on one C fragment (pack = 4), OFF = 128 (bf16
        x) or 1024 (fp16 x), the offset that the magic-number unpacking adds to every code.

        Operands: $0..$3 the new acc; D $4..$7, E $8..$11, the lane's four packed scale/bias
        words $12..$15 (entry 2*sel: row g of chunk sel, 2*sel + 1: row g + 8), acc $16..$19."""
        lines = ["{", ".reg .f32 s<2>, b<2>, r<4>;", ".reg .b32 u;", ".reg .b16 lo, hi;"]
        for h in range(2):
            src = f"${12 + 2 * sel + h}"
            if sb_bf16:  # bf16 -> fp32 is a 16-bit left shift of the bits
                lines += [
                    f"shl.b32 u, {src}, 16;",
                    f"mov.b32 s{h}, u;",
                    f"and.b32 u, {src}, 0xFFFF0000;",
                    f"mov.b32 b{h}, u;",
                ]
            else:
                lines += [
                    f"mov.b32 {{lo, hi}}, {src};",
                    f"cvt.f32.f16 s{h}, lo;",
                    f"cvt.f32.f16 b{h}, hi;",
                ]
            neg_off = "0fC4800000" if x_f16 else "0fC3000000"  # -1024.0, -128.0
            lines.append(f"fma.rn.f32 b{h}, s{h}, {neg_off}, b{h};")
        for i in range(4):
            h = i // 2  # C elements 0, 1: row g; 2, 3: row g + 8
            lines += [
                f"fma.rn.f32 r{i}, s{h}, ${4 + i}, ${16 + i};",
                f"fma.rn.f32 r{i}, b{h}, ${8 + i}, r{i};",
                f"mov.f32 ${i}, r{i};",
            ]
        lines.append("}")
        return "\n".join(lines)

    @functools.cache
    def _mma_acc_asm(f16: bool) -> str:
        """PTX: four chained ``m16n8k16`` MMAs into the accumulator: one 64-wide chunk of K for
        one 16-row block, from A registers that hold the weight itself (:func:`_deq_asm`).

        Operands (pack = 4): $0..$3 the new acc; the four A-register tensors ($4.., $8..,
        $12.., $16..: element j is step j's register); x_lo ($20..$23), x_hi ($24..$27); the
        acc ($28..$31)."""
        ty = "f16" if f16 else "bf16"
        lines = ["{", ".reg .f32 d<4>;"]
        lines += [f"mov.f32 d{i}, ${28 + i};" for i in range(4)]
        for j in range(4):
            a = f"${4 + j}, ${8 + j}, ${12 + j}, ${16 + j}"
            b = f"${20 + 2 * j}, ${21 + 2 * j}"
            lines.append(
                f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 "
                f"{{d0, d1, d2, d3}}, {{{a}}}, {{{b}}}, {{d0, d1, d2, d3}};"
            )
        lines += [f"mov.f32 ${i}, d{i};" for i in range(4)]
        lines.append("}")
        return "\n".join(lines)

    @functools.cache
    def _deq_asm(sel: int, f16: bool) -> str:
        """PTX: a lane's four words of one (block, chunk) -> its 16 A registers holding the
        weight ``s q + b`` in x's dtype, rounded once (``fma.rn`` of the exact code).

        Operands (pack = 4): $0..$15 the A registers, register h of step j at $(4 h + j);
        the words $16..$19 (word j: step j); the packed scale/bias words $20..$23 (entry
        2 sel + half: row g + 8 half of chunk sel), in x's dtype."""
        ty = "f16x2" if f16 else "bf16x2"
        magic, one, off = (
            ("0x64006400", "0x3C003C00", "0xE400E400")  # fp16 1024.0, 1.0, -1024.0
            if f16
            else ("0x43004300", "0x3F803F80", "0xC300C300")  # bf16 128.0, 1.0, -128.0
        )
        lines = [
            "{",
            ".reg .b32 one, off, s<2>, b<2>, v, c;",
            f"mov.b32 one, {one};",
            f"mov.b32 off, {off};",
        ]
        for half in range(2):  # (s, s) and (b, b) of rows g and g + 8
            src = f"${20 + 2 * sel + half}"
            lines += [
                f"prmt.b32 s{half}, {src}, 0, 0x1010;",
                f"prmt.b32 b{half}, {src}, 0, 0x3232;",
            ]
        for j in range(4):
            for h in range(4):
                w = f"${16 + j}"
                if h:
                    lines.append(f"shr.u32 v, {w}, {4 * h};")
                    w = "v"
                lines += [
                    f"lop3.b32 c, {w}, 0x000F000F, {magic}, 0xEA;",  # OFF + q (exact)
                    f"fma.rn.{ty} c, c, one, off;",  # q (exact)
                    f"fma.rn.{ty} ${4 * h + j}, c, s{h % 2}, b{h % 2};",
                ]
        lines.append("}")
        return "\n".join(lines)

    # ---- CPU-interpreter stand-ins for the three asm blocks above (TRITON_INTERPRET=1): the
    # same lane/register semantics (PTX ISA, mma.m16n8k16 fragments), written with reshapes.

    @triton.jit
    def _halves_f32(v, F16: tl.constexpr = False):
        """int32 holding two bf16 (or fp16) -> (low, high) as fp32."""
        if F16:
            return (
                (v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)),
                (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
            )
        else:
            return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def _emu_b(x_lo, x_hi, W: tl.constexpr, X_F16: tl.constexpr):
        """x pairs [1, W, 32, 4] -> B values [1, W, 8 (n), 4 (t), 4 (step), 2 (khi), 2 (e)]."""
        l0, l1 = _halves_f32(x_lo, X_F16)
        h0, h1 = _halves_f32(x_hi, X_F16)
        lo = tl.reshape(tl.join(l0, l1), [1, W, 32, 2, 2, 2])  # [.., j', khi, e], step j'
        hi = tl.reshape(tl.join(h0, h1), [1, W, 32, 2, 2, 2])  # step 2 + j'
        b = tl.join(lo, hi)  # [.., j', khi, e, jhi]
        b = tl.permute(b, 0, 1, 2, 6, 3, 4, 5)  # [.., jhi, j', khi, e]
        return tl.reshape(b, [1, W, 8, 4, 4, 2, 2])

    @triton.jit
    def _emu_mma(
        a0, a1, a2, a3, x_lo, x_hi, RB: tl.constexpr, W: tl.constexpr, X_F16: tl.constexpr
    ):
        lo0, hi0 = _halves_f32(a0, X_F16)
        lo1, hi1 = _halves_f32(a1, X_F16)
        lo2, hi2 = _halves_f32(a2, X_F16)
        lo3, hi3 = _halves_f32(a3, X_F16)
        # register h = half + 2 khi; its low/high bf16 is e = 0/1
        a = tl.join(
            tl.join(tl.join(lo0, hi0), tl.join(lo1, hi1)),
            tl.join(tl.join(lo2, hi2), tl.join(lo3, hi3)),
        )  # [RB,W,32,4(j),e,half,khi]
        a = tl.reshape(a, [RB, W, 8, 4, 4, 2, 2, 2])  # [rb, w, g, t, j, e, half, khi]
        a = tl.permute(a, 0, 1, 2, 6, 3, 4, 7, 5)  # [rb, w, g, half, t, j, khi, e]
        b = _emu_b(x_lo, x_hi, W, X_F16)  # [1, w, n, t, j, khi, e]
        prod = tl.expand_dims(a, 4) * tl.expand_dims(tl.expand_dims(b, 2), 3)
        d = tl.sum(tl.sum(tl.sum(tl.sum(prod, 8), 7), 6), 5)  # [rb, w, g, half, n]
        d = tl.reshape(d, [RB, W, 8, 2, 4, 2])  # n = 2 t' + e'
        d = tl.permute(d, 0, 1, 2, 4, 3, 5)  # [rb, w, g, t', half, e']
        return tl.reshape(d, [RB, W, 32, 4])

    @triton.jit
    def _emu_ones(x_lo, x_hi, W: tl.constexpr, X_F16: tl.constexpr):
        b = _emu_b(x_lo, x_hi, W, X_F16)
        colsum = tl.sum(tl.sum(tl.sum(tl.sum(b, 6), 5), 4), 3)  # [1, w, n]
        e = tl.reshape(colsum, [1, W, 1, 4, 1, 2])  # [1, w, g, t', half, e']
        e = tl.broadcast_to(e, [1, W, 8, 4, 2, 2])
        return tl.reshape(e, [1, W, 32, 4])

    @triton.jit
    def _emu_scale(
        acc,
        d,
        e,
        sbw,
        SEL: tl.constexpr,
        SB_BF16: tl.constexpr,
        RB: tl.constexpr,
        W: tl.constexpr,
        X_F16: tl.constexpr,
    ):
        half0, half1 = tl.split(tl.reshape(sbw, [RB, W, 32, 2, 2]))  # [.., sel] each
        r0a, r0b = tl.split(half0)
        r1a, r1b = tl.split(half1)
        if SEL == 0:
            w0, w1 = r0a, r1a
        else:
            w0, w1 = r0b, r1b
        s0, b0 = _halves_f32(w0, not SB_BF16)
        s1, b1 = _halves_f32(w1, not SB_BF16)
        s = tl.join(s0, s1)  # [.., half]
        if X_F16:
            b = tl.join(b0, b1) - 1024.0 * s
        else:
            b = tl.join(b0, b1) - 128.0 * s
        s = tl.reshape(tl.join(s, s), [RB, W, 32, 4])  # element 2 half + e'
        b = tl.reshape(tl.join(b, b), [RB, W, 32, 4])
        return acc + s * d + b * e

    @triton.jit
    def _emu_deq(a, sbw, SEL: tl.constexpr, HALF: tl.constexpr, X_F16: tl.constexpr):
        """:func:`_deq_asm` for one A-register tensor ``a`` (codes as OFF + q pairs, [W, RB,
        32, 4] in the stand-ins' order) of rows ``g + 8 HALF``."""
        lo, hi = _halves_f32(a, X_F16)
        half0, half1 = tl.split(tl.reshape(sbw, [a.shape[0], a.shape[1], 32, 2, 2]))
        r0a, r0b = tl.split(half0)
        r1a, r1b = tl.split(half1)
        if SEL == 0:  # entry 2 sel + half: r{half}{a: sel 0, b: sel 1}
            if HALF == 0:
                w = r0a
            else:
                w = r1a
        else:
            if HALF == 0:
                w = r0b
            else:
                w = r1b
        s, b = _halves_f32(w, X_F16)
        s = tl.broadcast_to(tl.expand_dims(s, 3), lo.shape)
        b = tl.broadcast_to(tl.expand_dims(b, 3), lo.shape)
        off = 1024.0 if X_F16 else 128.0
        if X_F16:
            lo = ((lo - off) * s + b).to(tl.float16).to(tl.int16, bitcast=True)
            hi = ((hi - off) * s + b).to(tl.float16).to(tl.int16, bitcast=True)
        else:
            lo = ((lo - off) * s + b).to(tl.bfloat16).to(tl.int16, bitcast=True)
            hi = ((hi - off) * s + b).to(tl.bfloat16).to(tl.int16, bitcast=True)
        return (lo.to(tl.int32) & 0xFFFF) | (hi.to(tl.int32) << 16)

    # ---- the kernel

    @triton.jit
    def _code_pair(w, H: tl.constexpr, X_F16: tl.constexpr, USE_ASM: tl.constexpr):
        """Nibbles H and H + 4 of each word -> the 16-bit float pair (OFF + q_H, OFF + q_{H+4})
        as int32: a nibble in the low mantissa bits of bf16 128.0 (0x4300) or fp16 1024.0
        (0x6400) *is* OFF + q, exactly."""
        if X_F16:
            MAGIC: tl.constexpr = 0x64006400
        else:
            MAGIC: tl.constexpr = 0x43004300
        if H > 0:
            v = w >> (4 * H)  # the sign fill of the arithmetic shift is masked off below
        else:
            v = w
        if USE_ASM:
            # (v & MASK) | MAGIC in one LOP3 (ptxas otherwise splits the two immediates).
            return tl.inline_asm_elementwise(
                "lop3.b32 $0, $1, $2, $3, 0xEA;",
                "=r,r,r,r",
                [v, tl.full(v.shape, 0x000F000F, tl.int32), tl.full(v.shape, MAGIC, tl.int32)],
                dtype=tl.int32,
                is_pure=True,
                pack=1,
            )
        else:
            return (v & 0x000F000F) | MAGIC

    @triton.jit
    def _load_w_pair(
        w_ptr, sb_ptr, tile0, tp, t1, frag, sb_off, CW: tl.constexpr, SBW: tl.constexpr
    ):
        """Words (both chunks) and scales of chunk pair ``tp`` of the tile; zeros past t1."""
        ok = tp < t1
        w_ptrs = w_ptr + (tile0 + tp) * (2 * CW) + frag
        wa = tl.load(w_ptrs, mask=ok, other=0, eviction_policy="evict_first")
        wb = tl.load(w_ptrs + CW, mask=ok, other=0, eviction_policy="evict_first")
        sbw = tl.load(
            sb_ptr + (tile0 + tp) * SBW + sb_off, mask=ok, other=0, eviction_policy="evict_first"
        )
        return wa, wb, sbw

    @triton.jit
    def _load_x(xi_ptr, xo0, xm0, xo1, xm1, xo2, xm2, xo3, xm3, NT: tl.constexpr):
        """A lane's B registers of one chunk, (lo, hi) per n8 tile u < NT (a tile u >= NT gets
        tile 0's, never used). L1/L2 hits: every program of this K range reads the same x."""
        lo0 = tl.load(xi_ptr + xo0, mask=xm0, other=0)
        hi0 = tl.load(xi_ptr + xo0 + 4, mask=xm0, other=0)
        if NT >= 2:
            lo1 = tl.load(xi_ptr + xo1, mask=xm1, other=0)
            hi1 = tl.load(xi_ptr + xo1 + 4, mask=xm1, other=0)
        else:
            lo1 = lo0
            hi1 = hi0
        if NT >= 4:
            lo2 = tl.load(xi_ptr + xo2, mask=xm2, other=0)
            hi2 = tl.load(xi_ptr + xo2 + 4, mask=xm2, other=0)
            lo3 = tl.load(xi_ptr + xo3, mask=xm3, other=0)
            hi3 = tl.load(xi_ptr + xo3 + 4, mask=xm3, other=0)
        else:
            lo2 = lo0
            hi2 = hi0
            lo3 = lo0
            hi3 = hi0
        return lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3

    @triton.jit
    def _load_x_pair(
        xi_ptr,
        tp,
        xo0,
        xm0,
        xo1,
        xm1,
        xo2,
        xm2,
        xo3,
        xm3,
        kp,
        K2,
        NT: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        """:func:`_load_x` for both chunks of pair ``tp`` (x beyond K reads as zero): chunk a's
        (lo, hi) of tiles 0..3, then chunk b's."""
        xk = tp * 64
        if EVEN_K:
            ma0 = xm0
            ma1 = xm1
            ma2 = xm2
            ma3 = xm3
            mb0 = xm0
            mb1 = xm1
            mb2 = xm2
            mb3 = xm3
        else:  # K padded to whole chunk pairs (x_hi is +8 words on, inside the same 16)
            ka = xk + kp
            ma0 = xm0 & (ka < K2)
            ma1 = xm1 & (ka < K2)
            ma2 = xm2 & (ka < K2)
            ma3 = xm3 & (ka < K2)
            mb0 = xm0 & (ka + 32 < K2)
            mb1 = xm1 & (ka + 32 < K2)
            mb2 = xm2 & (ka + 32 < K2)
            mb3 = xm3 & (ka + 32 < K2)
        a0, a1, a2, a3, a4, a5, a6, a7 = _load_x(
            xi_ptr, xo0 + xk, ma0, xo1 + xk, ma1, xo2 + xk, ma2, xo3 + xk, ma3, NT
        )
        b0, b1, b2, b3, b4, b5, b6, b7 = _load_x(
            xi_ptr,
            xo0 + xk + 32,
            mb0,
            xo1 + xk + 32,
            mb1,
            xo2 + xk + 32,
            mb2,
            xo3 + xk + 32,
            mb3,
            NT,
        )
        return a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7

    @triton.jit
    def _load_x_chunk(
        xi_ptr,
        tp,
        SEL: tl.constexpr,
        xo0,
        xm0,
        xo1,
        xm1,
        xo2,
        xm2,
        xo3,
        xm3,
        kp,
        K2,
        NT: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        """:func:`_load_x` for chunk ``SEL`` of pair ``tp`` alone (x beyond K reads as zero)."""
        xk = tp * 64 + 32 * SEL
        if EVEN_K:
            m0 = xm0
            m1 = xm1
            m2 = xm2
            m3 = xm3
        else:
            m0 = xm0 & (xk + kp < K2)
            m1 = xm1 & (xk + kp < K2)
            m2 = xm2 & (xk + kp < K2)
            m3 = xm3 & (xk + kp < K2)
        return _load_x(xi_ptr, xo0 + xk, m0, xo1 + xk, m1, xo2 + xk, m2, xo3 + xk, m3, NT)

    @triton.jit
    def _mma_chunk(
        acc0,
        acc1,
        acc2,
        acc3,
        wq,
        sbw,
        x_lo0,
        x_hi0,
        x_lo1,
        x_hi1,
        x_lo2,
        x_hi2,
        x_lo3,
        x_hi3,
        SEL: tl.constexpr,
        NT: tl.constexpr,
        RB: tl.constexpr,
        W: tl.constexpr,
        SB_BF16: tl.constexpr,
        X_F16: tl.constexpr,
        MMA_Q: tl.constexpr,
        MMA_ONES: tl.constexpr,
        SCALE: tl.constexpr,
        USE_ASM: tl.constexpr,
        DEQ: tl.constexpr = False,
        DEQ_ASM: tl.constexpr = "",
        MMA_ACC: tl.constexpr = "",
    ):
        """One 64-wide chunk of K: acc_u += W_chunk x_u^T (C fragments) for the n8 tiles u < NT,
        all of them from the same unpacked codes and scales (the accumulators of tiles u >= NT
        pass through untouched). ``DEQ``: the A registers hold the weight itself (``s q + b``
        rounded once to x's dtype) and the MMAs accumulate straight into acc; else they hold
        the codes and the affine term is applied per chunk in fp32 (module doc)."""
        if DEQ:
            if USE_ASM:
                a0, a1, a2, a3 = tl.inline_asm_elementwise(
                    DEQ_ASM,
                    "=r," * 16 + "r," * 7 + "r",
                    [wq, sbw],
                    dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                    is_pure=True,
                    pack=4,
                )
            else:
                sb_t = tl.permute(sbw, 2, 1, 0, 3)
                a0 = _emu_deq(
                    tl.permute(_code_pair(wq, 0, X_F16, USE_ASM), 2, 1, 0, 3), sb_t, SEL, 0, X_F16
                )
                a1 = _emu_deq(
                    tl.permute(_code_pair(wq, 1, X_F16, USE_ASM), 2, 1, 0, 3), sb_t, SEL, 1, X_F16
                )
                a2 = _emu_deq(
                    tl.permute(_code_pair(wq, 2, X_F16, USE_ASM), 2, 1, 0, 3), sb_t, SEL, 0, X_F16
                )
                a3 = _emu_deq(
                    tl.permute(_code_pair(wq, 3, X_F16, USE_ASM), 2, 1, 0, 3), sb_t, SEL, 1, X_F16
                )
            for u in tl.static_range(NT):
                if u == 0:
                    x_lo, x_hi, acc = x_lo0, x_hi0, acc0
                elif u == 1:
                    x_lo, x_hi, acc = x_lo1, x_hi1, acc1
                elif u == 2:
                    x_lo, x_hi, acc = x_lo2, x_hi2, acc2
                else:
                    x_lo, x_hi, acc = x_lo3, x_hi3, acc3
                if USE_ASM:
                    acc = tl.inline_asm_elementwise(
                        MMA_ACC,
                        "=f,=f,=f,=f" + ",r" * 24 + ",f" * 4,
                        [a0, a1, a2, a3, x_lo, x_hi, acc],
                        dtype=tl.float32,
                        is_pure=True,
                        pack=4,
                    )
                else:
                    d = _emu_mma(
                        a0,
                        a1,
                        a2,
                        a3,
                        tl.permute(x_lo, 2, 1, 0, 3),
                        tl.permute(x_hi, 2, 1, 0, 3),
                        RB,
                        W,
                        X_F16,
                    )
                    acc = acc + tl.permute(d, 2, 1, 0, 3)
                if u == 0:
                    acc0 = acc
                elif u == 1:
                    acc1 = acc
                elif u == 2:
                    acc2 = acc
                else:
                    acc3 = acc
            return acc0, acc1, acc2, acc3
        a0 = _code_pair(wq, 0, X_F16, USE_ASM)
        a1 = _code_pair(wq, 1, X_F16, USE_ASM)
        a2 = _code_pair(wq, 2, X_F16, USE_ASM)
        a3 = _code_pair(wq, 3, X_F16, USE_ASM)
        for u in tl.static_range(NT):
            if u == 0:
                x_lo, x_hi, acc = x_lo0, x_hi0, acc0
            elif u == 1:
                x_lo, x_hi, acc = x_lo1, x_hi1, acc1
            elif u == 2:
                x_lo, x_hi, acc = x_lo2, x_hi2, acc2
            else:
                x_lo, x_hi, acc = x_lo3, x_hi3, acc3
            if USE_ASM:
                e = tl.inline_asm_elementwise(
                    MMA_ONES,
                    "=f,=f,=f,=f" + ",r" * 8,
                    [x_lo, x_hi],
                    dtype=tl.float32,
                    is_pure=True,
                    pack=4,
                )
                d = tl.inline_asm_elementwise(
                    MMA_Q,
                    "=f,=f,=f,=f" + ",r" * 24,
                    [a0, a1, a2, a3, x_lo, x_hi],
                    dtype=tl.float32,
                    is_pure=True,
                    pack=4,
                )
                acc = tl.inline_asm_elementwise(
                    SCALE,
                    "=f,=f,=f,=f" + ",f" * 8 + ",r" * 4 + ",f" * 4,
                    [d, e, sbw, acc],
                    dtype=tl.float32,
                    is_pure=True,
                    pack=4,
                )
            else:  # the stand-ins index [block, warp, lane, element]
                xl = tl.permute(x_lo, 2, 1, 0, 3)
                xh = tl.permute(x_hi, 2, 1, 0, 3)
                e = _emu_ones(xl, xh, W, X_F16)
                d = _emu_mma(
                    tl.permute(a0, 2, 1, 0, 3),
                    tl.permute(a1, 2, 1, 0, 3),
                    tl.permute(a2, 2, 1, 0, 3),
                    tl.permute(a3, 2, 1, 0, 3),
                    xl,
                    xh,
                    RB,
                    W,
                    X_F16,
                )
                acc = tl.permute(
                    _emu_scale(
                        tl.permute(acc, 2, 1, 0, 3),
                        d,
                        e,
                        tl.permute(sbw, 2, 1, 0, 3),
                        SEL,
                        SB_BF16,
                        RB,
                        W,
                        X_F16,
                    ),
                    2,
                    1,
                    0,
                    3,
                )
            if u == 0:
                acc0 = acc
            elif u == 1:
                acc1 = acc
            elif u == 2:
                acc2 = acc
            else:
                acc3 = acc
        return acc0, acc1, acc2, acc3

    # Shape-only integers are not specialized (one compile serves every weight shape and M);
    # stride_xm is, for its 16-byte divisibility (x loads), and SPLIT_K == 1 drops the reduction.
    @triton.jit(
        do_not_specialize=[
            "M",
            "N",
            "K2",
            "stride_ym",
            "PAIRS_PER_SPLIT",
            "NUM_PAIRS",
            "N_TILES",
            "M_TILES",
        ]
    )
    def _mma_kernel(
        xi_ptr,
        w_ptr,
        sb_ptr,
        y_ptr,
        ws_ptr,
        cnt_ptr,
        M,
        N,
        K2,
        stride_xm,
        stride_ym,
        PAIRS_PER_SPLIT,
        NUM_PAIRS,
        N_TILES,
        M_TILES,
        SPLIT_K,
        BN: tl.constexpr,
        W: tl.constexpr,
        NT: tl.constexpr,
        EVEN_K: tl.constexpr,
        SB_BF16: tl.constexpr,
        X_F16: tl.constexpr,
        PREFETCH: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        MMA_Q: tl.constexpr,
        MMA_ONES: tl.constexpr,
        SCALE_0: tl.constexpr,
        SCALE_1: tl.constexpr,
        USE_ASM: tl.constexpr,
        PREFETCH_X: tl.constexpr = 0,
        PDL: tl.constexpr = False,
        DEQ: tl.constexpr = False,
        DEQ_0: tl.constexpr = "",
        DEQ_1: tl.constexpr = "",
        MMA_ACC: tl.constexpr = "",
    ):
        """Program (m tile, n tile, K split): rows [pid_n*BN, +BN) of y for the K chunk pairs
        [pid_k*PAIRS_PER_SPLIT, +PAIRS_PER_SPLIT). Warp w owns 16-row blocks w, w + W, ...;
        every tensor is [32 lanes, W, RB, 4] so that each lane's registers are its MMA fragments
        and no data ever crosses lanes outside the MMAs (layout: module doc)."""
        RB: tl.constexpr = BN // (16 * W)  # 16-row blocks per warp
        CW: tl.constexpr = BN * 8  # int32 words of one (tile, chunk)
        SBW: tl.constexpr = BN * 2  # scale/bias words of one (tile, chunk pair)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        # Dimension order [lane, warp, block, element]: Triton orders the dimensions that tie on
        # contiguity by index, so this is what puts 32 lanes then the W warps on the first two.
        ln = tl.arange(0, 32)[:, None, None, None]
        wi = tl.arange(0, W)[None, :, None, None]
        rb = tl.arange(0, RB)[None, None, :, None]
        p = tl.arange(0, 4)[None, None, None, :]
        blk = rb * W + wi  # 16-row block of the tile
        frag = blk * 128 + ln * 4 + p  # [32, W, RB, 4]: a lane's 16 bytes, lanes contiguous
        sb_off = (blk * 8 + ln // 4) * 4 + p  # the 4 lanes of a row group share their words
        g = ln // 4
        t = ln % 4
        # x as int32 pairs: lane (g, t) of n8 tile u reads row m = BM pid_m + 8 u + g (BM = 8 NT
        # rows of x per program), elements 64 c + 16 t + [0, 8) (x_lo) and + [8, 16) (x_hi) of
        # chunk c. Tiles u >= NT are never loaded (their offsets and masks go unused).
        BM: tl.constexpr = 8 * NT
        kp = t * 8 + p + wi * 0  # [32, W, 1, 4]
        m0 = pid_m * BM + g + wi * 0
        xo0 = m0 * stride_xm + kp
        xm0 = m0 < M
        m1 = m0 + 8
        xo1 = m1 * stride_xm + kp
        xm1 = m1 < M
        m2 = m0 + 16
        xo2 = m2 * stride_xm + kp
        xm2 = m2 < M
        m3 = m0 + 24
        xo3 = m3 * stride_xm + kp
        xm3 = m3 < M

        t0 = pid_k * PAIRS_PER_SPLIT
        t1 = tl.minimum(t0 + PAIRS_PER_SPLIT, NUM_PAIRS)
        # Pointers are recomputed from the step index (not carried through the loop) so that the
        # compiler still sees 4 contiguous, 16-byte aligned words per lane: 16-byte loads.
        tile0 = pid_n.to(tl.int64) * NUM_PAIRS
        # One accumulator per n8 tile; those of tiles u >= NT stay zero and are never stored.
        acc0 = tl.zeros([32, W, RB, 4], dtype=tl.float32)
        acc1 = tl.zeros([32, W, RB, 4], dtype=tl.float32)
        acc2 = tl.zeros([32, W, RB, 4], dtype=tl.float32)
        acc3 = tl.zeros([32, W, RB, 4], dtype=tl.float32)
        if PREFETCH:
            # Register prefetch: the next chunk pair's words and scales are in flight while this
            # one is multiplied.
            na, nb, ns = _load_w_pair(w_ptr, sb_ptr, tile0, t0, t1, frag, sb_off, CW, SBW)
        # Weights are never written during a step: only x (and the outputs) wait for the
        # kernel before this one.
        pdl_wait(PDL)
        if PREFETCH_X == 1:
            xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7, xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7 = (
                _load_x_pair(xi_ptr, t0, xo0, xm0, xo1, xm1, xo2, xm2, xo3, xm3, kp, K2, NT, EVEN_K)
            )
        elif PREFETCH_X == 2:
            xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7 = _load_x_chunk(
                xi_ptr, t0, 0, xo0, xm0, xo1, xm1, xo2, xm2, xo3, xm3, kp, K2, NT, EVEN_K
            )
        for tp in tl.range(t0, t1, num_stages=NUM_STAGES):
            if PREFETCH:
                wa = na
                wb = nb
                sbw = ns
                na, nb, ns = _load_w_pair(w_ptr, sb_ptr, tile0, tp + 1, t1, frag, sb_off, CW, SBW)
            else:
                w_ptrs = w_ptr + (tile0 + tp) * (2 * CW) + frag
                wa = tl.load(w_ptrs, eviction_policy="evict_first")
                wb = tl.load(w_ptrs + CW, eviction_policy="evict_first")
                sbw = tl.load(sb_ptr + (tile0 + tp) * SBW + sb_off, eviction_policy="evict_first")
            if PREFETCH_X == 1:  # this pair's x came with the previous step; ask for the next's
                ca0, ca1, ca2, ca3, ca4, ca5, ca6, ca7 = xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7
                cb0, cb1, cb2, cb3, cb4, cb5, cb6, cb7 = xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7
                more = tp + 1 < t1
                xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7, xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7 = (
                    _load_x_pair(
                        xi_ptr,
                        tp + 1,
                        xo0,
                        xm0 & more,
                        xo1,
                        xm1 & more,
                        xo2,
                        xm2 & more,
                        xo3,
                        xm3 & more,
                        kp,
                        K2,
                        NT,
                        EVEN_K,
                    )
                )
            elif PREFETCH_X == 2:  # chunk a's x came with the previous chunk; ask for b's
                ca0, ca1, ca2, ca3, ca4, ca5, ca6, ca7 = xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7
                cb0, cb1, cb2, cb3, cb4, cb5, cb6, cb7 = _load_x_chunk(
                    xi_ptr, tp, 1, xo0, xm0, xo1, xm1, xo2, xm2, xo3, xm3, kp, K2, NT, EVEN_K
                )
            else:
                ca0, ca1, ca2, ca3, ca4, ca5, ca6, ca7, cb0, cb1, cb2, cb3, cb4, cb5, cb6, cb7 = (
                    _load_x_pair(
                        xi_ptr, tp, xo0, xm0, xo1, xm1, xo2, xm2, xo3, xm3, kp, K2, NT, EVEN_K
                    )
                )
            acc0, acc1, acc2, acc3 = _mma_chunk(
                acc0,
                acc1,
                acc2,
                acc3,
                wa,
                sbw,
                ca0,
                ca1,
                ca2,
                ca3,
                ca4,
                ca5,
                ca6,
                ca7,
                0,
                NT,
                RB,
                W,
                SB_BF16,
                X_F16,
                MMA_Q,
                MMA_ONES,
                SCALE_0,
                USE_ASM,
                DEQ,
                DEQ_0,
                MMA_ACC,
            )
            if PREFETCH_X == 2:  # the next pair's chunk a, while chunk b is multiplied
                more = tp + 1 < t1
                xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7 = _load_x_chunk(
                    xi_ptr,
                    tp + 1,
                    0,
                    xo0,
                    xm0 & more,
                    xo1,
                    xm1 & more,
                    xo2,
                    xm2 & more,
                    xo3,
                    xm3 & more,
                    kp,
                    K2,
                    NT,
                    EVEN_K,
                )
            acc0, acc1, acc2, acc3 = _mma_chunk(
                acc0,
                acc1,
                acc2,
                acc3,
                wb,
                sbw,
                cb0,
                cb1,
                cb2,
                cb3,
                cb4,
                cb5,
                cb6,
                cb7,
                1,
                NT,
                RB,
                W,
                SB_BF16,
                X_F16,
                MMA_Q,
                MMA_ONES,
                SCALE_1,
                USE_ASM,
                DEQ,
                DEQ_1,
                MMA_ACC,
            )

        # C fragment element p of lane (g, t): row 16 blk + g + 8 (p // 2), column 2 t + p % 2
        # of n8 tile u, i.e. row BM pid_m + 8 u + 2 t + p % 2 of x and y.
        n_idx = pid_n * BN + blk * 16 + g + 8 * (p // 2)
        col = pid_m * BM + 2 * t + p % 2
        nm = n_idx < N
        om0 = nm & (col < M)
        om1 = nm & (col + 8 < M)
        om2 = nm & (col + 16 < M)
        om3 = nm & (col + 24 < M)
        y0 = y_ptr + col * stride_ym + n_idx
        y1 = y0 + 8 * stride_ym
        y2 = y0 + 16 * stride_ym
        y3 = y0 + 24 * stride_ym
        if SPLIT_K == 1:
            tl.store(y0, acc0.to(y_ptr.dtype.element_ty), mask=om0)
            if NT >= 2:
                tl.store(y1, acc1.to(y_ptr.dtype.element_ty), mask=om1)
            if NT >= 4:
                tl.store(y2, acc2.to(y_ptr.dtype.element_ty), mask=om2)
                tl.store(y3, acc3.to(y_ptr.dtype.element_ty), mask=om3)
        else:
            # Workspace [SPLIT_K, M_TILES, N_TILES, NT, fragments] fp32 (only the valid entries
            # are written): every split writes its partial, the last to arrive sums them in
            # split order (deterministic) and resets the tile's counter for the next call.
            PART: tl.constexpr = NT * CW
            stride_k = M_TILES * N_TILES * PART
            ws_tile = ws_ptr + (pid_m * N_TILES + pid_n).to(tl.int64) * PART + frag
            ws_part = ws_tile + pid_k * stride_k
            tl.store(ws_part, acc0, mask=om0)
            if NT >= 2:
                tl.store(ws_part + CW, acc1, mask=om1)
            if NT >= 4:
                tl.store(ws_part + 2 * CW, acc2, mask=om2)
                tl.store(ws_part + 3 * CW, acc3, mask=om3)
            # Every thread's partial store must precede the (single-thread) release below.
            tl.debug_barrier()
            tile = pid_m * N_TILES + pid_n
            ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT_K - 1:
                tot0 = tl.zeros([32, W, RB, 4], dtype=tl.float32)
                tot1 = tl.zeros([32, W, RB, 4], dtype=tl.float32)
                tot2 = tl.zeros([32, W, RB, 4], dtype=tl.float32)
                tot3 = tl.zeros([32, W, RB, 4], dtype=tl.float32)
                for sk in range(SPLIT_K):
                    # .cg: read L2, never a stale L1 line
                    ws_sk = ws_tile + sk * stride_k
                    tot0 += tl.load(ws_sk, mask=om0, other=0.0, cache_modifier=".cg")
                    if NT >= 2:
                        tot1 += tl.load(ws_sk + CW, mask=om1, other=0.0, cache_modifier=".cg")
                    if NT >= 4:
                        tot2 += tl.load(ws_sk + 2 * CW, mask=om2, other=0.0, cache_modifier=".cg")
                        tot3 += tl.load(ws_sk + 3 * CW, mask=om3, other=0.0, cache_modifier=".cg")
                tl.store(y0, tot0.to(y_ptr.dtype.element_ty), mask=om0)
                if NT >= 2:
                    tl.store(y1, tot1.to(y_ptr.dtype.element_ty), mask=om1)
                if NT >= 4:
                    tl.store(y2, tot2.to(y_ptr.dtype.element_ty), mask=om2)
                    tl.store(y3, tot3.to(y_ptr.dtype.element_ty), mask=om3)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _mma_dequant_kernel(
        w_ptr, sb_ptr, out_ptr, N, K, NUM_PAIRS, stride_on, BN: tl.constexpr, SB_BF16: tl.constexpr
    ):
        """One (tile, chunk) of the MMA layout -> ``[BN, 64]`` of the weight, straight from the
        layout's index map (gathers; the weight is written once, along K)."""
        pid_n = tl.program_id(0)
        c = tl.program_id(1)
        rows = tl.arange(0, BN)[:, None]
        kk = tl.arange(0, 64)[None, :]
        blk = rows // 16
        g = rows % 8
        half = (rows % 16) // 8
        word = (blk * 32 + g * 4 + kk // 16) * 4 + (kk % 16) // 4
        nib = half + 2 * ((kk % 4) // 2) + 4 * (kk % 2)
        tile = pid_n.to(tl.int64) * NUM_PAIRS * 2 + c
        w = tl.load(w_ptr + tile * (BN * 8) + word)
        q = ((w >> (4 * nib)) & 15).to(tl.float32)
        sbw = tl.load(
            sb_ptr
            + (pid_n.to(tl.int64) * NUM_PAIRS + c // 2) * (BN * 2)
            + (blk * 8 + g) * 4
            + 2 * (c % 2)
            + half
        )
        s, b = _halves_f32(sbw, not SB_BF16)
        n_offs = pid_n * BN + rows
        k_offs = c * 64 + kk
        tl.store(
            out_ptr + n_offs.to(tl.int64) * stride_on + k_offs,
            (q * s + b).to(out_ptr.dtype.element_ty),
            mask=(n_offs < N) & (k_offs < K),
        )


def dequantize_prepared(p: PreparedQuant, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight ``[N, K]`` in ``dtype`` (GPU), from the repacked layout."""
    out = torch.empty(p.n, p.k, dtype=dtype, device=p.words.device)
    BN = p.block_n
    if p.layout == "mma":
        grid = (p.words.shape[0], triton.cdiv(p.k, MMA_CHUNK))
        _mma_dequant_kernel[grid](
            p.words,
            p.sb,
            out,
            p.n,
            p.k,
            p.sb.shape[1],
            out.stride(0),
            BN=BN,
            SB_BF16=p.sb_bf16,
            num_warps=4,
        )
        return out
    grid = (triton.cdiv(p.n, BN), p.superblocks)
    _dequant_kernel[grid](
        p.words,
        p.sb,
        out,
        p.n,
        p.k,
        p.superblocks,
        out.stride(0),
        BITS=p.bits,
        G=p.group_size,
        BN=BN,
        SB_BF16=p.sb_bf16,
        USE_ASM=_USE_ASM,
        num_warps=4,
    )
    return out


def split_for(
    p: PreparedQuant, m: int, config: QmmConfig | None = None, x_f16: bool = False
) -> tuple[int, int, int]:
    """(BLOCK_M, SPLIT_K, K steps per split) for ``m`` rows of x (fp16 when ``x_f16``, else
    bf16): shapes only, never values.

    A K step is a superblock (tiled layout) or a pair of 64-wide chunks (MMA layout)."""
    cfg = config or p.config
    n_tiles = p.words.shape[0]
    if p.layout == "mma":
        if cfg.mma_rows not in (16, 32):
            raise ValueError(f"mma_rows must be 16 or 32, not {cfg.mma_rows}")
        BM = 8 if m <= 8 else (16 if m <= 16 else cfg.mma_rows)
        steps = p.sb.shape[1]
        # As many K splits as keep the whole grid resident at once (one wave): no tail wave,
        # and the split-K partials stay few.
        resident = cfg.ctas_per_sm or _mma_resident(p, cfg, BM // 8, _x_prefetch(cfg, m), x_f16)
        cap = sm_count(p.words.device) * resident
        split = max(1, min(steps, cap // (n_tiles * -(-m // BM))))
    else:
        BM = 16 if m <= 16 else (32 if m <= 32 else 64)
        steps = p.superblocks
        target = sm_count(p.words.device) * (cfg.ctas_per_sm or 4)
        split = max(1, min(steps, -(-target // (n_tiles * -(-m // BM)))))
    per = -(-steps // split)
    return BM, -(-steps // per), per


def _mma_resident(
    p: PreparedQuant, cfg: QmmConfig, nt: int, prefetch_x: int, x_f16: bool = False
) -> int:
    """Programs of the MMA kernel with ``nt`` n8 tiles and x prefetch ``prefetch_x``
    (:func:`_x_prefetch`) that fit on one SM at once (64K registers, 2048 threads)."""
    w = _mma_warps(p, cfg, nt, x_f16)
    key = (p.block_n // (16 * w), nt, _dequant_a(p, cfg, x_f16), prefetch_x)
    regs = -(-_MMA_REGS.get(key, 128) // 8) * 8
    return max(1, min(65536 // (regs * 32 * w), 2048 // (32 * w), 32))


def _x_prefetch(cfg: QmmConfig, m: int) -> int:
    """The MMA kernel's ``PREFETCH_X`` for ``m`` rows of x: 1 the next pair's x, 2 the next
    chunk's (also in place of 1 above 16 rows, ``x_chunk_ahead_wide``), 0 none."""
    if cfg.prefetch_x:
        return 2 if m > 16 and cfg.x_chunk_ahead_wide else 1
    return 2 if cfg.x_chunk_ahead else 0


def _dequant_a(p: PreparedQuant, cfg: QmmConfig, x_f16: bool = False) -> bool:
    """Whether the MMA kernel dequantizes into its A registers (only with scales in x's dtype)."""
    return cfg.dequant_a and p.sb_bf16 != x_f16


def _mma_warps(p: PreparedQuant, cfg: QmmConfig, nt: int, x_f16: bool = False) -> int:
    """Warps per program of the MMA kernel with ``nt`` n8 tiles: one per 16-row block for four
    tiles on the codes path (their D and E fragments and x take twice the registers of two),
    else cfg.num_warps capped so that each owns >= 1 block."""
    if nt >= 4 and not _dequant_a(p, cfg, x_f16):
        return p.block_n // 16
    w = cfg.num_warps
    while w > 1 and (p.block_n // 16) % w:
        w //= 2
    return max(1, w)


def quant_matmul(
    x: torch.Tensor, p: PreparedQuant, config: QmmConfig | None = None
) -> torch.Tensor:
    """``x [..., K] @ W^T -> [..., N]`` in x's dtype (bf16 or fp16), fp32 accumulation.

    Rows <= 64: one fused Triton launch reading the packed weight once (per 16 rows of x). More
    rows: cuBLAS on the dense copy when the weight has one in x's dtype, else dequantize to x's
    dtype (a Triton pass) and cuBLAS."""
    cfg = config or p.config
    lead = x.shape[:-1]
    if x.shape[-1] != p.k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {p.k}")
    x2 = x.reshape(-1, p.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M > MAX_FUSED_M or (p.layout == "mma" and x.dtype not in (torch.bfloat16, torch.float16)):
        w = p.dense if p.dense is not None and p.dense.dtype == x.dtype else None
        return (x2 @ (w if w is not None else dequantize_prepared(p, x.dtype)).T).reshape(
            *lead, p.n
        )
    y = torch.empty(M, p.n, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, p.n)
    if p.layout == "mma":
        return _quant_matmul_mma(x2, p, cfg, y).reshape(*lead, p.n)
    use_dot = cfg.use_dot or M > 1
    BM, split, per = split_for(p, M, cfg)
    if not use_dot:
        BM = 1
    NP = p.padded_n
    n_tiles = p.words.shape[0]
    m_tiles = -(-M // BM)
    ws = (
        torch.empty(split, M, NP, dtype=torch.float32, device=x.device) if split > 1 else y
    )  # unused when split == 1
    prefetch = cfg.prefetch
    if (
        use_dot
        and prefetch
        and p.block_n == 32
        and cfg.num_warps == 4
        and BM == 16
        and n_tiles * split * m_tiles > _DOT_PF_RESIDENT * sm_count(x.device)
    ):
        # The prefetching dot variant holds more registers (96 vs 76 per thread on H200 / Triton
        # 3.6): 5 programs per SM instead of 6. When that alone would push the grid into a
        # second wave (q_proj 12288x5120: 768 programs), the lighter variant runs in one:
        # measured 40 us instead of 57 at M = 4 and 16.
        prefetch = False
    _qmm_kernel[(n_tiles, split, m_tiles)](
        x2,
        p.words,
        p.sb,
        y,
        ws,
        p.counters,
        M,
        p.n,
        p.k,
        NP,
        x2.stride(0),
        y.stride(0),
        per,
        p.superblocks,
        BITS=p.bits,
        G=p.group_size,
        BN=p.block_n,
        BM=BM,
        SPLIT_K=split,
        EVEN_K=p.superblocks * p.per_word * p.group_size == p.k,
        USE_DOT=use_dot,
        SB_BF16=p.sb_bf16,
        PREFETCH=prefetch,
        USE_ASM=_USE_ASM,
        # More rows per program: 4 warps would spill (acc and x tiles grow with BLOCK_M).
        num_warps=cfg.num_warps if BM <= 16 else max(8, cfg.num_warps),
        num_stages=cfg.num_stages,
        **pdl_options(x.device),
    )
    return y.reshape(*lead, p.n)


def _quant_matmul_mma(
    x2: torch.Tensor, p: PreparedQuant, cfg: QmmConfig, y: torch.Tensor
) -> torch.Tensor:
    M = x2.shape[0]
    x_f16 = x2.dtype == torch.float16
    if x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()  # x is read as 16-byte vectors of int32 pairs
    xi = x2.view(torch.int32)  # [M, K / 2]: bf16 pairs
    BM, split, per = split_for(p, M, cfg, x_f16)
    n_tiles = p.words.shape[0]
    m_tiles = -(-M // BM)
    NT = BM // 8
    W = _mma_warps(p, cfg, NT, x_f16)
    ws = (
        torch.empty(
            split * m_tiles * n_tiles * NT * p.block_n * 8, dtype=torch.float32, device=x2.device
        )
        if split > 1
        else y
    )  # unused when split == 1
    _mma_kernel[(m_tiles, n_tiles, split)](
        xi,
        p.words,
        p.sb,
        y,
        ws,
        p.counters,
        M,
        p.n,
        p.k // 2,
        xi.stride(0),
        y.stride(0),
        per,
        p.sb.shape[1],
        n_tiles,
        m_tiles,
        split,
        BN=p.block_n,
        W=W,
        NT=NT,
        EVEN_K=p.sb.shape[1] * 2 * MMA_CHUNK == p.k,
        SB_BF16=p.sb_bf16,
        X_F16=x_f16,
        PREFETCH=cfg.prefetch and cfg.num_stages <= 1,
        NUM_STAGES=max(1, cfg.num_stages),
        MMA_Q=_mma_asm(False, x_f16),
        MMA_ONES=_mma_asm(True, x_f16),
        SCALE_0=_scale_asm(0, p.sb_bf16, x_f16),
        SCALE_1=_scale_asm(1, p.sb_bf16, x_f16),
        USE_ASM=_USE_ASM,
        PREFETCH_X=_x_prefetch(cfg, M),
        DEQ=_dequant_a(p, cfg, x_f16),
        DEQ_0=_deq_asm(0, x_f16),
        DEQ_1=_deq_asm(1, x_f16),
        MMA_ACC=_mma_acc_asm(x_f16),
        num_warps=W,
        num_stages=1,
        **pdl_options(x2.device),
    )
    return y
