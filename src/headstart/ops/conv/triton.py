"""The GDN's causal depthwise convolution of prefill rows in two Triton kernels (GPU).

Same signatures and results as :mod:`headstart.ops.conv.reference`'s multi-row functions
(:func:`causal_conv`, :func:`causal_conv_upto`, :func:`causal_conv_padded`,
:func:`causal_conv_spans`): silu(conv) of every row, and each span's new tail (the ``K - 1``
pre-convolution rows ending at its last real row). Rows past a span's real rows come out as
garbage there and here alike.

Why: the references build a window with ``torch.cat`` (or a gather of rows and tails), run
PyTorch's depthwise ``conv1d`` and slice the result: three to five kernels a layer and copies of
every row. A 27B prefill forward spent 2.6 ms in the convolution and 1.96 ms in ``torch.cat`` over
its 48 GDN layers (BENCHMARKS.md, session 11), for work that reads and writes each row once. Here
one kernel reads a row's ``K - 1`` predecessors straight from ``x`` or from its span's tail, and a
second writes the new tails; no host values are read (graph-capturable).

Rounding: the sum of the ``K`` products is kept in fp32 and rounded once to x's dtype before the
silu, as the reference's bf16 ``conv1d`` output is (its accumulation order may differ by an ulp);
tails are rounded to x's dtype first, as the reference's ``tail.to(x.dtype)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from headstart.ops.triton_support import HAVE_TRITON, pdl_options, tl, triton

if HAVE_TRITON:
    from headstart.ops.triton_support import pdl_wait

    @triton.jit
    def _span_of(r, cu_ptr, n, L, UNIFORM: tl.constexpr, NP: tl.constexpr):
        """Index and first row of the span holding each row ``r``: spans of ``L`` rows each
        (UNIFORM), or the ``n`` spans of offsets ``cu`` (``NP`` >= n, a power of two: the count
        of span ends at or before each row)."""
        if UNIFORM:
            j = r // L
        else:
            e = tl.arange(0, NP)
            ends = tl.load(cu_ptr + 1 + e, mask=e < n - 1, other=2147483647)  # not the last
            j = tl.sum((ends[None, :] <= r[:, None]).to(tl.int32), 1)
        if UNIFORM:
            start = j * L
        else:
            start = tl.load(cu_ptr + j)
        return j, start

    @triton.jit
    def _conv_rows_kernel(
        x_ptr,
        w_ptr,
        tail_ptr,
        cu_ptr,
        y_ptr,
        T,
        C,
        L,
        n,
        stride_x,
        stride_tn,
        stride_y,
        KD,
        K: tl.constexpr,
        BT: tl.constexpr,
        BC: tl.constexpr,
        UNIFORM: tl.constexpr,
        HAS_TAILS: tl.constexpr,
        NP: tl.constexpr,
        SPLIT: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        """Rows [pid_t*BT, +BT) x channels [pid_c*BC, +BC): silu(sum_i w[c, i] in(r - K+1 + i)),
        ``in`` a row of x inside the row's span, else its span's tail (zeros without tails).
        SPLIT: y is three dense row-major blocks, channels [0, KD), [KD, 2 KD), [2 KD, C)."""
        pdl_wait(PDL)  # x is written by the kernel before
        r = tl.program_id(0) * BT + tl.arange(0, BT)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        rm = r < T
        cm = c < C
        j, start = _span_of(r, cu_ptr, n, L, UNIFORM, NP)
        DT: tl.constexpr = x_ptr.dtype.element_ty
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for i in tl.static_range(K):
            src = r - (K - 1) + i
            inx = src >= start
            v = tl.load(
                x_ptr + src.to(tl.int64)[:, None] * stride_x + c[None, :],
                mask=(rm & inx)[:, None] & cm[None, :],
                other=0.0,
            ).to(tl.float32)
            if HAS_TAILS:
                # src is at most K-1 rows before its span: tail column K-1 - (start - src).
                t = tl.load(
                    tail_ptr
                    + j.to(tl.int64)[:, None] * stride_tn
                    + c[None, :] * (K - 1)
                    + (K - 1 - start + src)[:, None],
                    mask=(rm & ~inx)[:, None] & cm[None, :],
                    other=0.0,
                )
                v = tl.where(inx[:, None], v, t.to(DT).to(tl.float32))
            w = tl.load(w_ptr + c * K + i, mask=cm, other=0.0).to(DT).to(tl.float32)
            acc += v * w[None, :]
        acc = acc.to(DT).to(tl.float32)
        r64 = r.to(tl.int64)[:, None]
        if SPLIT:
            c64 = c.to(tl.int64)[None, :]
            part = (c64 >= KD).to(tl.int64) + (c64 >= 2 * KD).to(tl.int64)  # q, k or v
            width = tl.where(part == 2, C - 2 * KD, KD)
            y_off = part * T * KD + r64 * width + (c64 - part * KD)
        else:
            y_off = r64 * stride_y + c[None, :]
        tl.store(y_ptr + y_off, (acc * tl.sigmoid(acc)).to(DT), mask=rm[:, None] & cm[None, :])

    @triton.jit
    def _conv_tails_kernel(
        x_ptr,
        tail_ptr,
        cu_ptr,
        len_ptr,
        out_ptr,
        slot_ptr,
        C,
        L,
        stride_x,
        stride_tn,
        stride_out,
        K: tl.constexpr,
        KP: tl.constexpr,
        BC: tl.constexpr,
        UNIFORM: tl.constexpr,
        HAS_TAILS: tl.constexpr,
        HAS_LENS: tl.constexpr,
        SLOTTED: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        """Span ``pid_s``'s new tail [C, K-1]: the K-1 pre-convolution rows ending at its last
        real row, from x, and from its old tail where the span is shorter than K-1; written to
        entry ``s`` of out, or to entry ``slot[s]`` (SLOTTED: a pool's slot)."""
        pdl_wait(PDL)
        s = tl.program_id(0)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        i = tl.arange(0, KP)
        cm = c < C
        if UNIFORM:
            start = s * L
            end = start + L
        else:
            start = tl.load(cu_ptr + s)
            end = tl.load(cu_ptr + s + 1)
        if HAS_LENS:
            end = start + tl.load(len_ptr + s)
        src = end - (K - 1) + i
        ok = i < K - 1
        inx = src >= start
        v = tl.load(
            x_ptr + src.to(tl.int64)[None, :] * stride_x + c[:, None],
            mask=cm[:, None] & (ok & inx)[None, :],
            other=0.0,
        )
        if HAS_TAILS:
            t = tl.load(
                tail_ptr
                + s.to(tl.int64) * stride_tn
                + c[:, None] * (K - 1)
                + (K - 1 - start + src)[None, :],
                mask=cm[:, None] & (ok & ~inx)[None, :],
                other=0.0,
            )
            v = tl.where(inx[None, :], v, t.to(v.dtype))
        if SLOTTED:
            dst = tl.load(slot_ptr + s).to(tl.int64)
        else:
            dst = s.to(tl.int64)
        tl.store(
            out_ptr + dst * stride_out + c[:, None] * (K - 1) + i[None, :],
            v.to(out_ptr.dtype.element_ty),
            mask=cm[:, None] & ok[None, :],
        )


_BT, _BC, _TAIL_BC = 16, 128, 128


def _conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    tails: torch.Tensor | None,
    n: int,
    span_rows: int,
    cu: torch.Tensor | None,
    lengths: torch.Tensor | None,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
    split: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, C] rows of ``n`` spans (offsets ``cu``, or ``span_rows`` rows each when ``cu`` is
    None); tails [n, C, K-1] or None (zeros); lengths [n] real rows (any integer dtype: read as
    it is, no conversion launch) or None (all). ``into = (pool, slots)``: the new tails go to
    ``pool[slots]`` (None is returned for them); ``split = KD``: y's channels [0, KD), [KD,
    2 KD) and [2 KD, C) as three dense row-major blocks one after another (y flat)."""
    T, C = x.shape
    K = weight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    if tails is not None and (tails.stride(2) != 1 or tails.stride(1) != K - 1):
        tails = tails.contiguous()
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if split is not None:
        y = y.view(-1)
    if into is None:
        new_tails = torch.empty(n, C, K - 1, dtype=x.dtype, device=x.device)
    else:
        new_tails, slots = into
        if new_tails.stride(2) != 1 or new_tails.stride(1) != K - 1:
            raise ValueError("the tails pool needs contiguous [C, K-1] per slot")
    dummy = y  # never read: pointer arguments of the disabled modes
    uniform = cu is None
    stride_tn = tails.stride(0) if tails is not None else 0
    if T:
        _conv_rows_kernel[(triton.cdiv(T, _BT), triton.cdiv(C, _BC))](
            x,
            weight,
            tails if tails is not None else dummy,
            cu if cu is not None else dummy,
            y,
            T,
            C,
            span_rows,
            n,
            x.stride(0),
            stride_tn,
            C if split is not None else y.stride(0),
            split or 0,
            K=K,
            BT=_BT,
            BC=_BC,
            UNIFORM=uniform,
            HAS_TAILS=tails is not None,
            SPLIT=split is not None,
            # One compile for every step of up to 65 spans (padded prompts: unused)
            NP=2 if uniform else max(64, triton.next_power_of_2(n)),
            num_warps=4,
            **pdl_options(x.device),
        )
    if n:
        _conv_tails_kernel[(n, triton.cdiv(C, _TAIL_BC))](
            x,
            tails if tails is not None else dummy,
            cu if cu is not None else dummy,
            lengths if lengths is not None else dummy,
            new_tails,
            slots if into is not None else dummy,
            C,
            span_rows,
            x.stride(0),
            stride_tn,
            new_tails.stride(0),
            K=K,
            KP=triton.next_power_of_2(K - 1),
            BC=_TAIL_BC,
            UNIFORM=uniform,
            HAS_TAILS=tails is not None,
            HAS_LENS=lengths is not None,
            SLOTTED=into is not None,
            num_warps=4,
            **pdl_options(x.device),
        )
    return y, (new_tails if into is None else None)


def causal_conv(
    x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`headstart.ops.conv.reference.causal_conv` (one span, its tail [C, K-1])."""
    y, new = _conv(x, weight, tail[None], 1, x.shape[0], None, None)
    return y, new[0]


def causal_conv_upto(
    x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor, length: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`headstart.ops.conv.reference.causal_conv_upto` (``length``: a [1] tensor)."""
    y, new = _conv(x, weight, tail[None], 1, x.shape[0], None, length)
    return y, new[0]


def causal_conv_padded(
    x: torch.Tensor,
    lengths: torch.Tensor,
    weight: torch.Tensor,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
    split: int | None = None,
) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor | None]:
    """:func:`headstart.ops.conv.reference.causal_conv_padded` (x [n, L, C], zero tails)."""
    n, L, C = x.shape
    y, new = _conv(x.reshape(n * L, C), weight, None, n, L, None, lengths, into, split)
    if split is None:
        return y.view(n, L, C), new
    T = n * L
    q, k, v = y.split([T * split, T * split, T * (C - 2 * split)])
    return (q.view(n, L, split), k.view(n, L, split), v.view(n, L, C - 2 * split)), new


def causal_conv_spans(
    x: torch.Tensor,
    tails: torch.Tensor,
    weight: torch.Tensor,
    plan: Callable[[], tuple[torch.Tensor, ...]],
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`headstart.ops.conv.reference.causal_conv_spans`, the spans given by their
    offsets ``cu_seqlens`` [n+1] (int32, on x's device; ``plan`` is not needed)."""
    return _conv(x, weight, tails, tails.shape[0], 0, cu_seqlens, None)
