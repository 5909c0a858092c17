"""Batched decode attention straight from the KV pool (flash-decoding), on the GPU.

Job: one query row per stream for n streams, each attending to the first ``lengths[i]`` rows of
its slot in the pool, with grouped-query attention (query head ``i`` reads kv head
``i // (nh / nkv)``), scale ``hd^-0.5`` and an fp32 softmax: the contract of
:func:`headstart.ops.attention.reference.attend_decode`, except that K/V are read from the pool
by slot index instead of being gathered first (the gather would copy every stream's whole
history).

Two launches:

1. ``_split_kernel``, grid ``(n, nkv, NS)``: program (stream, kv head, split) loads the ``group``
   query heads sharing that kv head (padded to 16 rows for the tensor cores; K/V are read once per
   kv head, not once per query head), and runs an online softmax over its share of the stream's
   rows: the rows are cut into NS splits of ``ceil(ceil(len / NS) / BL) * BL`` rows, so every
   split gets work whatever the length. It writes an unnormalised fp32 partial output plus the
   running max (log2 domain) and sum.
2. ``_combine_kernel``, grid ``(n, nh)``: rescales and sums the NS partials.

NS depends only on n, nkv and the SM count (never on the lengths' values), the loops' trip counts
are read on the device, and nothing syncs with the host: the pair can be captured in a CUDA graph.
Rows past a stream's length are masked (never read), so stale or NaN pool rows are harmless.

Measured on the H200 (benchmarks/gpu_ops.py, 27B heads nh 24, nkv 4, hd 256, n = 16 streams,
CUDA-graph replay, cold L2): length 8192 141 us (floor, K+V bytes over the copy bandwidth, 126 us:
1.11x); length 512 16.5 us (floor 7.9 us). The reference gather + attend_decode: 1068 / 191 us.

:func:`chunk_attention` is the same pair for one stream's continued chunk of ``W`` rows (a new
turn after a prompt-cache hit, the later chunks of a long prompt) whose slot and start position
are device tensors, so that a graph captured once per width serves every start: program
(query block of ``BM`` rows, query head, split) runs the online softmax over its split of the
keys its block needs (``0 .. start + its last row``), causally masked; with one split it writes
the output itself. Each key block is read once per query block and head, not once per row as
decode rows would read it.

Layout: ``keys``/``values`` ``[slots, nkv, max_tokens, hd]`` (one layer of the pool) with ``hd``
contiguous; ``hd`` a power of two in 16..256. Non-goals: paged KV, ALiBi/softcap; new prompts
(SDPA's flash kernels: ``ops/attention/sdpa.py``).
"""

from __future__ import annotations

import torch

from headstart.ops.triton_support import HAVE_TRITON, pdl_options, sm_count, tl, triton

if HAVE_TRITON:
    from headstart.ops.triton_support import pdl_wait

LOG2E = 1.4426950408889634

if HAVE_TRITON:

    @triton.jit
    def _split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        slot_ptr,
        len_ptr,
        po_ptr,
        pm_ptr,
        pl_ptr,
        stride_qn,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_kt,
        stride_vs,
        stride_vh,
        stride_vt,
        qk_scale,
        NH: tl.constexpr,
        GROUP: tl.constexpr,
        GP: tl.constexpr,
        HD: tl.constexpr,
        BL: tl.constexpr,
        NS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_wait(PDL)  # q, the lengths and the new KV row come from earlier kernels
        i_n = tl.program_id(0)
        i_kv = tl.program_id(1)
        i_s = tl.program_id(2)
        length = tl.load(len_ptr + i_n).to(tl.int32)
        slot = tl.load(slot_ptr + i_n).to(tl.int64)
        per = tl.cdiv(tl.cdiv(length, NS), BL) * BL
        lo = i_s * per
        hi = tl.minimum(lo + per, length)

        g = tl.arange(0, GP)
        d = tl.arange(0, HD)
        heads = i_kv * GROUP + g
        q = tl.load(
            q_ptr + i_n * stride_qn + heads[:, None] * stride_qh + d[None, :],
            mask=(g < GROUP)[:, None],
            other=0.0,
        )
        k_base = k_ptr + slot * stride_ks + i_kv * stride_kh
        v_base = v_ptr + slot * stride_vs + i_kv * stride_vh
        m_i = tl.full([GP], -1.0e30, dtype=tl.float32)  # finite: empty splits combine to 0
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, HD], dtype=tl.float32)
        for start in range(lo, hi, BL):
            rows = start + tl.arange(0, BL)
            live = rows < hi
            kt = tl.load(
                k_base + rows[None, :] * stride_kt + d[:, None], mask=live[None, :], other=0.0
            )  # K^T [HD, BL]
            s = tl.dot(q, kt) * qk_scale  # log2-domain scores [GP, BL]
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(
                v_base + rows[:, None] * stride_vt + d[None, :], mask=live[:, None], other=0.0
            )  # [BL, HD]
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        # Partials laid out [n, nh, NS(, HD)].
        row = (i_n * NH + heads) * NS + i_s
        gm = g < GROUP
        tl.store(po_ptr + row.to(tl.int64)[:, None] * HD + d[None, :], acc, mask=gm[:, None])
        tl.store(pm_ptr + row, m_i, mask=gm)
        tl.store(pl_ptr + row, l_i, mask=gm)

    @triton.jit
    def _combine_kernel(
        po_ptr,
        pm_ptr,
        pl_ptr,
        o_ptr,
        stride_on,
        stride_oh,
        NH: tl.constexpr,
        HD: tl.constexpr,
        NS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_wait(PDL)
        i_n = tl.program_id(0)
        i_h = tl.program_id(1)
        s = tl.arange(0, NS)
        d = tl.arange(0, HD)
        row = (i_n * NH + i_h) * NS + s
        m = tl.load(pm_ptr + row)
        l = tl.load(pl_ptr + row)  # noqa: E741 - the softmax denominator, as in the papers
        m_max = tl.max(m, 0)
        w = tl.exp2(m - m_max)  # 0 for empty splits (m = -1e30)
        part = tl.load(po_ptr + row.to(tl.int64)[:, None] * HD + d[None, :])
        out = tl.sum(part * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(o_ptr + i_n * stride_on + i_h * stride_oh + d, out.to(o_ptr.dtype.element_ty))

    @triton.jit
    def _chunk_block(
        q,
        acc,
        m_i,
        l_i,
        k_base,
        v_base,
        n0,
        hi,
        pos,
        stride_kt,
        stride_vt,
        qk_scale,
        HD: tl.constexpr,
        BN: tl.constexpr,
        CAUSAL: tl.constexpr,
    ):
        """One block of ``BN`` keys from ``n0`` into the online softmax. With ``CAUSAL``, keys
        at ``hi`` and after are masked, and those after each row's position; without, every
        key of the block is below ``hi`` and seen by every row: no mask, so the block's loads
        and scores carry no predicates (most of a long history's blocks)."""
        cols = n0 + tl.arange(0, BN)
        d = tl.arange(0, HD)
        k_ptrs = k_base + cols[:, None] * stride_kt + d[None, :]
        v_ptrs = v_base + cols[:, None] * stride_vt + d[None, :]
        if CAUSAL:
            live = cols < hi
            k = tl.load(k_ptrs, mask=live[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # log2-domain scores [BM, BN]
        if CAUSAL:
            s = tl.where(live[None, :] & (cols[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if CAUSAL:
            v = tl.load(v_ptrs, mask=live[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return acc, m_new, l_i

    @triton.jit
    def _chunk_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        slot_ptr,
        start_ptr,
        po_ptr,
        pm_ptr,
        pl_ptr,
        o_ptr,
        W,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_kt,
        stride_vs,
        stride_vh,
        stride_vt,
        stride_ot,
        stride_oh,
        qk_scale,
        NH: tl.constexpr,
        GROUP: tl.constexpr,
        HD: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        NS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_wait(PDL)  # q and the chunk's KV rows come from earlier kernels
        i_m = tl.program_id(0)
        i_h = tl.program_id(1)
        i_s = tl.program_id(2)
        start = tl.load(start_ptr).to(tl.int32)
        slot = tl.load(slot_ptr).to(tl.int64)
        rows = i_m * BM + tl.arange(0, BM)
        live_q = rows < W
        pos = start + rows  # each query row sees keys 0 .. pos
        end = start + tl.minimum((i_m + 1) * BM, W)  # keys this block needs
        per = tl.cdiv(tl.cdiv(end, NS), BN) * BN
        lo = i_s * per
        hi = tl.minimum(lo + per, end)
        # Keys before the block's first row's position are seen by every row: no causal mask.
        seen = tl.maximum(tl.minimum(hi, start + i_m * BM), lo)
        seen = lo + (seen - lo) // BN * BN

        d = tl.arange(0, HD)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + i_h * stride_qh + d[None, :],
            mask=live_q[:, None],
            other=0.0,
        )
        kv = i_h // GROUP
        k_base = k_ptr + slot * stride_ks + kv * stride_kh
        v_base = v_ptr + slot * stride_vs + kv * stride_vh
        m_i = tl.full([BM], -1.0e30, dtype=tl.float32)  # finite: empty splits combine to 0
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, HD], dtype=tl.float32)
        for n0 in range(lo, seen, BN):
            acc, m_i, l_i = _chunk_block(
                q,
                acc,
                m_i,
                l_i,
                k_base,
                v_base,
                n0,
                hi,
                pos,
                stride_kt,
                stride_vt,
                qk_scale,
                HD,
                BN,
                False,
            )
        for n0 in range(seen, hi, BN):
            acc, m_i, l_i = _chunk_block(
                q,
                acc,
                m_i,
                l_i,
                k_base,
                v_base,
                n0,
                hi,
                pos,
                stride_kt,
                stride_vt,
                qk_scale,
                HD,
                BN,
                True,
            )
        if NS == 1:
            out = acc / l_i[:, None]
            tl.store(
                o_ptr + rows[:, None] * stride_ot + i_h * stride_oh + d[None, :],
                out.to(o_ptr.dtype.element_ty),
                mask=live_q[:, None],
            )
        else:  # partials laid out [W, nh, NS(, HD)], as _combine_kernel reads them
            row = (rows * NH + i_h) * NS + i_s
            tl.store(
                po_ptr + row.to(tl.int64)[:, None] * HD + d[None, :], acc, mask=live_q[:, None]
            )
            tl.store(pm_ptr + row, m_i, mask=live_q)
            tl.store(pl_ptr + row, l_i, mask=live_q)

    @triton.jit
    def _block_online(q, kt, vt, allowed, acc, m_i, l_i, qk_scale):
        """One step of the online softmax over key columns ``kt`` [HD, C] (``allowed`` [R, C])."""
        s = tl.dot(q, kt) * qk_scale  # log2-domain scores [R, C]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        return acc, m_new, l_i

    @triton.jit
    def _block_split_kernel(
        q_ptr,
        bk_ptr,
        bv_ptr,
        k_ptr,
        v_ptr,
        pos_ptr,
        slot_ptr,
        start_ptr,
        po_ptr,
        pm_ptr,
        pl_ptr,
        stride_qn,
        stride_qb,
        stride_qh,
        stride_bkn,
        stride_bkb,
        stride_bkh,
        stride_bvn,
        stride_bvb,
        stride_bvh,
        stride_ks,
        stride_kh,
        stride_kt,
        stride_vs,
        stride_vh,
        stride_vt,
        stride_ps,
        ring_rows,
        qk_scale,
        NH: tl.constexpr,
        GROUP: tl.constexpr,
        B: tl.constexpr,
        RP: tl.constexpr,
        BP: tl.constexpr,
        HD: tl.constexpr,
        BL: tl.constexpr,
        NS: tl.constexpr,
        SPAN: tl.constexpr,
        CAUSAL: tl.constexpr,
        WINDOW: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_wait(PDL)  # q and the block's keys come from earlier kernels
        i_n = tl.program_id(0)
        i_kv = tl.program_id(1)
        i_s = tl.program_id(2)
        slot = tl.load(slot_ptr + i_n).to(tl.int64)
        start = tl.load(start_ptr + i_n).to(tl.int64)
        # Query rows: the GROUP heads of this kv head for each of the B block rows.
        r = tl.arange(0, RP)
        live_r = r < GROUP * B
        b = r // GROUP
        heads = i_kv * GROUP + r % GROUP
        d = tl.arange(0, HD)
        q = tl.load(
            q_ptr
            + i_n * stride_qn
            + b[:, None] * stride_qb
            + heads[:, None] * stride_qh
            + d[None, :],
            mask=live_r[:, None],
            other=0.0,
        )
        m_i = tl.full([RP], -1.0e30, dtype=tl.float32)  # finite: empty splits combine to 0
        l_i = tl.zeros([RP], dtype=tl.float32)
        acc = tl.zeros([RP, HD], dtype=tl.float32)
        # Context: a ring row holds a position below the block's start, at row position % R, so
        # before the ring wraps the context lies in its first `start` rows: only those are read.
        # Split i_s covers ring rows [i_s * SPAN, (i_s + 1) * SPAN) (a trip count known at
        # compile time: Triton's interpreter cannot loop to a loaded bound).
        ctx = tl.minimum(start, ring_rows)
        k_base = k_ptr + slot * stride_ks + i_kv * stride_kh
        v_base = v_ptr + slot * stride_vs + i_kv * stride_vh
        for it in range(SPAN // BL):
            first = i_s * SPAN + it * BL
            if first < ctx:
                rows = first + tl.arange(0, BL)
                kp = tl.load(pos_ptr + slot * stride_ps + rows, mask=rows < ctx, other=-1)
                ok = (kp >= 0) & (kp < start)  # filled, and before the block
                allowed = ok[None, :] & live_r[:, None]
                if WINDOW > 0:
                    allowed = allowed & ((start + b)[:, None] - kp[None, :] < WINDOW)
                kt = tl.load(
                    k_base + rows[None, :] * stride_kt + d[:, None], mask=ok[None, :], other=0.0
                )
                vt = tl.load(
                    v_base + rows[:, None] * stride_vt + d[None, :], mask=ok[:, None], other=0.0
                )
                acc, m_i, l_i = _block_online(q, kt, vt, allowed, acc, m_i, l_i, qk_scale)
        if i_s == 0:  # the block's own rows, once per stream and kv head
            j = tl.arange(0, BP)
            jl = j < B
            kt = tl.load(
                bk_ptr
                + i_n * stride_bkn
                + j[None, :] * stride_bkb
                + i_kv * stride_bkh
                + d[:, None],
                mask=jl[None, :],
                other=0.0,
            )
            vt = tl.load(
                bv_ptr
                + i_n * stride_bvn
                + j[:, None] * stride_bvb
                + i_kv * stride_bvh
                + d[None, :],
                mask=jl[:, None],
                other=0.0,
            )
            allowed = jl[None, :] & live_r[:, None]
            if CAUSAL:
                allowed = allowed & (j[None, :] <= b[:, None])
            if WINDOW > 0:
                allowed = allowed & (b[:, None] - j[None, :] < WINDOW)
            acc, m_i, l_i = _block_online(q, kt, vt, allowed, acc, m_i, l_i, qk_scale)
        # Partials laid out [n * B, nh, NS(, HD)], as _combine_kernel reads them.
        row = ((i_n * B + b) * NH + heads) * NS + i_s
        tl.store(po_ptr + row.to(tl.int64)[:, None] * HD + d[None, :], acc, mask=live_r[:, None])
        tl.store(pm_ptr + row, m_i, mask=live_r)
        tl.store(pl_ptr + row, l_i, mask=live_r)


def _partials(parts: int, hd: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Buffers of ``parts`` split partials (one per query row, head and split): the
    unnormalised fp32 outputs ``[parts * hd]``, and the running max and sum ``[parts]``."""
    po = torch.empty(parts * hd, dtype=torch.float32, device=device)
    pm = torch.empty(parts, dtype=torch.float32, device=device)
    return po, pm, torch.empty_like(pm)


def _combine(partials: tuple[torch.Tensor, ...], out: torch.Tensor, NS: int) -> None:
    """``_combine_kernel`` over ``out`` ``[rows, nh, hd]`` (its rows and heads strided, ``hd``
    contiguous): each (row, head)'s NS partials rescaled and summed into it."""
    rows, nh, hd = out.shape
    _combine_kernel[(rows, nh)](
        *partials,
        out,
        out.stride(0),
        out.stride(1),
        NH=nh,
        HD=hd,
        NS=NS,
        num_warps=4 if hd >= 128 else 2,
        **pdl_options(out.device),
    )


def num_splits_for(n: int, nkv: int, max_tokens: int, device: torch.device, block: int = 32) -> int:
    """Splits of the keys per program of ``n * nkv`` (decode: stream, kv head; a chunk: query
    block, head): about two programs per SM, a power of two, at most 64."""
    want = -(-2 * sm_count(device) // max(1, n * nkv))
    ns = 1
    while ns < want and ns < 64:
        ns *= 2
    return max(1, min(ns, triton.next_power_of_2(-(-max_tokens // block))))


def _check_layout(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """What both kernels need of q [.., nh, hd] and the pool's keys/values [slots, nkv, T, hd]."""
    nh, hd, nkv = q.shape[1], q.shape[2], keys.shape[1]
    if nh % nkv:
        raise ValueError(f"{nh} query heads do not group over {nkv} kv heads")
    if hd & (hd - 1) or not 16 <= hd <= 256:
        raise ValueError(f"head_dim {hd} must be a power of two in 16..256")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys/values need a contiguous head dimension")


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    num_splits: int | None = None,
    block: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """q: [n, nh, hd]; keys, values: [slots, nkv, max_tokens, hd]; slots: [n] int; lengths: [n]
    int (>= 1: rows 0..len-1 of the stream's slot, its own new row included). Returns [n, nh, hd]
    in q's dtype."""
    n, nh, hd = q.shape
    nkv, max_tokens = keys.shape[1], keys.shape[2]
    _check_layout(q, keys, values)
    out = torch.empty_like(q)
    if n == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = nh // nkv
    BL = block or (32 if hd >= 256 else 64)
    NS = num_splits or num_splits_for(n, nkv, max_tokens, q.device, BL)
    stages = num_stages or (3 if hd >= 256 else 2)
    partials = _partials(n * nh * NS, hd, q.device)
    _split_kernel[(n, nkv, NS)](
        q,
        keys,
        values,
        slots,
        lengths,
        *partials,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        hd**-0.5 * LOG2E,
        NH=nh,
        GROUP=group,
        GP=max(16, triton.next_power_of_2(group)),
        HD=hd,
        BL=BL,
        NS=NS,
        num_warps=4,
        num_stages=stages,
        **pdl_options(q.device),
    )
    _combine(partials, out, NS)
    return out


def chunk_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: torch.Tensor,
    start: torch.Tensor,
    num_splits: int | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """q: [W, nh, hd], rows at positions ``start ..`` of stream ``slot`` ([1] int tensors on
    q's device), whose KV rows are already in the pool; keys, values: [slots, nkv, max_tokens,
    hd]. Row ``i`` attends to rows ``0 .. start + i``. Returns [W, nh, hd] in q's dtype: the
    contract of :func:`headstart.ops.attention.reference.attend_chunk`. ``config``: (query
    block, key block, warps, stages), for tuning."""
    W, nh, hd = q.shape
    nkv, max_tokens = keys.shape[1], keys.shape[2]
    _check_layout(q, keys, values)
    out = torch.empty_like(q)
    if W == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    # Chosen by benchmarks/gpu_ops.py --sweep on an H200 (27B heads, hd 256): query blocks of
    # 128 rows once the chunk has more than 64, else 64 (fewer idle rows).
    if config is None:
        wide = W > 64
        if hd >= 256:
            config = (128, 64, 8, 2) if wide else (64, 32, 4, 3)
        else:
            config = (128, 64, 4, 2) if wide else (64, 64, 4, 2)
    BM, BN, warps, stages = config
    blocks = -(-W // BM)
    # About two programs per SM: splits only where the (query block, head) pairs are too few.
    NS = num_splits or num_splits_for(blocks, nh, max_tokens, q.device, BN)
    parts = W * nh * NS if NS > 1 else 1
    partials = _partials(parts, hd, q.device)
    _chunk_kernel[(blocks, nh, NS)](
        q,
        keys,
        values,
        slot,
        start,
        *partials,
        out,
        W,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        out.stride(0),
        out.stride(1),
        hd**-0.5 * LOG2E,
        NH=nh,
        GROUP=nh // nkv,
        HD=hd,
        BM=BM,
        BN=BN,
        NS=NS,
        num_warps=warps,
        num_stages=stages,
        **pdl_options(q.device),
    )
    if NS > 1:
        _combine(partials, out, NS)
    return out


def block_attention(
    q: torch.Tensor,
    block_k: torch.Tensor,
    block_v: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    ring_pos: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    causal: bool,
    window: int,
    rows: int | None = None,
    masks: dict | None = None,
) -> torch.Tensor:
    """:func:`headstart.ops.attention.reference.attend_block` in two launches, reading the ring
    by slot (no gather, no mask tensor): a program per (stream, kv head, split of the ring's
    rows) runs the online softmax over its split of the context rows in use (at most the
    stream's start, so a short context reads little of a long ring; ``rows`` and ``masks`` are
    not needed), the first split also over the block's own rows; ``_combine_kernel`` sums the
    splits. Layouts as the reference's, with ``hd`` contiguous."""
    n, B, nh, hd = q.shape
    nkv, R = ring_k.shape[1], ring_k.shape[2]
    _check_layout(q[0], ring_k, ring_v)
    out = torch.empty(n, B, nh, hd, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    group = nh // nkv
    BL = 32 if hd >= 256 else 64
    NS = num_splits_for(n, nkv, R, q.device, BL)
    RP = max(16, triton.next_power_of_2(group * B))
    partials = _partials(n * B * nh * NS, hd, q.device)
    _block_split_kernel[(n, nkv, NS)](
        q,
        block_k,
        block_v,
        ring_k,
        ring_v,
        ring_pos,
        slots,
        starts,
        *partials,
        *q.stride()[:3],
        *block_k.stride()[:3],
        *block_v.stride()[:3],
        *ring_k.stride()[:3],
        *ring_v.stride()[:3],
        ring_pos.stride(0),
        R,
        hd**-0.5 * LOG2E,
        NH=nh,
        GROUP=group,
        B=B,
        RP=RP,
        BP=max(16, triton.next_power_of_2(B)),
        HD=hd,
        BL=BL,
        NS=NS,
        SPAN=triton.cdiv(triton.cdiv(R, NS), BL) * BL,  # ring rows per split
        CAUSAL=causal,
        WINDOW=window,
        num_warps=8 if RP * hd >= 8192 else 4,
        num_stages=2,
        **pdl_options(q.device),
    )
    _combine(partials, out.view(n * B, nh, hd), NS)
    return out
