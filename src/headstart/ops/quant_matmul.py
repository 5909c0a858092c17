"""``y = x @ W^T`` straight from MLX affine-quantized weights, for decode-sized batches (GPU).

Job: the projections of a decode step multiply a handful of rows (M = 1..16) by a large quantized
weight. That is memory-bound: the time floor is the bytes of packed words + scales + biases over
the memory bandwidth. :func:`quant_matmul` reads each weight byte exactly once per call for
M <= 64 (all rows of x ride along in the same program) and unpacks with a few integer/fp32
instructions per weight so that the arithmetic hides under the loads. Larger M (prefill) is
compute-bound and goes to dequantize + cuBLAS.

Repacked layout (made once by :func:`prepare`; ``PW = 32 // bits`` codes per int32 word, ``G`` the
group size, ``S = ceil(K / (PW * G))`` "superblocks" of ``PW`` consecutive groups, ``BN`` the tile
width (32 by default), rows padded to ``Np`` = a multiple of 128, K padded to ``S * PW * G`` with
zero codes and zero scale/bias so that padding contributes nothing):

* ``words``: int32 ``[Np / BN, S, G, BN]``. Entry ``[n // BN, t, j, n % BN]`` is word ``j`` of
  superblock ``t`` of row ``n``; its field ``i`` (bits ``bits*i ..``) holds the code of element
  ``k = t*PW*G + i*G + j``. So field ``i`` of the ``[G, BN]`` tile ``[n // BN, t]`` is exactly group
  ``t*PW + i`` of ``BN`` rows, with one scale/bias per row, and the matching ``x`` slice is ``G``
  contiguous elements. (MLX keeps field ``i`` of word ``j`` at element ``8*j + i``, which would
  force a reshape/interleave in registers.) Each tile is one contiguous block (8 KB for 4-bit,
  G 64, BN 32): a program streams through consecutive memory. (A K-major ``[S*G, Np]`` layout
  measured within 10% of this one: DRAM locality is not what limits the kernel today.)
* ``sb``: int32 ``[Np / BN, S, PW, BN]``: for group ``t*PW + i`` of row ``n``, the 16-bit scale in
  the low half and the 16-bit bias in the high half (bf16 or fp16, as the checkpoint stores them;
  fp32 scales are rounded to bf16); the ``[BN]`` entries of one group are contiguous.

Unpacking without int->float conversions: a field shifted into mantissa bits ``lo..lo+bits-1`` and
OR-ed with the exponent of ``2**(23-lo)`` *is* the float ``2**(23-lo) + q``; one FFMA with the
pre-shifted bias ``b - 2**(23-lo) * s`` then gives ``s*q + b`` (the offset is at most 256 for 4-bit,
so rounding the shifted bias costs ~2**-16 relative: invisible after bf16). Fields are placed
two at a time per shift (4-bit), so a weight costs about 0.5 SHF + 1 LOP3 + 1 FFMA. Then:

* M == 1 (default): an FMA per weight into a ``[G, BN]`` fp32 accumulator on the CUDA cores,
  reduced over G once at the end (no shared memory, no barriers);
* M > 1: a 0.5 CVT to bf16 and the tensor-core dot ``x_rows [16, G] @ W_group^T [G, BN]`` per
  group (M padded to 16, masked rows are free; the weight is rounded to x's dtype for the tensor
  cores, as a dequantize-then-matmul would do).

Measured on the H200 (benchmarks/gpu_ops.py, CUDA-graph replay, cold L2; floor = weight bytes over
the 4.25 TB/s copy bandwidth): 3.6-4.8x the floor at M = 1 and 4.7-5.7x at M = 4..16 for the 27B
projections (e.g. q_proj 12288x5120: 30 us at M = 1, ~40 us at M = 16, floor 8.3 us). That beats
torch's int4 tinygemm at M = 16 (1.8-2.1x) and its dequantize + matmul by 15-40x, but loses to the
tinygemm at M = 1 (1.4-1.7x) and M = 4 (1.1-1.5x), and only matches bf16 cuBLAS reading 4x the
bytes. The kernel is latency-bound, not bandwidth- or issue-bound: a program spends ~6 us per
superblock because each group's small loads (x slice, scales) and, on the dot path, its shared-
memory staging and barriers sit on the critical path, and only 5-7 programs fit per SM. The next
step is to issue all of a superblock's x and scale loads up front (or double-buffer them with the
words), e.g. one ``[PW, G]`` x load and a ``[PW, G, BN]`` formulation with a per-field rotate
(``shf.l.wrap``) so that nothing is loaded per group.

Split-K: when the N tiles alone do not fill the GPU, each (N tile, K split) program writes an fp32
partial to a workspace and bumps a per-tile counter; the last one to arrive sums the partials in a
fixed order (deterministic) and writes y, then resets the counter to zero. One launch, no memset,
no host sync, launch shape depends only on tensor shapes (CUDA-graph friendly). A prepared weight
must therefore not be used by two concurrently running streams at once.

Non-goals: autograd, bits other than 2/4/8, M > 64 in the fused kernel (falls back), fp32 x.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from headstart.quant import QuantizedTensor, unpack

from headstart.ops.triton_support import HAVE_TRITON, sm_count, tl, triton

# Triton's CPU interpreter (TRITON_INTERPRET=1, used to check the kernels without a GPU) cannot run
# inline PTX; the kernels then use the plain-Triton spelling of the same bit operation.
_USE_ASM = os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True")
ROW_PAD = 128  # rows padded to a multiple of the largest BN, so weight loads need no mask
MAX_FUSED_M = 64  # above this, dequantize + cuBLAS (compute-bound regime)
_DOT_PF_RESIDENT = 5  # programs per SM of the default dot kernel with prefetch (96 registers)


@dataclass
class QmmConfig:
    """Kernel launch knobs (defaults: the best of the H200 sweep in benchmarks/gpu_ops.py).

    BLOCK_N is not here: it is fixed by the tiled layout made by :func:`prepare`."""

    num_warps: int = 4
    num_stages: int = 1
    ctas_per_sm: int = 4  # split K until about this many programs per SM are in flight
    prefetch: bool = True  # register double-buffering of the word tile
    use_dot: bool = False  # M == 1 on CUDA cores (measured faster); M > 1 always uses the dot


@dataclass
class PreparedQuant:
    """A quantized weight ``[N, K]`` repacked for :func:`quant_matmul` (layout: module doc)."""

    words: torch.Tensor  # int32 [Np / BN, S, G, BN]
    sb: torch.Tensor  # int32 [Np / BN, S, PW, BN]: (scale | bias << 16) as 16-bit floats
    block_n: int  # BN: output features per program, fixed by the tiling
    n: int
    k: int
    bits: int
    group_size: int
    sb_bf16: bool  # True: scale/bias halves are bf16, False: fp16
    counters: torch.Tensor  # int32 split-K arrival counters, all zero between calls
    config: QmmConfig = field(default_factory=QmmConfig)

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


def prepare(qt: QuantizedTensor, config: QmmConfig | None = None, block_n: int = 32,
            rows_per_chunk: int = 4096) -> PreparedQuant:
    """Repack an MLX affine weight (on its device) into the kernel layout. Done once at load.

    ``block_n`` (16..128, a power of two) is the tile width baked into the layout;
    ``rows_per_chunk`` bounds the temporary int32 code buffer (rows * K * 4 bytes)."""
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
    sdt = qt.scales.dtype
    if sdt not in (torch.bfloat16, torch.float16):
        sdt = torch.bfloat16
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
    n_groups = K // G
    s = torch.zeros(Np, S * PW, dtype=sdt, device=dev)
    b = torch.zeros(Np, S * PW, dtype=sdt, device=dev)
    s[:N, :n_groups] = qt.scales.to(sdt)
    b[:N, :n_groups] = qt.biases.to(sdt)
    lo = s.view(torch.int16).to(torch.int32) & 0xFFFF
    hi = b.view(torch.int16).to(torch.int32) << 16
    sb = (lo | hi).t()  # [S*PW, Np]
    # Tile: every program's [G, BN] word tile (and its scales) is one contiguous block, so a
    # program streams through consecutive memory instead of G rows Np words apart.
    nt = Np // block_n
    words = words.view(S, G, nt, block_n).permute(2, 0, 1, 3).contiguous()
    sb = sb.reshape(S, PW, nt, block_n).permute(2, 0, 1, 3).contiguous()
    # Split-K arrival counters: one per N tile (M <= 64 is always one M tile).
    counters = torch.zeros(nt, dtype=torch.int32, device=dev)
    return PreparedQuant(words, sb, block_n, N, K, bits, G, sdt == torch.bfloat16, counters,
                         config or QmmConfig())


if HAVE_TRITON:

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
                "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                [v, tl.full(v.shape, MASK, tl.int32), tl.full(v.shape, EXP, tl.int32)],
                dtype=tl.int32, is_pure=True, pack=1)
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
    def _qmm_kernel(x_ptr, w_ptr, sb_ptr, y_ptr, ws_ptr, cnt_ptr,
                    M, N, K, NP, stride_xm, stride_ym, SB_PER_SPLIT, NUM_SB,
                    BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
                    SB_BF16: tl.constexpr, PREFETCH: tl.constexpr, USE_ASM: tl.constexpr):
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
                        xi = tl.load(x_rows + k_offs[None, :],
                                     mask=m_mask[:, None] & (k_offs < K)[None, :], other=0.0)
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
                    total += tl.load(ws_tile + sk * split_stride, mask=out_mask, other=0.0,
                                     cache_modifier=".cg")
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _dequant_kernel(w_ptr, sb_ptr, out_ptr, N, K, NUM_SB, stride_on,
                        BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
                        SB_BF16: tl.constexpr, USE_ASM: tl.constexpr):
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
            tl.store(out_ptr + n_offs.to(tl.int64)[:, None] * stride_on + k_offs[None, :],
                     tl.trans(a.to(out_ptr.dtype.element_ty)),
                     mask=(n_offs < N)[:, None] & (k_offs < K)[None, :])




def dequantize_prepared(p: PreparedQuant, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight ``[N, K]`` in ``dtype`` (GPU), from the repacked layout."""
    out = torch.empty(p.n, p.k, dtype=dtype, device=p.words.device)
    BN = p.block_n
    grid = (triton.cdiv(p.n, BN), p.superblocks)
    _dequant_kernel[grid](p.words, p.sb, out, p.n, p.k, p.superblocks,
                          out.stride(0), BITS=p.bits, G=p.group_size, BN=BN,
                          SB_BF16=p.sb_bf16, USE_ASM=_USE_ASM, num_warps=4)
    return out


def split_for(p: PreparedQuant, m: int, config: QmmConfig | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, SPLIT_K, superblocks per split) for ``m`` rows: shapes only, never values."""
    cfg = config or p.config
    BM = 16 if m <= 16 else (32 if m <= 32 else 64)
    n_tiles = p.words.shape[0]
    m_tiles = -(-m // BM)
    S = p.superblocks
    target = sm_count(p.words.device) * cfg.ctas_per_sm
    split = max(1, min(S, -(-target // (n_tiles * m_tiles))))
    per = -(-S // split)
    return BM, -(-S // per), per


def quant_matmul(x: torch.Tensor, p: PreparedQuant, config: QmmConfig | None = None
                 ) -> torch.Tensor:
    """``x [..., K] @ W^T -> [..., N]`` in x's dtype (bf16 or fp16), fp32 accumulation.

    Rows <= 64: one fused Triton launch reading the packed weight once. More rows: dequantize to
    x's dtype (a Triton pass) and cuBLAS."""
    cfg = config or p.config
    lead = x.shape[:-1]
    if x.shape[-1] != p.k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {p.k}")
    x2 = x.reshape(-1, p.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M > MAX_FUSED_M:
        return (x2 @ dequantize_prepared(p, x.dtype).T).reshape(*lead, p.n)
    y = torch.empty(M, p.n, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, p.n)
    use_dot = cfg.use_dot or M > 1
    BM, split, per = split_for(p, M, cfg)
    if not use_dot:
        BM = 1
    NP = p.padded_n
    n_tiles = p.words.shape[0]
    m_tiles = -(-M // BM)
    ws = (torch.empty(split, M, NP, dtype=torch.float32, device=x.device) if split > 1
          else y)  # unused when split == 1
    prefetch = cfg.prefetch
    if (use_dot and prefetch and p.block_n == 32 and cfg.num_warps == 4 and BM == 16
            and n_tiles * split * m_tiles > _DOT_PF_RESIDENT * sm_count(x.device)):
        # The prefetching dot variant holds more registers (96 vs 76 per thread on H200 / Triton
        # 3.6): 5 programs per SM instead of 6. When that alone would push the grid into a
        # second wave (q_proj 12288x5120: 768 programs), the lighter variant runs in one:
        # measured 40 us instead of 57 at M = 4 and 16.
        prefetch = False
    _qmm_kernel[(n_tiles, split, m_tiles)](
        x2, p.words, p.sb, y, ws, p.counters,
        M, p.n, p.k, NP, x2.stride(0), y.stride(0), per, p.superblocks,
        BITS=p.bits, G=p.group_size, BN=p.block_n, BM=BM, SPLIT_K=split,
        EVEN_K=p.superblocks * p.per_word * p.group_size == p.k, USE_DOT=use_dot,
        SB_BF16=p.sb_bf16, PREFETCH=prefetch, USE_ASM=_USE_ASM,
        # More rows per program: 4 warps would spill (acc and x tiles grow with BLOCK_M).
        num_warps=cfg.num_warps if BM <= 16 else max(8, cfg.num_warps),
        num_stages=cfg.num_stages)
    return y.reshape(*lead, p.n)
