"""One Triton kernel for each piece of :mod:`headstart.ops.pointwise.reference` (same signatures).

Why: a profile of the 27B decode step on an H200 (``benchmarks/profile_decode.py``) had 3,842
kernel launches per step, 3,473 of them elementwise ops, gathers and copies between the matmuls:
5.9 ms of kernel time plus 1.6 ms of gaps, against a 12.1 ms bf16 floor. Fusing each norm, gate and
conv step into one kernel (reading its rows by index, writing states in place) leaves about ten
launches per layer.

Rounding follows the references: values are rounded to the activation dtype wherever the
reference materialises a bf16 tensor, except inside the conv step and RoPE, where products are
kept in fp32 (the reference rounds each product; the difference is within one bf16 ulp of the
result). Tests: ``tests/test_fused_ops.py`` (compiled on a GPU, else under Triton's CPU
interpreter when Triton is installed).

Non-goals: autograd; fp32 activations are supported but not tuned.
"""

from __future__ import annotations

import torch

from headstart.ops.triton_support import HAVE_TRITON, pdl_options, tl, triton

if HAVE_TRITON:
    from headstart.ops.triton_support import pdl_wait

if HAVE_TRITON:

    @triton.jit
    def _round(x, DT: tl.constexpr):
        """fp32 -> the activation dtype -> fp32, as materialising a tensor of that dtype does."""
        return x.to(DT).to(tl.float32)

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr,
        r_ptr,
        s_ptr,
        sum_ptr,
        y_ptr,
        D,
        stride_x,
        stride_r,
        stride_sum,
        stride_y,
        eps,
        HAS_RES: tl.constexpr,
        BD: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_wait(PDL)  # every input is written by an earlier kernel
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BD)
        m = d < D
        x = tl.load(x_ptr + row * stride_x + d, mask=m, other=0.0)
        DT: tl.constexpr = x.dtype
        x = x.to(tl.float32)
        if HAS_RES:
            x = _round(
                x + tl.load(r_ptr + row * stride_r + d, mask=m, other=0.0).to(tl.float32), DT
            )
            tl.store(sum_ptr + row * stride_sum + d, x.to(DT), mask=m)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
        s = tl.load(s_ptr + d, mask=m, other=0.0)
        tl.store(y_ptr + row * stride_y + d, (x * rstd * s).to(DT), mask=m)

    @triton.jit
    def _gated_rms_norm_kernel(
        x_ptr,
        z_ptr,
        zrow_ptr,
        w_ptr,
        y_ptr,
        H,
        stride_x,
        stride_z,
        stride_y,
        eps,
        D: tl.constexpr,
        BH: tl.constexpr,
        BD: tl.constexpr,
        Z_ROWS: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_wait(PDL)  # every input is written by an earlier kernel
        row = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BH)
        d = tl.arange(0, BD)
        m = (h < H)[:, None] & (d < D)[None, :]
        off = h[:, None] * D + d[None, :]
        x = tl.load(x_ptr + row * stride_x + off, mask=m, other=0.0)
        DT: tl.constexpr = x.dtype
        x = x.to(tl.float32)
        n = _round(x * tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None], DT)
        w = _round(tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32), DT)
        y = _round(w[None, :] * n, DT)
        zrow = row
        if Z_ROWS:
            zrow = tl.load(zrow_ptr + row).to(tl.int64)
        z = tl.load(z_ptr + zrow * stride_z + off, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + off, (y * (z * tl.sigmoid(z))).to(DT), mask=m)

    @triton.jit
    def _silu_mul_kernel(
        gu_ptr, y_ptr, N, stride_gu, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr = False
    ):
        pdl_wait(PDL)  # every input is written by an earlier kernel
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < N
        g = tl.load(gu_ptr + row * stride_gu + c, mask=m, other=0.0)
        DT: tl.constexpr = g.dtype
        g = g.to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + N + c, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + c, (_round(g * tl.sigmoid(g), DT) * u).to(DT), mask=m)

    @triton.jit
    def _sigmoid_mul_kernel(
        x_ptr,
        g_ptr,
        y_ptr,
        F,
        HD,
        stride_x,
        stride_gr,
        stride_gh,
        stride_y,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_wait(PDL)  # every input is written by an earlier kernel
        # gate [T, F] given as [T, F / HD, HD] strides: a per-head view of the projection.
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < F
        x = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0)
        DT: tl.constexpr = x.dtype
        g = tl.load(g_ptr + row * stride_gr + (c // HD) * stride_gh + c % HD, mask=m, other=0.0).to(
            tl.float32
        )
        tl.store(
            y_ptr + row * stride_y + c,
            (x.to(tl.float32) * _round(tl.sigmoid(g), DT)).to(DT),
            mask=m,
        )

    @triton.jit
    def _gdn_gates_kernel(
        a_ptr,
        b_ptr,
        a_log_ptr,
        dt_bias_ptr,
        g_ptr,
        beta_ptr,
        H,
        stride_a,
        stride_b,
        valid_ptr,
        BLOCK: tl.constexpr,
        VALID: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        pdl_wait(PDL)  # a and b are written by the projection before this
        # One row of every value head: g = -exp(A_log) * softplus(a + dt_bias) (fp32), beta =
        # sigmoid(b) in b's dtype; the reference's seven elementwise launches in one.
        row = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK)
        m = h < H
        a = tl.load(a_ptr + row * stride_a + h, mask=m, other=0.0).to(tl.float32)
        x = a + tl.load(dt_bias_ptr + h, mask=m, other=0.0).to(tl.float32)
        u = tl.exp(x)
        # softplus as torch computes it (x above its threshold 20: x; else log1p(exp(x))), with
        # log1p(u) by its series for small u, where log(1 + u) would lose u's low bits (plain
        # Triton has no log1p): four terms leave < 2e-6 relative below 0.05.
        series = u * (1.0 - u * (0.5 - u * (1.0 / 3.0 - 0.25 * u)))
        log1p = tl.where(u < 0.05, series, tl.log(1.0 + u))
        softplus = tl.where(x > 20.0, x, log1p)
        a_log = tl.load(a_log_ptr + h, mask=m, other=0.0)
        decay = tl.exp(a_log.to(tl.float32)).to(a_log.dtype).to(tl.float32)  # exp in A_log's dtype
        g = -decay * softplus
        b = tl.load(b_ptr + row * stride_b + h, mask=m, other=0.0)
        beta = tl.sigmoid(b.to(tl.float32))
        if VALID:  # a padding row: no decay, no update
            keep = tl.load(valid_ptr + row) != 0
            g = tl.where(keep, g, 0.0)
            beta = tl.where(keep, beta, 0.0)
        tl.store(g_ptr + row * H + h, g, mask=m)
        tl.store(beta_ptr + row * H + h, beta.to(b.dtype), mask=m)

    @triton.jit
    def _conv_step_kernel(
        x_ptr,
        rows_ptr,
        w_ptr,
        tail_ptr,
        slot_ptr,
        fresh_ptr,
        y_ptr,
        row_tail_ptr,
        C,
        stride_x,
        stride_slot,
        stride_y,
        stride_rt_n,
        stride_rt_t,
        K: tl.constexpr,
        KP: tl.constexpr,
        BC: tl.constexpr,
        W: tl.constexpr = 1,
        ROW_TAILS: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        pdl_wait(PDL)  # every input is written by an earlier kernel
        i = tl.program_id(0)  # stream; its rows are rows[i * W ..], in order
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        j = tl.arange(0, KP)
        cm = c < C
        slot = tl.load(slot_ptr + i).to(tl.int64)
        keep = tl.load(fresh_ptr + i) == 0
        t_ptrs = tail_ptr + slot * stride_slot + c[:, None] * (K - 1)
        w = tl.load(
            w_ptr + c[:, None] * K + j[None, :], mask=cm[:, None] & (j[None, :] < K), other=0.0
        )
        DT: tl.constexpr = y_ptr.dtype.element_ty
        for t in tl.static_range(W):
            # Row t's window [BC, KP]: column j holds input t - (K-1) + j, one of this call's
            # rows when that is >= 0, else column t + j of the tail the stream came with (zeros
            # for a fresh stream: never read). The same tile, product and sum at any W, so a
            # window row computes exactly what a one-row step computes.
            y_row = _conv_window(
                x_ptr, rows_ptr, t_ptrs, i, c, cm, j, keep, stride_x, t - (K - 1), K, K, W
            )
            acc = _round(tl.sum(y_row.to(tl.float32) * w.to(tl.float32), 1), DT)
            tl.store(y_ptr + (i * W + t) * stride_y + c, (acc * tl.sigmoid(acc)).to(DT), mask=cm)
            if ROW_TAILS:  # the tail after row t: inputs t - (K-2) .. t
                after = _conv_window(
                    x_ptr, rows_ptr, t_ptrs, i, c, cm, j, keep, stride_x, t - (K - 2), K - 1, K, W
                )
                r_ptrs = row_tail_ptr + i * stride_rt_n + t * stride_rt_t
                r_ptrs += c[:, None] * (K - 1) + j[None, :]
                tl.store(
                    r_ptrs,
                    after.to(row_tail_ptr.dtype.element_ty),
                    mask=cm[:, None] & (j[None, :] < K - 1),
                )
        # The new tail: inputs W - (K-1) .. W - 1 (every load above came from the old one).
        nxt = _conv_window(
            x_ptr, rows_ptr, t_ptrs, i, c, cm, j, keep, stride_x, W - (K - 1), K - 1, K, W
        )
        tl.store(
            t_ptrs + j[None, :],
            nxt.to(tail_ptr.dtype.element_ty),
            mask=cm[:, None] & (j[None, :] < K - 1),
        )

    @triton.jit
    def _conv_window(x_ptr, rows_ptr, t_ptrs, i, c, cm, j, keep, stride_x, first, COLS, K, W):
        """[BC, KP]: column j < COLS is input ``first + j`` of stream i: its row of x when
        that is >= 0, else column ``first + j + K - 1`` of the stream's old tail; the other
        columns are zero (a tail has K-1 columns: its next input is not this call's)."""
        src = first + j  # [KP]
        from_x = (src >= 0) & (j < COLS)
        # Addresses clamped into their buffers even where masked (Triton's CPU interpreter
        # dereferences them).
        row = tl.load(rows_ptr + i * W + tl.maximum(src, 0), mask=from_x, other=0).to(tl.int64)
        x = tl.load(
            x_ptr + row[None, :] * stride_x + c[:, None],
            mask=cm[:, None] & from_x[None, :],
            other=0.0,
        )
        old = tl.load(
            t_ptrs + tl.where(src < 0, src + K - 1, 0)[None, :],
            mask=cm[:, None] & ((src < 0) & (j < COLS))[None, :] & keep,
            other=0.0,
        )
        return tl.where(from_x[None, :], x, old)

    @triton.jit
    def _attn_inputs_kernel(
        qkv_ptr,
        rows_ptr,
        qs_ptr,
        ks_ptr,
        inv_ptr,
        k_pool,
        v_pool,
        slot_ptr,
        pos_ptr,
        q_out,
        stride_qkv,
        stride_ks,
        stride_kh,
        stride_kt,
        stride_vs,
        stride_vh,
        stride_vt,
        stride_qn,
        stride_qh,
        eps,
        NH: tl.constexpr,
        NKV: tl.constexpr,
        HD: tl.constexpr,
        RD: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_wait(PDL)  # every input is written by an earlier kernel
        i = tl.program_id(0)
        h = tl.program_id(1)  # 0..NH-1: query heads; NH..NH+NKV-1: key/value heads
        row = tl.load(rows_ptr + i).to(tl.int64)
        slot = tl.load(slot_ptr + i).to(tl.int64)
        pos = tl.load(pos_ptr + i)
        d = tl.arange(0, HD)
        HALF: tl.constexpr = RD // 2
        partner = tl.where(d < HALF, d + HALF, tl.where(d < RD, d - HALF, d))
        is_q = h < NH
        if is_q:
            base = qkv_ptr + row * stride_qkv + h * (2 * HD)
            s_ptr = qs_ptr
        else:
            hk = h - NH
            base = qkv_ptr + row * stride_qkv + 2 * NH * HD + hk * HD
            s_ptr = ks_ptr
        raw = tl.load(base + d)
        DT: tl.constexpr = raw.dtype
        x = raw.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / HD + eps)
        n = _round(x * rstd * tl.load(s_ptr + d), DT)
        pn = _round(tl.load(base + partner).to(tl.float32) * rstd * tl.load(s_ptr + partner), DT)
        ang = pos.to(tl.float32) * tl.load(inv_ptr + d % HALF, mask=d < RD, other=0.0)
        cos = _round(tl.cos(ang), DT)
        sin = _round(tl.sin(ang), DT)
        rot = _round(_round(n * cos, DT) + _round(tl.where(d < HALF, -pn, pn) * sin, DT), DT)
        out = tl.where(d < RD, rot, n).to(DT)
        if is_q:
            tl.store(q_out + i * stride_qn + h * stride_qh + d, out)
        else:
            hk = h - NH
            tl.store(k_pool + slot * stride_ks + hk * stride_kh + pos * stride_kt + d, out)
            v = tl.load(base + NKV * HD + d)  # the value head sits NKV heads further on
            tl.store(v_pool + slot * stride_vs + hk * stride_vh + pos * stride_vt + d, v)

    @triton.jit
    def _qk_norm_rope_kernel(
        qkv_ptr,
        w_ptr,
        inv_ptr,
        start_ptr,
        stride_qkv,
        eps,
        BLOCK: tl.constexpr,
        HD: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        pdl_wait(PDL)  # the projection comes from the matmul before
        t = tl.program_id(0).to(tl.int64)  # row b = t % BLOCK of stream t // BLOCK
        h = tl.program_id(1)  # a q head, then the k heads
        d = tl.arange(0, HD)
        HALF: tl.constexpr = HD // 2
        partner = (d + HALF) % HD
        base = qkv_ptr + t * stride_qkv + h * HD
        raw = tl.load(base + d)
        DT: tl.constexpr = raw.dtype
        x = raw.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / HD + eps)
        n = _round(x * rstd * tl.load(w_ptr + h * HD + d), DT)
        pn = _round(
            tl.load(base + partner).to(tl.float32) * rstd * tl.load(w_ptr + h * HD + partner), DT
        )
        pos = tl.load(start_ptr + t // BLOCK) + t % BLOCK
        ang = pos.to(tl.float32) * tl.load(inv_ptr + d % HALF)
        cos = _round(tl.cos(ang), DT)
        sin = _round(tl.where(d < HALF, -tl.sin(ang), tl.sin(ang)), DT)
        # As the reference's addcmul: x cos rounded, the sin product not.
        tl.store(base + d, (_round(n * cos, DT) + pn * sin).to(DT))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = _rows(x)
    T, D = x.shape
    y = torch.empty_like(x)
    if T == 0:
        return x, y
    has_res = residual is not None
    r = _rows(residual) if has_res else x  # x stands in for the absent residual (unread)
    out = torch.empty_like(x) if has_res else x
    BD = triton.next_power_of_2(D)
    _add_rms_norm_kernel[(T,)](
        x,
        r,
        scale,
        out,
        y,
        D,
        x.stride(0),
        r.stride(0),
        out.stride(0),
        y.stride(0),
        eps,
        HAS_RES=has_res,
        BD=BD,
        num_warps=8 if BD >= 4096 else 4,
        **pdl_options(x.device),
    )
    return out, y


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    T, H, D = x.shape
    x = x if x.stride(2) == 1 and x.stride(1) == D else x.contiguous()
    if gate.stride(2) != 1 or gate.stride(1) != D:
        gate = gate.contiguous()
    y = torch.empty(T, H * D, dtype=x.dtype, device=x.device)
    if T:
        rows = gate_rows if gate_rows is not None else y  # y stands in (unread)
        _gated_rms_norm_kernel[(T,)](
            x,
            gate,
            rows,
            weight,
            y,
            H,
            x.stride(0),
            gate.stride(0),
            y.stride(0),
            eps,
            D=D,
            BH=triton.next_power_of_2(H),
            BD=triton.next_power_of_2(D),
            Z_ROWS=gate_rows is not None,
            num_warps=8,
            **pdl_options(x.device),
        )
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = _rows(gate_up)
    T, N2 = gate_up.shape
    N = N2 // 2
    y = torch.empty(T, N, dtype=gate_up.dtype, device=gate_up.device)
    if T:
        BLOCK = 2048
        _silu_mul_kernel[(T, triton.cdiv(N, BLOCK))](
            gate_up,
            y,
            N,
            gate_up.stride(0),
            y.stride(0),
            BLOCK=BLOCK,
            num_warps=4,
            **pdl_options(y.device),
        )
    return y


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, F] contiguous rows; gate [T, H, HD] (a per-head view) or [T, F]."""
    x = _rows(x)
    T, F = x.shape
    g3 = gate if gate.dim() == 3 else gate.reshape(T, 1, F)
    if g3.stride(2) != 1:
        g3 = g3.contiguous()
    y = torch.empty_like(x)
    if T:
        BLOCK = 1024
        _sigmoid_mul_kernel[(T, triton.cdiv(F, BLOCK))](
            x,
            g3,
            y,
            F,
            g3.shape[2],
            x.stride(0),
            g3.stride(0),
            g3.stride(1),
            y.stride(0),
            BLOCK=BLOCK,
            num_warps=4,
            **pdl_options(y.device),
        )
    return y


def gdn_gates(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, Hv] (row-strided views of the projection) -> (g fp32, beta in b's dtype);
    ``valid`` [T] bool: zero on its False rows."""
    a, b = _rows(a), _rows(b)
    T, H = a.shape
    g = torch.empty(T, H, dtype=torch.float32, device=a.device)
    beta = torch.empty(T, H, dtype=b.dtype, device=b.device)
    if T:
        _gdn_gates_kernel[(T,)](
            a,
            b,
            A_log,
            dt_bias,
            g,
            beta,
            H,
            a.stride(0),
            b.stride(0),
            g if valid is None else valid.view(torch.uint8),
            BLOCK=triton.next_power_of_2(H),
            VALID=valid is not None,
            num_warps=1,
            **pdl_options(a.device),
        )
    return g, beta


def conv_step_rows(
    mixed: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    tails: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    width: int = 1,
    row_tails: torch.Tensor | None = None,
) -> torch.Tensor:
    mixed, rows = _rows(mixed), rows.contiguous()
    n = slots.shape[0]
    C, K = weight.shape
    if tails.stride(2) != 1 or tails.stride(1) != K - 1 or weight.stride() != (K, 1):
        raise ValueError("conv tails need contiguous [C, K-1] per slot and weight [C, K]")
    if row_tails is not None and row_tails[0, 0].stride() != (K - 1, 1):
        raise ValueError("row_tails must be [n, width, C, K-1], each row's [C, K-1] dense")
    y = torch.empty(n * width, C, dtype=mixed.dtype, device=mixed.device)
    if n:
        BC = 256
        _conv_step_kernel[(n, triton.cdiv(C, BC))](
            mixed,
            rows,
            weight,
            tails,
            slots,
            fresh.view(torch.uint8),
            y,
            tails if row_tails is None else row_tails,
            C,
            mixed.stride(0),
            tails.stride(0),
            y.stride(0),
            *(row_tails.stride()[:2] if row_tails is not None else (0, 0)),
            K=K,
            KP=triton.next_power_of_2(K),
            BC=BC,
            W=width,
            ROW_TAILS=row_tails is not None,
            num_warps=4,
            **pdl_options(y.device),
        )
    return y


def attn_decode_inputs(
    qkv: torch.Tensor,
    rows: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    qkv = _rows(qkv)
    n = rows.shape[0]
    hd = keys.shape[-1]
    rd = 2 * inv_freq.shape[0]
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys/values need a contiguous head dimension")
    q = torch.empty(n, num_heads, hd, dtype=qkv.dtype, device=qkv.device)
    if n:
        _attn_inputs_kernel[(n, num_heads + num_kv_heads)](
            qkv,
            rows,
            q_scale,
            k_scale,
            inv_freq,
            keys,
            values,
            slots,
            positions,
            q,
            qkv.stride(0),
            keys.stride(0),
            keys.stride(1),
            keys.stride(2),
            values.stride(0),
            values.stride(1),
            values.stride(2),
            q.stride(0),
            q.stride(1),
            eps,
            NH=num_heads,
            NKV=num_kv_heads,
            HD=hd,
            RD=rd,
            num_warps=2,
            **pdl_options(q.device),
        )
    return q


def qk_norm_rope(
    qkv: torch.Tensor,
    num_q: int,
    num_k: int,
    weight: torch.Tensor,
    inv_freq: torch.Tensor,
    starts: torch.Tensor,
    block: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch, the q and k heads normed and rotated in place in ``qkv`` (which must be
    row-contiguous); returns views of them."""
    T, hd = qkv.shape[0], weight.shape[-1]
    assert qkv.stride(-1) == 1, "qkv rows must be contiguous"
    if T:
        _qk_norm_rope_kernel[(T, num_q + num_k)](
            qkv,
            weight,
            inv_freq,
            starts,
            qkv.stride(0),
            eps,
            BLOCK=block,
            HD=hd,
            num_warps=1 if hd <= 128 else 2,
            **pdl_options(qkv.device),
        )
    heads = qkv.view(T, -1, hd)
    return heads[:, :num_q], heads[:, num_q : num_q + num_k]
