"""Causal attention of new rows over a stream's KV rows (reference).

The stream's keys and values live in a slot of the KV pool; new rows have already been written
there, so the query at absolute position ``p`` attends to pool rows ``0..p``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def block_mask(
    ring_pos: torch.Tensor, start: torch.Tensor, block: int, causal: bool, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys each of a drafted block's queries may attend to, ``[n, block, R+block]``, and
    which key rows hold anything, ``[n, R+block]``: the keys are ``R`` context rows (positions
    ``ring_pos`` ``[n, R]``, -1 = empty), then the block's own rows (positions ``start[j] ..
    start[j]+block-1``). A query sees every filled context row before the block, and the
    block's rows: all of them, or only those up to itself when ``causal``; ``window`` > 0 also
    limits it to the last ``window`` positions. Device ops only (it runs in captured graphs)."""
    n = start.shape[0]
    pos = start[:, None] + torch.arange(block, device=start.device)  # [n, B]
    key_pos = torch.cat([ring_pos, pos], dim=1)  # [n, R+B]
    valid = (key_pos[:, None, :] >= 0) & (key_pos[:, None, :] < start[:, None, None])
    block_cols = torch.zeros_like(valid)
    block_cols[..., ring_pos.shape[1] :] = True
    if causal:
        block_ok = key_pos[:, None, :] <= pos[:, :, None]
    else:
        block_ok = torch.ones(n, block, key_pos.shape[1], dtype=torch.bool, device=pos.device)
    allowed = torch.where(block_cols, block_ok, valid.expand(n, block, -1))
    if window:
        allowed &= (pos[:, :, None] - key_pos[:, None, :]) < window
    return allowed, valid[:, 0] | block_cols[:, 0]


def attend_block(
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
    """A drafter's block attention (DFlash): ``n`` streams' blocks of ``B`` query rows over
    their context ring and the block's own keys (masked as :func:`block_mask` says).

    q: [n, B, nh, hd], row ``b`` of stream ``j`` at position ``starts[j] + b``; block_k,
    block_v: [n, B, nkv, hd]; ring_k, ring_v: one layer of the ring, [slots, nkv, R, hd], and
    ring_pos [slots, R] the position each ring row holds (-1 = empty); slots, starts: [n] int.
    ``rows``: read only the ring's first rows (every stream's context lies in them). Scale
    hd^-0.5, grouped-query (query head i reads kv head i // (nh / nkv)), fp32 softmax. Returns
    [n, B, nh, hd]. ``masks``: a dict the caller keeps for one forward, so that layers of one
    kind share their mask."""
    n, B, nh, hd = q.shape
    nkv = block_k.shape[2]
    ring = slice(None, rows)
    kind = (causal, window)
    cached = masks.get(kind) if masks is not None else None
    if cached is None:
        allowed, readable = block_mask(ring_pos[slots, ring], starts, B, causal, window)
        cached = (allowed.repeat(1, nh // nkv, 1)[:, None], ~readable)
        if masks is not None:
            masks[kind] = cached
    seen, unread = cached  # [n, 1, g*B, R+B], [n, R+B]
    keys = torch.cat([ring_k[slots, :, ring], block_k.transpose(1, 2)], dim=2)
    values = torch.cat([ring_v[slots, :, ring], block_v.transpose(1, 2)], dim=2)
    # Each kv head's query heads stacked along the rows: plain attention per kv head.
    qh = q.permute(0, 2, 1, 3).reshape(n, nkv, (nh // nkv) * B, hd)
    # Empty ring rows may hold anything (NaN included): zero them, 0 * NaN is NaN.
    values = values.masked_fill(unread[:, None, :, None], 0)
    # SDPA: one fused kernel where there is one; every row sees at least its own block row.
    o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=seen, scale=hd**-0.5)
    return o.reshape(n, nh, B, hd).permute(0, 2, 1, 3)  # SDPA may return it strided
