"""Causal depthwise convolution over the GDN projection, continuing from a per-stream tail.

The tail holds the last ``K - 1`` *pre-convolution* rows of earlier calls (zeros for a fresh
stream), so a prompt can be fed in any number of pieces with identical results.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def causal_conv(
    x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. x: [T, C]; tail: [C, K-1]; weight: [C, K] (``weight[:, K-1]`` hits the
    current row). Returns (silu(conv) [T, C], new tail [C, K-1])."""
    T = x.shape[0]
    window = torch.cat([tail.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K-1+T]
    y = F.conv1d(window.unsqueeze(0), weight.to(x.dtype).unsqueeze(1), groups=x.shape[1])[0]
    new_tail = window[:, -tail.shape[1] :]
    return F.silu(y[:, -T:]).transpose(0, 1), new_tail


def causal_conv_upto(
    x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor, length: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv` of one sequence whose rows are padded: its real rows are the first
    ``length`` (a [1] tensor, >= 1) of x's. Tensor ops only (graph-capturable). Returns
    (silu(conv) [T, C], the tail [C, K-1] ending at the last real row). Padding rows come out
    as garbage; the real rows never see them (the convolution is causal)."""
    y, new_tail = causal_conv_upto_each(x[None], tail[None], weight, length)
    return y[0], new_tail[0]


def causal_conv_upto_each(
    x: torch.Tensor, tails: torch.Tensor, weight: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv_upto` of ``n`` sequences at once, each from its own tail: x [n, T, C],
    tails [n, C, K-1], lengths [n] (each >= 1). Returns (silu(conv) [n, T, C], the tails
    [n, C, K-1] ending at each sequence's last real row)."""
    n, k1 = x.shape[0], tails.shape[-1]
    window = torch.cat([tails.to(x.dtype), x.transpose(1, 2)], dim=2)  # [n, C, K-1+T]
    y = F.conv1d(window, weight.to(x.dtype).unsqueeze(1), groups=x.shape[2])
    # Column K-1+i holds row i, so the K-1 columns ending at row length-1 start at `length`.
    cols = (lengths[:, None] + torch.arange(k1, device=x.device))[:, None, :]
    new_tails = window.gather(2, cols.expand(n, window.shape[1], k1))
    return F.silu(y).transpose(1, 2), new_tails


def conv_spans_plan(lengths: list[int], k1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host index tensors of :func:`causal_conv_spans` for spans of ``lengths`` rows and tails
    of ``k1`` rows: (ext_index, out_index, tail_index).

    The extended sequence E holds, span after span, the span's tail rows then its own rows, so
    that one convolution over E computes every span's rows from its own tail (a window never
    reaches back into the span before). E's rows are picked from ``cat([x, tails])`` (x's rows
    first, then each span's tail rows); the output of span row i is convolution output
    ``start_of_its_segment + i``; the new tail is the segment's last ``k1`` rows."""
    total = sum(lengths)
    ext: list[int] = []
    out: list[int] = []
    tail: list[int] = []
    row = pos = 0
    for s, n in enumerate(lengths):
        ext.extend(range(total + s * k1, total + (s + 1) * k1))
        ext.extend(range(row, row + n))
        out.extend(range(pos, pos + n))
        tail.extend(range(pos + n, pos + n + k1))
        row += n
        pos += k1 + n
    return (
        torch.tensor(ext, dtype=torch.int64),
        torch.tensor(out, dtype=torch.int64),
        torch.tensor(tail, dtype=torch.int64),
    )


def causal_conv_spans(
    x: torch.Tensor,
    tails: torch.Tensor,
    weight: torch.Tensor,
    plan: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv` for several sequences at once, in a fixed number of kernels (a loop
    over spans costs a few launches each: a burst of 16 prompts paid ~100 a GDN layer).

    x: [T, C], the spans' rows one span after the other; tails: [n, C, K-1] (zeros for a fresh
    stream); weight: [C, K]; plan: returns :func:`conv_spans_plan` of the span lengths, on x's
    device (called only by implementations that index with it, as this one); cu_seqlens: the
    same spans as offsets [n+1] (int32, on x's device; for kernels that read those instead).
    Returns (silu(conv) [T, C], new tails [n, C, K-1]), row for row what :func:`causal_conv`
    gives each span (the same depthwise convolution, over a longer sequence)."""
    ext_index, out_index, tail_index = plan()
    n, C, k1 = tails.shape
    src = torch.cat([x, tails.to(x.dtype).transpose(1, 2).reshape(n * k1, C)])
    ext = src.index_select(0, ext_index)  # [T + n (K-1), C]
    y = F.conv1d(ext.transpose(0, 1).unsqueeze(0), weight.to(x.dtype).unsqueeze(1), groups=C)[0]
    out = F.silu(y.index_select(1, out_index)).transpose(0, 1)
    new_tails = ext.index_select(0, tail_index).view(n, k1, C).transpose(1, 2)
    return out, new_tails


def causal_conv_padded(
    x: torch.Tensor,
    lengths: torch.Tensor,
    weight: torch.Tensor,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
    split: int | None = None,
) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor | None]:
    """:func:`causal_conv` of ``n`` new streams (zero tails) whose rows are padded to one
    length, with tensor ops only (graph-capturable). x: [n, L, C], stream j's rows the first
    ``lengths[j]`` (>= 1); weight: [C, K]. Returns (silu(conv) [n, L, C], new tails
    [n, C, K-1]: the K-1 pre-convolution rows ending at each stream's last row, zeros before
    its first). Rows past a stream's length come out as garbage; its real rows never see them
    (the convolution is causal). ``into = (pool [slots, C, K-1], slots [n])``: the new tails
    are written to ``pool[slots]`` (in its dtype) instead, and None is returned for them.
    ``split = KD``: silu(conv) as three tensors, channels [0, KD), [KD, 2 KD) and [2 KD, C)
    (the GDN's q, k and v; views here, dense in the GPU kernel, where a chunked kernel takes
    them without copies)."""
    n, _, C = x.shape
    k1 = weight.shape[1] - 1
    window = F.pad(x.transpose(1, 2), (k1, 0))  # [n, C, K-1+L]
    y = F.conv1d(window, weight.to(x.dtype).unsqueeze(1), groups=C)  # [n, C, L]
    # The new tail: window columns lengths .. lengths+K-2 (column K-1+i holds row i).
    at = lengths[:, None] + torch.arange(k1, device=x.device)  # [n, K-1]
    tails = window.gather(2, at[:, None, :].expand(n, C, k1))
    if into is not None:
        pool, slots = into
        pool.index_copy_(0, slots, tails.to(pool.dtype))
        tails = None
    y = F.silu(y).transpose(1, 2)
    if split is not None:
        return y.split([split, split, C - 2 * split], dim=-1), tails
    return y, tails


def causal_conv_step(
    x: torch.Tensor, tails: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new row for n streams at once. x: [n, C]; tails: [n, C, K-1]; weight: [C, K].
    Returns (silu(conv) [n, C], new tails [n, C, K-1])."""
    window = torch.cat([tails.to(x.dtype), x[:, :, None]], dim=2)  # [n, C, K]
    y = (window * weight.to(x.dtype)).sum(-1)
    return F.silu(y), window[:, :, 1:]
