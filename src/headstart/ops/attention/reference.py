"""Causal attention of new rows over a stream's KV rows (reference).

The stream's keys and values live in a slot of the KV pool; new rows have already been written
there, so the query at absolute position ``p`` attends to pool rows ``0..p``.
"""

from __future__ import annotations

import torch


def attend(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, start: int) -> torch.Tensor:
    """q: [T, nh, hd] for positions start..start+T-1; k_rows, v_rows: [nkv, start+T, hd].

    Grouped-query attention (query head i reads kv head i // (nh / nkv)), scale hd^-0.5, softmax
    in fp32. Returns [T, nh, hd] in q's dtype.
    """
    T, nh, hd = q.shape
    nkv, n, _ = k_rows.shape
    group = nh // nkv
    qh = q.transpose(0, 1).reshape(nkv, group * T, hd)  # query heads grouped under their kv head
    scores = (qh @ k_rows.transpose(1, 2)).float() * hd**-0.5  # [nkv, group*T, n]
    pos = torch.arange(start, start + T, device=q.device).repeat(group)
    future = torch.arange(n, device=q.device)[None, :] > pos[:, None]
    probs = scores.masked_fill(future, float("-inf")).softmax(-1).to(v_rows.dtype)
    out = (probs @ v_rows).reshape(nh, T, hd).transpose(0, 1)
    return out.to(q.dtype)


def attend_decode(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """One query row per stream, n streams at once (batched decode).

    q: [n, nh, hd]; k_rows, v_rows: [n, nkv, L, hd] (rows past each stream's length are
    ignored); lengths: [n] rows to attend to, the query's own row included. Returns [n, nh, hd].
    """
    n, nh, hd = q.shape
    nkv, L = k_rows.shape[1], k_rows.shape[2]
    qh = q.view(n, nkv, nh // nkv, hd)
    scores = (qh @ k_rows.transpose(2, 3)).float() * hd**-0.5  # [n, nkv, group, L]
    beyond = torch.arange(L, device=q.device)[None, :] >= lengths[:, None]  # [n, L]
    probs = scores.masked_fill(beyond[:, None, None, :], float("-inf")).softmax(-1)
    # Rows past a stream's length hold whatever an earlier stream left there (even NaN, and
    # 0 * NaN is NaN), so they are zeroed rather than trusted to be finite.
    v_rows = v_rows.masked_fill(beyond[:, None, :, None], 0)
    out = probs.to(v_rows.dtype) @ v_rows  # [n, nkv, group, hd]
    return out.reshape(n, nh, hd).to(q.dtype)


def attend_chunk(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: torch.Tensor,
    start: torch.Tensor,
) -> torch.Tensor:
    """One stream's continued chunk, addressed by tensors (as a CUDA graph holds them).

    q: [W, nh, hd] for positions ``start .. start+W-1`` of stream ``slot`` ([1] int tensors);
    keys, values: one layer of the pool, [slots, nkv, max_tokens, hd], the chunk's rows already
    written. Row ``i`` attends to pool rows ``0 .. start + i`` (:func:`attend`). Returns
    [W, nh, hd] in q's dtype.
    """
    s, p, end = int(slot), int(start), int(start) + q.shape[0]
    return attend(q, keys[s, :, :end], values[s, :, :end], p)
