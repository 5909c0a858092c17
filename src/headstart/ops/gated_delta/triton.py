"""The Gated DeltaNet decode step on the GPU, updating the recurrent-state pool in place by slot.

Job: the GDN entry points of a decode step, with the contracts of the references in
:mod:`headstart.ops.gated_delta.reference` (raw q/k, L2-normalised with eps 1e-6 on the sum of
squares and q scaled by ``Dk^-0.5`` inside; log decay ``g``; ``beta`` post-sigmoid; value head
``h`` reads key head ``h // (Hv/Hk)``; fp32 state ``[Hv, Dk, Dv]``, the HF/FLA layout, same as our
pool). Multi-row spans go through flash-linear-attention's chunked kernel instead
(:mod:`headstart.ops.gated_delta.fla`), except new prompts padded to a few rows
(:func:`gdn_padded`), which run as the step kernel's one-row steps.

* :func:`gdn_decode`: one new row per stream for n streams, our own Triton kernel that updates the
  pool **in place** by slot index (FLA 0.6's fused_recurrent has no state-index argument, so using
  it would cost a gather and a scatter of ``n * Hv * Dk * Dv * 4`` bytes each, doubling the
  traffic of a step that is nothing but state traffic). One program owns one (stream, value head,
  Dv slice): loads its ``[Dk, BV]`` state slice once, decays, applies the delta rule, writes the
  output slice and the state back. No host sync; launch shape depends only on n and the head
  sizes (CUDA-graph friendly).
* :func:`gdn_decode_gates`: the same step as the decode forward runs it, reading the raw gate
  projections ``a``, ``b`` at each stream's packed row and computing ``g`` and ``beta`` inside
  (``pointwise.gdn_gates``), and optionally applying the gated output norm
  (``pointwise.gated_rms_norm``) in the same kernel, with one program per whole head. That
  variant is only used while whole-head programs fit about two per SM (:func:`norm_fold_limit`):
  27B on the H200, 7.3 us a layer instead of 4.3 + 3.9 at 1 stream, but 44.5 instead of
  26.8 + 4.9 at 16.
* :func:`gdn_fresh_chunk`: new prompts of up to 32 rows from a zero state as one fused chunk
  per (stream, value head, Dv slice): the WY system of the chunked form solved blockwise (two
  16-row blocks, forward substitution within each), outputs and final state by matmuls, in one
  launch. Used for one new prompt of 17..32 rows (:func:`fresh_chunk_fits`), where it beat
  FLA's launches on an H100 (``benchmarks/gdn_padded.py --fused``).

Layout assumptions: ``state_pool`` is one layer's ``[slots, Hv, Dk, Dv]`` fp32 with contiguous
``[Hv, Dk, Dv]`` (``pool.recurrent[layer]``); q/k/v may be strided views (e.g. splits of the conv
output) as long as the feature dimension is contiguous.

Measured on the H200 (benchmarks/gpu_ops.py, 27B heads Hk 16, Hv 48, Dk = Dv = 128, 48 layers
replayed from a CUDA graph): n = 16 streams 1.50 ms for 48 layers (floor, state read + write over
the copy bandwidth, 1.13 ms: 1.32x); n = 1 0.19 ms (floor 0.07 ms; ~4 us a layer is mostly the
fixed cost of a small kernel). Launched eagerly from Python the same 48 calls take ~1.8 ms at
either n: launch cost, which graph capture removes.

Non-goals: autograd, the conv and gate projections (fused elsewhere), Dk/Dv that are not powers of
two.
"""

from __future__ import annotations

import torch

from headstart.ops.triton_support import HAVE_TRITON, pdl_options, sm_count, tl, triton

if HAVE_TRITON:
    from headstart.ops.triton_support import pdl_wait


if HAVE_TRITON:

    @triton.jit
    def _gdn_step_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        o_ptr,
        slot_ptr,
        fresh_ptr,
        state_ptr,
        rows_ptr,
        a_log_ptr,
        dt_bias_ptr,
        z_ptr,
        norm_w_ptr,
        row_state_ptr,
        stride_qn,
        stride_qh,
        stride_kn,
        stride_kh,
        stride_vn,
        stride_vh,
        stride_gn,
        stride_bn,
        stride_on,
        stride_oh,
        stride_slot,
        stride_zn,
        stride_rs_n,
        stride_rs_t,
        eps,
        HV: tl.constexpr,
        R: tl.constexpr,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BV: tl.constexpr,
        RAW_GATES: tl.constexpr,
        NORM: tl.constexpr,
        W: tl.constexpr = 1,
        ROW_STATES: tl.constexpr = False,
        PDL: tl.constexpr = False,
        ALL_FRESH: tl.constexpr = False,
    ):
        pdl_wait(PDL)  # every input but A_log, dt_bias and the norm weight is written before
        pid = tl.program_id(0)  # stream * HV + value head
        pv = tl.program_id(1)  # Dv slice
        i_n = pid // HV
        i_hv = pid % HV
        i_hk = i_hv // R
        dk = tl.arange(0, DK)
        dv = pv * BV + tl.arange(0, BV)

        slot = tl.load(slot_ptr + i_n).to(tl.int64)
        s_ptrs = state_ptr + slot * stride_slot + i_hv * (DK * DV) + dk[:, None] * DV + dv[None, :]
        # A fresh stream's slot is not read at all (it may hold anything, NaN included).
        if ALL_FRESH:
            S = tl.zeros([DK, BV], dtype=tl.float32)
        else:
            keep = tl.load(fresh_ptr + i_n) == 0
            S = tl.load(s_ptrs, mask=(dk[:, None] < DK) & keep, other=0.0)
        ODT: tl.constexpr = o_ptr.dtype.element_ty
        # W rows of the stream (a verify window; 1: a decode step), each the same step.
        for t in tl.static_range(W):
            r = i_n * W + t
            q = tl.load(q_ptr + r * stride_qn + i_hk * stride_qh + dk).to(tl.float32)
            k = tl.load(k_ptr + r * stride_kn + i_hk * stride_kh + dk).to(tl.float32)
            v = tl.load(v_ptr + r * stride_vn + i_hv * stride_vh + dv).to(tl.float32)
            if RAW_GATES:
                # g and beta from the raw projections a, b at the row's packed row, as
                # pointwise.gdn_gates computes them (beta rounded to b's dtype, as a tensor of
                # it is).
                row = tl.load(rows_ptr + r).to(tl.int64)
                a = tl.load(g_ptr + row * stride_gn + i_hv).to(tl.float32)
                a = a + tl.load(dt_bias_ptr + i_hv)
                softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # torch's threshold 20
                g = -tl.exp(tl.load(a_log_ptr + i_hv)) * softplus
                b = tl.load(beta_ptr + row * stride_bn + i_hv)
                beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
            else:
                g = tl.load(g_ptr + r * stride_gn + i_hv).to(tl.float32)
                beta = tl.load(beta_ptr + r * stride_bn + i_hv).to(tl.float32)
            # Same normalisation as the reference (rsqrt of sum of squares + 1e-6; q also *
            # Dk^-0.5).
            q = q * (tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * (DK**-0.5))
            k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
            S = S * tl.exp(g)
            kv = tl.sum(S * k[:, None], 0)  # [BV] = S^T k
            delta = (v - kv) * beta
            S = S + k[:, None] * delta[None, :]
            o = tl.sum(S * q[:, None], 0)
            if ROW_STATES:  # the state after this row: [n, W, Hv, Dk, Dv], [Hv, Dk, Dv] dense
                rs = row_state_ptr + i_n * stride_rs_n + t * stride_rs_t + i_hv * (DK * DV)
                rs += dk[:, None] * DV + dv[None, :]
                tl.store(rs, S)
            if NORM:
                # The gated output norm (pointwise.gated_rms_norm) over the whole head (BV ==
                # DV), rounding where it rounds: o, the normalised o, the weighted o, the gated
                # result.
                o = o.to(ODT).to(tl.float32)
                o = (o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps)).to(ODT).to(tl.float32)
                w = tl.load(norm_w_ptr + dv).to(ODT).to(tl.float32)
                o = (w * o).to(ODT).to(tl.float32)
                z = tl.load(z_ptr + row * stride_zn + i_hv * DV + dv).to(tl.float32)
                o = o * (z * tl.sigmoid(z))
            tl.store(o_ptr + r * stride_on + i_hv * stride_oh + dv, o.to(ODT))
        tl.store(s_ptrs, S)

    @triton.jit
    def _inv_unit_lower(A, B: tl.constexpr):
        """``(I + A)^-1`` of a strictly lower-triangular ``[B, B]`` block, by forward
        substitution (row i = e_i - sum_{j<i} A_ij row j), exact in fp32 as FLA's solve."""
        i_ = tl.arange(0, B)[:, None]
        j_ = tl.arange(0, B)[None, :]
        T = (i_ == j_).to(tl.float32)
        for i in range(1, B):
            a = tl.sum(tl.where(i_ == i, A, 0.0), 0)  # row i of A, over columns j
            # a_j against row j of T (rows j >= i are still e_j, and a_j = 0 there)
            T = tl.where(i_ == i, T - tl.sum(a[:, None] * T, 0)[None, :], T)
        return T

    @triton.jit
    def _fresh_chunk_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        o_ptr,
        slot_ptr,
        state_ptr,
        L,
        stride_slot,
        HK: tl.constexpr,
        HV: tl.constexpr,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BV: tl.constexpr,
        B: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """One fresh stream's rows (at most 2 B) for one value head and Dv slice, from a zero
        state, as one chunk in two B-row blocks: the WY system solved blockwise (``T11``,
        ``T22`` by forward substitution, ``T21 = -T22 A21 T11``), the outputs and the final
        state by matmuls. The math of ``reference.chunked_gated_delta`` with one chunk."""
        pdl_wait(PDL)
        pid = tl.program_id(0)  # stream * HV + value head
        pv = tl.program_id(1)
        i_n = pid // HV
        i_hv = pid % HV
        i_hk = i_hv // (HV // HK)
        t = tl.arange(0, B)
        dk = tl.arange(0, DK)
        dv = pv * BV + tl.arange(0, BV)
        r1 = t
        r2 = B + t
        m1 = r1 < L
        m2 = r2 < L
        row1 = (i_n * L + r1).to(tl.int64)
        row2 = (i_n * L + r2).to(tl.int64)

        q_base = q_ptr + i_hk * DK + dk[None, :]
        q1 = tl.load(q_base + row1[:, None] * (HK * DK), mask=m1[:, None], other=0.0).to(tl.float32)
        q2 = tl.load(q_base + row2[:, None] * (HK * DK), mask=m2[:, None], other=0.0).to(tl.float32)
        k_base = k_ptr + i_hk * DK + dk[None, :]
        k1 = tl.load(k_base + row1[:, None] * (HK * DK), mask=m1[:, None], other=0.0).to(tl.float32)
        k2 = tl.load(k_base + row2[:, None] * (HK * DK), mask=m2[:, None], other=0.0).to(tl.float32)
        v_base = v_ptr + i_hv * DV + dv[None, :]
        v1 = tl.load(v_base + row1[:, None] * (HV * DV), mask=m1[:, None], other=0.0).to(tl.float32)
        v2 = tl.load(v_base + row2[:, None] * (HV * DV), mask=m2[:, None], other=0.0).to(tl.float32)
        g1 = tl.load(g_ptr + row1 * HV + i_hv, mask=m1, other=0.0).to(tl.float32)
        g2 = tl.load(g_ptr + row2 * HV + i_hv, mask=m2, other=0.0).to(tl.float32)
        b1 = tl.load(beta_ptr + row1 * HV + i_hv, mask=m1, other=0.0).to(tl.float32)
        b2 = tl.load(beta_ptr + row2 * HV + i_hv, mask=m2, other=0.0).to(tl.float32)

        # L2 norms as the reference (eps 1e-6 on the sum of squares; q also * Dk^-0.5).
        q1 = q1 * (tl.rsqrt(tl.sum(q1 * q1, 1) + 1e-6) * (DK**-0.5))[:, None]
        q2 = q2 * (tl.rsqrt(tl.sum(q2 * q2, 1) + 1e-6) * (DK**-0.5))[:, None]
        k1 = k1 * tl.rsqrt(tl.sum(k1 * k1, 1) + 1e-6)[:, None]
        k2 = k2 * tl.rsqrt(tl.sum(k2 * k2, 1) + 1e-6)[:, None]

        # Cumulative log decay over the whole chunk; decay(i, j) = exp(c_i - c_j), j <= i.
        c1 = tl.cumsum(g1, 0)
        c2 = tl.cumsum(g2, 0) + tl.sum(g1, 0)
        i_ = t[:, None]
        j_ = t[None, :]
        d11 = tl.exp(tl.where(j_ <= i_, c1[:, None] - c1[None, :], float("-inf")))
        d22 = tl.exp(tl.where(j_ <= i_, c2[:, None] - c2[None, :], float("-inf")))
        d21 = tl.exp(c2[:, None] - c1[None, :])  # every row of block 2 is after block 1

        # Every [B, B] product first, so that q is dead before the solve (registers). All
        # products on the tensor cores in tf32 (FLA's take bf16 operands); full fp32 ("ieee")
        # spilled at 255 registers (ptxas, sm_90a).
        TF32: tl.constexpr = "tf32"
        kk11 = tl.dot(k1, tl.trans(k1), input_precision=TF32)
        kk22 = tl.dot(k2, tl.trans(k2), input_precision=TF32)
        kk21 = tl.dot(k2, tl.trans(k1), input_precision=TF32)
        # o = (q k^T * decay, the diagonal included) U
        p11 = tl.dot(q1, tl.trans(k1), input_precision=TF32) * d11
        p21 = tl.dot(q2, tl.trans(k1), input_precision=TF32) * d21
        p22 = tl.dot(q2, tl.trans(k2), input_precision=TF32) * d22
        a11 = tl.where(j_ < i_, b1[:, None] * kk11 * d11, 0.0)
        a22 = tl.where(j_ < i_, b2[:, None] * kk22 * d22, 0.0)
        a21 = b2[:, None] * kk21 * d21
        # (I + A) U = diag(beta) V, blockwise.
        t11 = _inv_unit_lower(a11, B)
        t22 = _inv_unit_lower(a22, B)
        t21 = -tl.dot(tl.dot(t22, a21, input_precision=TF32), t11, input_precision=TF32)
        bv1 = b1[:, None] * v1
        bv2 = b2[:, None] * v2
        u1 = tl.dot(t11, bv1, input_precision=TF32)
        u2 = tl.dot(t21, bv1, input_precision=TF32) + tl.dot(t22, bv2, input_precision=TF32)
        o1 = tl.dot(p11, u1, input_precision=TF32)
        o2 = tl.dot(p21, u1, input_precision=TF32) + tl.dot(p22, u2, input_precision=TF32)
        o_base = o_ptr + i_hv * DV + dv[None, :]
        tl.store(o_base + row1[:, None] * (HV * DV), o1, mask=m1[:, None])
        tl.store(o_base + row2[:, None] * (HV * DV), o2, mask=m2[:, None])

        # The final state: sum_j exp(c_end - c_j) k_j u_j^T, to the stream's slot.
        c_end = tl.sum(g1, 0) + tl.sum(g2, 0)
        k1e = k1 * tl.exp(c_end - c1)[:, None]
        k2e = k2 * tl.exp(c_end - c2)[:, None]
        S = tl.dot(tl.trans(k1e), u1, input_precision=TF32)
        S += tl.dot(tl.trans(k2e), u2, input_precision=TF32)
        slot = tl.load(slot_ptr + i_n).to(tl.int64)
        s_ptrs = state_ptr + slot * stride_slot + i_hv * (DK * DV) + dk[:, None] * DV + dv[None, :]
        tl.store(s_ptrs, S)

    @triton.jit
    def _fresh_outputs_kernel(
        q_ptr,
        k_ptr,
        u_ptr,
        g_ptr,
        o_ptr,
        slot_ptr,
        state_ptr,
        L,
        scale,
        stride_slot,
        HK: tl.constexpr,
        HV: tl.constexpr,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BV: tl.constexpr,
        BT: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        """One fresh stream's rows (at most BT, one chunk) for one value head and Dv slice,
        given the chunk's WY values ``u`` (the state is zero, so FLA's ``v_new`` is ``u``):
        the outputs ``scale * tril(q k^T * 2^(g_i - g_j)) u`` and the final state
        ``(k * 2^(g_last - g))^T u`` written to the stream's slot, both as FLA's chunk_o and
        chunk_h compute them (``g``: log2 cumulative decay; q and k L2-normalised)."""
        pdl_wait(PDL)
        pid = tl.program_id(0)  # stream * HV + value head
        pv = tl.program_id(1)
        i_n = pid // HV
        i_hv = pid % HV
        i_hk = i_hv // (HV // HK)
        t = tl.arange(0, BT)
        m = t < L
        rows = (i_n * L + t).to(tl.int64)
        dk = tl.arange(0, DK)
        dv = pv * BV + tl.arange(0, BV)
        qk_rows = rows[:, None] * (HK * DK) + i_hk * DK + dk[None, :]
        b_q = tl.load(q_ptr + qk_rows, mask=m[:, None], other=0.0)
        b_k = tl.load(k_ptr + qk_rows, mask=m[:, None], other=0.0)
        uo_rows = rows[:, None] * (HV * DV) + i_hv * DV + dv[None, :]
        b_u = tl.load(u_ptr + uo_rows, mask=m[:, None], other=0.0)
        b_g = tl.load(g_ptr + rows * HV + i_hv, mask=m, other=0.0).to(tl.float32)

        b_a = tl.dot(b_q, tl.trans(b_k)) * tl.exp2(b_g[:, None] - b_g[None, :])
        b_a = tl.where((t[:, None] >= t[None, :]) & m[:, None] & m[None, :], b_a, 0.0)
        b_o = tl.dot(b_a.to(b_u.dtype), b_u) * scale
        tl.store(o_ptr + uo_rows, b_o.to(o_ptr.dtype.element_ty), mask=m[:, None])

        g_last = tl.load(g_ptr + (i_n * L + L - 1).to(tl.int64) * HV + i_hv).to(tl.float32)
        b_ud = b_u.to(tl.float32) * tl.where(m, tl.exp2(g_last - b_g), 0.0)[:, None]
        b_s = tl.dot(tl.trans(b_k), b_ud.to(b_k.dtype))
        slot = tl.load(slot_ptr + i_n).to(tl.int64)
        s_ptrs = state_ptr + slot * stride_slot + i_hv * (DK * DV) + dk[:, None] * DV + dv[None, :]
        tl.store(s_ptrs, b_s)


def norm_fold_limit(device: torch.device) -> int:
    """Most (stream, value head) programs for which the output norm is applied inside the step
    kernel (see :func:`gdn_decode`)."""
    return 2 * sm_count(device) if device.type == "cuda" else 264


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor | None,
    state_pool: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    rows: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    width: int = 1,
    row_states: torch.Tensor | None = None,
    launch: tuple[int, int] | None = None,
) -> torch.Tensor:
    """One GDN step for n streams; updates ``state_pool[slots]`` in place.

    q, k: [n, Hk, Dk]; v: [n, Hv, Dv]; g, beta: [n, Hv]; slots: [n] int; fresh: [n] bool
    (None: every stream is fresh); state_pool: [slots, Hv, Dk, Dv] fp32 (``[Hv, Dk, Dv]``
    contiguous). Slots must be distinct.
    Returns o: [n, Hv, Dv] in ``out_dtype`` (default v's dtype).

    ``width`` > 1: that many rows per stream, stream after stream (q, k, v, g, beta and
    ``rows`` with ``n * width`` rows; a verify window), as one-row steps in one launch, the
    state kept in registers between them; o [n * width, Hv, Dv]. ``row_states`` ([n, width, Hv,
    Dk, Dv] fp32, each row's ``[Hv, Dk, Dv]`` dense; e.g. a slice of wider records): the state
    after each row, written there. ``launch`` (warps per program, Dv slice), without the
    norm: overrides the default launch (for benchmarks).
    """
    n = slots.shape[0]
    Hk, Dk = q.shape[1], q.shape[2]
    Hv, Dv = v.shape[1], v.shape[2]
    o = torch.empty(n * width, Hv, Dv, dtype=out_dtype or v.dtype, device=v.device)
    if n == 0:
        return o
    if state_pool.dtype != torch.float32 or state_pool[0].stride() != (Dk * Dv, Dv, 1):
        raise ValueError("state_pool must be fp32 with contiguous [Hv, Dk, Dv] per slot")
    if row_states is not None and (
        row_states.dtype != torch.float32 or row_states[0, 0].stride() != (Dk * Dv, Dv, 1)
    ):
        raise ValueError("row_states must be fp32 [n, width, Hv, Dk, Dv], [Hv, Dk, Dv] dense")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    rows = rows.contiguous() if rows is not None else None
    g = g if g.stride(-1) == 1 else g.contiguous()
    beta = beta if beta.stride(-1) == 1 else beta.contiguous()
    if norm is not None and n * Hv > norm_fold_limit(v.device):
        # Whole-head programs (the fused norm) hold a [Dk, Dv] state each: past about two per SM
        # they run slower than Dv-sliced programs plus a separate norm kernel (27B, H200: 44.5
        # us vs 26.8 + 4.9 at 16 streams; 7.3 vs 4.3 + 3.9 at 1).
        from headstart.ops.pointwise.triton import gated_rms_norm

        z, norm_w, eps = norm
        o = gdn_decode(
            q,
            k,
            v,
            g,
            beta,
            slots,
            fresh,
            state_pool,
            out_dtype,
            rows,
            A_log,
            dt_bias,
            width=width,
            row_states=row_states,
        )
        return gated_rms_norm(o, z, norm_w, eps, gate_rows=rows).view(o.shape)
    # Enough programs to cover the SMs even at n = 1 (BV 16 -> Dv/16 slices per head); the
    # output norm needs whole heads.
    BV = 32 if n * Hv * (Dv // 32) >= 512 else 16
    BV = Dv if norm is not None else min(BV, Dv)
    warps = 8 if norm is not None else 4
    if launch is not None and norm is None:
        warps, BV = launch
    grid = (n * Hv, Dv // BV)
    raw = rows is not None
    if norm is not None:
        if not raw:
            raise ValueError("the output norm reads z by packed row: pass rows")
        z, norm_w, eps = norm
        if z.stride(2) != 1 or z.stride(1) != Dv:
            raise ValueError("z must be [T, Hv, Dv] with contiguous heads")
    else:
        z, norm_w, eps = g, g, 0.0
    _gdn_step_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        o,
        slots,
        slots if fresh is None else fresh.view(torch.uint8) if fresh.dtype == torch.bool else fresh,
        state_pool,
        rows if raw else slots,
        A_log if raw else g,
        dt_bias if raw else g,
        z,
        norm_w,
        state_pool if row_states is None else row_states,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        o.stride(0),
        o.stride(1),
        state_pool.stride(0),
        z.stride(0),
        *(row_states.stride()[:2] if row_states is not None else (0, 0)),
        eps,
        HV=Hv,
        R=Hv // Hk,
        DK=Dk,
        DV=Dv,
        BV=BV,
        RAW_GATES=raw,
        NORM=norm is not None,
        W=width,
        ROW_STATES=row_states is not None,
        ALL_FRESH=fresh is None,
        num_warps=warps,
        **pdl_options(v.device),
    )
    return o


def gdn_decode_gates(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    rows: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    state_pool: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    width: int = 1,
    row_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`gdn_decode` with the gates computed in the kernel from the raw projections a, b
    ``[T, Hv]`` at packed rows ``rows [n]`` (``[n * width]`` for a window; see
    :func:`gdn_decode`) (``pointwise.gdn_gates``): no gate kernels, no gathers. ``norm = (z
    [T, Hv, Dv], weight [Dv], eps)``: the output goes through ``pointwise.gated_rms_norm`` with
    ``z`` at the same rows, in the same kernel."""
    return gdn_decode(
        q,
        k,
        v,
        a,
        b,
        slots,
        fresh,
        state_pool,
        rows=rows,
        A_log=A_log,
        dt_bias=dt_bias,
        norm=norm,
        width=width,
        row_states=row_states,
    )


# New prompts of at most this many rows (padded) run as one-row steps in one launch instead of
# FLA's chunked kernels (:func:`gdn_padded`). The steps run one after another (about 1.7 us a
# row at 27B's heads on an H100): at 16 rows they beat FLA's fixed ten launches, at 32 they
# lose (BENCHMARKS.md, session 27).
RECURRENT_MAX_ROWS = 16


def gdn_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    state_pool: torch.Tensor,
    initial: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`headstart.ops.gated_delta.fla.gdn_padded`'s contract (new prompts padded to L
    rows, zero decay and beta on padding rows; final states to ``state_pool[slots]``; o [N, L,
    Hv, Dv] fp32). Up to :data:`RECURRENT_MAX_ROWS` rows and from a zero state: the decode
    step's kernel over the rows in one launch (a fresh stream per prompt; its state stays in
    registers from the first row to the last and is written to the slot once), where FLA's
    chunked form costs about ten launches a layer plus a scatter of the final states. One
    prompt of up to :data:`FRESH_CHUNK_MAX_ROWS` rows from a zero state: one fused chunk
    (:func:`gdn_fresh_chunk`, where :func:`fresh_chunk_fits`). Several prompts of one chunk
    (:func:`fresh_padded_fits`): FLA's intra-chunk solve, then our outputs and final states
    (:func:`headstart.ops.gated_delta.fla.gdn_fresh_padded`). Else FLA's."""
    N, L = q.shape[:2]
    if initial is None and fresh_chunk_fits(N, L, q.shape[3], v.shape[3]):
        return gdn_fresh_chunk(q, k, v, g, beta, slots, state_pool)
    if initial is None and fresh_padded_fits(N, L, q.shape[3], v.shape[3]):
        from headstart.ops.gated_delta.fla import gdn_fresh_padded

        return gdn_fresh_padded(q, k, v, g, beta, slots, state_pool)
    if initial is not None or L > RECURRENT_MAX_ROWS:
        from headstart.ops.gated_delta.fla import gdn_padded as chunked

        return chunked(q, k, v, g, beta, slots, state_pool, initial)
    o = gdn_decode(
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        g.flatten(0, 1),
        beta.flatten(0, 1),
        slots,
        None,  # every prompt starts from a zero state
        state_pool,
        out_dtype=torch.float32,
        width=L,
    )
    return o.view(N, L, *o.shape[1:])


# New prompts of more than RECURRENT_MAX_ROWS and at most this many rows (padded), at most
# FRESH_CHUNK_MAX_STREAMS of them, run as one fused chunk (:func:`gdn_fresh_chunk`) instead of
# FLA's launches. 27B heads on an H100, per layer (BENCHMARKS.md, session 29): 27.2 against
# FLA's 33.8 us for one 32-row prompt, 26.9 against 35.5 for 24 rows; but 315 against 184 for
# 16 prompts of 32 rows: one program per (stream, value head, Dv slice) runs the whole chunk
# on its own, while FLA spreads it over more, smaller programs.
FRESH_CHUNK_MAX_ROWS = 32
FRESH_CHUNK_MAX_STREAMS = 1


def _one_tiled_chunk(rows: int, max_rows: int, dk: int, dv: int) -> bool:
    """Rows past the one-row steps' range and within ``max_rows``, and head dims a kernel's
    tiles take (powers of two, at least ``tl.dot``'s 16)."""

    def tile(d: int) -> bool:
        return d >= 16 and d & (d - 1) == 0

    return RECURRENT_MAX_ROWS < rows <= max_rows and tile(dk) and tile(dv)


def fresh_chunk_fits(n: int, rows: int, dk: int, dv: int) -> bool:
    """Whether ``n`` new prompts padded to ``rows`` rows, with key and value heads of ``dk``
    and ``dv`` dims, take :func:`gdn_fresh_chunk` in :func:`gdn_padded`: the measured range
    above, and head dims its tiles take."""
    return n <= FRESH_CHUNK_MAX_STREAMS and _one_tiled_chunk(rows, FRESH_CHUNK_MAX_ROWS, dk, dv)


# Several new prompts of more than RECURRENT_MAX_ROWS and at most this many rows (padded) take
# FLA's intra-chunk solve and :func:`fresh_outputs` instead of FLA's whole chunked form. Why:
# from a zero state in one chunk, FLA's chunk_h stores every chunk's (zero) initial state,
# zero-fills the final states and leaves them for a scatter to the slots; at 27B, 16 prompts of
# 32 rows, FLA's form took 155.5 us a layer and this one 70.3 (H200, BENCHMARKS.md, session 36).
# Not 64 rows (one whole chunk of FLA's) yet: there the launch (64-row tile, 32 Dv columns a
# program) read or wrote out of bounds on an H200 (2 prompts x 64 rows, 27B heads), cause not
# found; at 64 Dv columns it ran clean under compute-sanitizer on an H100 (session 37), not yet
# checked on an H200 (``benchmarks/gdn_padded.py --max-rows 64 --once``). FLA's form takes those.
FRESH_PADDED_MAX_ROWS = 32


def fresh_padded_fits(n: int, rows: int, dk: int, dv: int) -> bool:
    """Whether ``n`` new prompts padded to ``rows`` rows take FLA's solve and
    :func:`fresh_outputs` in :func:`gdn_padded` (several prompts: one takes
    :func:`gdn_fresh_chunk`)."""
    return n > FRESH_CHUNK_MAX_STREAMS and _one_tiled_chunk(rows, FRESH_PADDED_MAX_ROWS, dk, dv)


def fresh_outputs(
    q: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    slots: torch.Tensor,
    state_pool: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """New prompts padded to L <= 32 rows, one chunk each, from a zero state, after the WY
    solve: q, k [N, L, Hk, Dk] L2-normalised; u [N, L, Hv, Dv] (the solved values); g [N, L,
    Hv] fp32 log2 cumulative decay within the chunk. Writes each prompt's final state
    ``(k * 2^(g_last - g))^T u`` to ``state_pool[slots]`` and returns o [N, L, Hv, Dv] in u's
    dtype, ``scale * tril(q k^T * 2^(g_i - g_j)) u``: FLA's chunk_h and chunk_o from a zero
    state, in one launch with no scatter."""
    N, L, Hk, Dk = q.shape
    Hv, Dv = u.shape[2], u.shape[3]
    if L > FRESH_PADDED_MAX_ROWS:
        raise ValueError(f"fresh_outputs takes at most {FRESH_PADDED_MAX_ROWS} rows, not {L}")
    if state_pool.dtype != torch.float32 or state_pool[0].stride() != (Dk * Dv, Dv, 1):
        raise ValueError("state_pool must be fp32 with contiguous [Hv, Dk, Dv] per slot")
    q, k, u, g = (t.contiguous() for t in (q, k, u, g))
    o = torch.empty_like(u)
    if N == 0:
        return o
    BT = max(16, triton.next_power_of_2(L))
    # At 8 warps and 27B's heads the tile does not spill (ptxas, sm_90a): 84 registers at 32
    # rows and 64 Dv columns.
    BV = min(64, Dv)
    _fresh_outputs_kernel[(N * Hv, Dv // BV)](
        q,
        k,
        u,
        g,
        o,
        slots,
        state_pool,
        L,
        scale,
        state_pool.stride(0),
        HK=Hk,
        HV=Hv,
        DK=Dk,
        DV=Dv,
        BV=BV,
        BT=BT,
        num_warps=8,
        **pdl_options(u.device),
    )
    return o


def gdn_fresh_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    state_pool: torch.Tensor,
) -> torch.Tensor:
    """:func:`gdn_padded`'s contract for new prompts of at most 32 rows from a zero state, in
    one launch: each (stream, value head, Dv slice) program solves its rows as one chunk
    (two 16-row blocks) with matmuls, writes o and the final state to its slot. Where FLA
    spends about ten launches, zero fills and a scatter of the final states. o [N, L, Hv, Dv]
    fp32."""
    N, L, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if L > 32:
        raise ValueError(f"gdn_fresh_chunk takes at most 32 rows, not {L}")
    if state_pool.dtype != torch.float32 or state_pool[0].stride() != (Dk * Dv, Dv, 1):
        raise ValueError("state_pool must be fp32 with contiguous [Hv, Dk, Dv] per slot")
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o = torch.empty(N, L, Hv, Dv, dtype=torch.float32, device=v.device)
    if N == 0:
        return o
    BV = min(32, Dv)
    _fresh_chunk_kernel[(N * Hv, Dv // BV)](
        q,
        k,
        v,
        g,
        beta,
        o,
        slots,
        state_pool,
        L,
        state_pool.stride(0),
        HK=Hk,
        HV=Hv,
        DK=Dk,
        DV=Dv,
        BV=BV,
        B=16,
        num_warps=8,  # 4 warps: 255 registers and a stack (ptxas, sm_90a)
        **pdl_options(v.device),
    )
    return o
