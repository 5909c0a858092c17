"""Qwen3.5's speculative-decoding state surgery and the reference ops of token trees.

After a verify window the slot must hold the state after the last accepted row. Attention KV rows
need nothing for a chain (rows past the kept ones are never read and are overwritten next); the
GDN state cannot be rewound, so a window runs *recorded*: :class:`GDNRecord` keeps each layer's
inputs (initial conv tail and state, pre-conv rows, gates), and :func:`rollback` replays the kept
rows from them, or, where the records hold the state after each row (graphed windows of a
model whose row states fit, :class:`WindowRecords`), copies the kept row's. Graphed windows
record into the shared :class:`WindowRecords` and roll back with :func:`rollback_window` (no
host work, so it can be captured); :func:`rollback_windows` rolls back a whole batch of them to
kept lengths that are themselves device tensors, so that a round decided on the device
(engine/spec/round.py) needs no host value either. Token trees run through
:func:`tree_gated_delta` and :func:`attend_tree` (every node continues from its parent), and
:func:`commit_tree` keeps the accepted path's state and KV rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from headstart.models.qwen35.config import ModelConfig
from headstart.models.qwen35.parts import ModelParts
from headstart.ops.conv.reference import causal_conv, causal_conv_step, causal_conv_upto_each
from headstart.ops.gated_delta.reference import (
    chunked_gated_delta,
    gated_delta_step,
    recurrent_gated_delta,
)
from headstart.state import StatePool

__all__ = [
    "GDNRecord",
    "WindowRecords",
    "ancestry",
    "attend_tree",
    "commit_tree",
    "rollback",
    "rollback_window",
    "rollback_windows",
    "tree_gated_delta",
]


@dataclass
class GDNRecord:
    """One span's GDN inputs per layer: (initial tail, initial state, pre-conv rows, g, beta)."""

    layers: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    # Tree windows instead: per layer, every node's (state [N,Hv,Dk,Dv], tail [N,C,K-1]).
    tree: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Windows whose records keep the state after each row instead: per layer, (states
    # [W,Hv,Dk,Dv], tails [W,C,K-1]) after each row; a rollback copies the kept row's.
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def ancestry(parents: Sequence[int]) -> torch.Tensor:
    """[N, N] bool: row i may see row j iff j is i or one of its ancestors."""
    n = len(parents)
    seen = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        seen[i] |= seen[parents[i]]
    return seen


def attend_tree(
    q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, start: int, sees: torch.Tensor
) -> torch.Tensor:
    """q: [N, nh, hd] tree rows; k_rows, v_rows: [nkv, start+N, hd]; sees: [N, N] ancestry."""
    N, nh, hd = q.shape
    nkv = k_rows.shape[0]
    group = nh // nkv
    qh = q.transpose(0, 1).reshape(nkv, group * N, hd)
    scores = (qh @ k_rows.transpose(1, 2)).float() * hd**-0.5  # [nkv, group*N, start+N]
    allowed = torch.cat([torch.ones(N, start, dtype=torch.bool), sees], dim=1).to(q.device)
    probs = scores.masked_fill(~allowed.repeat(group, 1), float("-inf")).softmax(-1)
    out = (probs.to(v_rows.dtype) @ v_rows).reshape(nh, N, hd).transpose(0, 1)
    return out.to(q.dtype)


def tree_gated_delta(
    mixed: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: Sequence[int],
    tail: torch.Tensor,
    state: torch.Tensor,
    conv_w: torch.Tensor,
    cfg: ModelConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GDN over a token tree: every node continues from its parent's conv tail and state.

    mixed: [N, C] pre-conv rows; tail: [C, K-1] and state: [Hv, Dk, Dv] of the committed prefix.
    Returns (o [N, Hv, Dv], node states [N, Hv, Dk, Dv] fp32, node tails [N, C, K-1])."""
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    N = mixed.shape[0]
    out = torch.empty(N, Hv, Dv, dtype=torch.float32, device=mixed.device)
    states = torch.empty((N,) + tuple(state.shape), dtype=torch.float32, device=mixed.device)
    tails = torch.empty((N,) + tuple(tail.shape), dtype=tail.dtype, device=mixed.device)
    for i in range(N):
        p = parents[i]
        before_tail = tail if p < 0 else tails[p]
        before_state = state if p < 0 else states[p]
        y, tails[i] = causal_conv_step(mixed[i : i + 1], before_tail[None], conv_w)
        q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        o, new_state = gated_delta_step(
            q.view(1, Hk, Dk),
            k.view(1, Hk, Dk),
            v.view(1, Hv, Dv),
            g[i : i + 1],
            beta[i : i + 1],
            before_state[None].float(),
        )
        out[i], states[i] = o[0], new_state[0]
    return out, states, tails


# The most bytes :meth:`WindowRecords.allocate` spends on the state after each window row; past
# it, windows record their inputs and a rollback replays the kept rows. The default model's
# records for 16 streams of 8 rows take 50 MB; 2B's 2.4 GB, 27B's 19 GB (so those replay).
ROW_STATES_BUDGET = 512 << 20


@dataclass
class WindowRecords:
    """Where graphed verify windows leave what a rollback needs, in one of two forms, allocated
    once and shared by every window graph (per-graph outputs of this size would multiply the
    state pool's memory by the number of graphs):

    - *row states*: per GDN layer and window (stream index), the recurrent state and conv tail
      after each window row, written by the window's own step kernels; a rollback copies the
      kept row's (a few copies for all layers, against a replay's tens of kernels a layer).
    - *inputs* (when row states would not fit :data:`ROW_STATES_BUDGET`): the conv tail and
      recurrent state before the window and the window's pre-conv rows, log decays and betas;
      a rollback replays the kept rows (see :func:`rollback`).

    The fields of the other form are None."""

    tail: torch.Tensor | None = None  # [linear layers, n, conv_dim, K-1]
    state: torch.Tensor | None = None  # [linear layers, n, Hv, Dk, Dv] fp32
    mixed: torch.Tensor | None = None  # [linear layers, n, W, conv_dim]
    g: torch.Tensor | None = None  # [linear layers, n, W, Hv] fp32
    beta: torch.Tensor | None = None  # [linear layers, n, W, Hv]
    row_state: torch.Tensor | None = None  # [linear layers, n, W, Hv, Dk, Dv] fp32
    row_tail: torch.Tensor | None = None  # [linear layers, n, W, conv_dim, K-1]

    @staticmethod
    def row_bytes(cfg: ModelConfig, streams: int, width: int, dtype: torch.dtype) -> int:
        """Bytes of the row-states form."""
        per_row = cfg.linear_num_value_heads * cfg.linear_key_head_dim
        per_row *= cfg.linear_value_head_dim * 4
        per_row += cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * dtype.itemsize
        return len(cfg.linear_layers) * streams * width * per_row

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        streams: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device | str,
        row_states: bool | None = None,
    ) -> WindowRecords:
        """``row_states``: which form (None: row states while they fit the budget)."""
        L, Hv = len(cfg.linear_layers), cfg.linear_num_value_heads
        Dk, Dv, K1 = (
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim - 1,
        )
        if row_states is None:
            row_states = cls.row_bytes(cfg, streams, width, dtype) <= ROW_STATES_BUDGET
        if row_states:
            return cls(
                row_state=torch.zeros(
                    L, streams, width, Hv, Dk, Dv, dtype=torch.float32, device=device
                ),
                row_tail=torch.zeros(
                    L, streams, width, cfg.conv_dim, K1, dtype=dtype, device=device
                ),
            )
        return cls(
            tail=torch.zeros(L, streams, cfg.conv_dim, K1, dtype=dtype, device=device),
            state=torch.zeros(L, streams, Hv, Dk, Dv, dtype=torch.float32, device=device),
            mixed=torch.zeros(L, streams, width, cfg.conv_dim, dtype=dtype, device=device),
            g=torch.zeros(L, streams, width, Hv, dtype=torch.float32, device=device),
            beta=torch.zeros(L, streams, width, Hv, dtype=dtype, device=device),
        )


def _copy_rows(pool: StatePool, slots: torch.Tensor, records: WindowRecords, windows, rows) -> None:
    """Every GDN layer of ``slots[j]`` set to the state after row ``rows[j]`` of window
    ``windows[j]`` (index tensors or ints) of row-state records: two gathers, two copies."""
    for dst, src in ((pool.recurrent, records.row_state), (pool.conv, records.row_tail)):
        dst.index_copy_(1, slots, src[:, windows, rows].to(dst.dtype))


@torch.no_grad()
def commit_tree(
    model: ModelParts,
    pool: StatePool,
    slot: int,
    start: int,
    record: GDNRecord,
    path: Sequence[int],
) -> None:
    """After a tree window: make the slot hold the state after the accepted ``path`` (row
    indices from the root): that node's GDN state and conv tail, and the path's KV rows
    moved to consecutive positions ``start ..``."""
    node = path[-1]
    for i, (states, tails) in record.tree.items():
        layer = model.state_index[i]
        pool.recurrent[layer, slot] = states[node]
        pool.conv[layer, slot] = tails[node]
    idx = torch.tensor([start + p for p in path], device=pool.keys.device)
    n = len(path)
    pool.keys[:, slot, :, start : start + n] = pool.keys[:, slot, :, idx].clone()
    pool.values[:, slot, :, start : start + n] = pool.values[:, slot, :, idx].clone()


@torch.no_grad()
def rollback(model: ModelParts, pool: StatePool, slot: int, record: GDNRecord, keep: int) -> None:
    """Set the slot's GDN state to what it was after the first ``keep`` rows of the recorded
    span, by replaying the recurrence over those rows from the recorded initial state.

    Attention KV rows need nothing: rows past the kept ones are simply never read (the next
    chunk starts at their position and overwrites them)."""
    for i, (states, tails) in record.rows.items():  # row states: copy the kept row's
        layer = model.state_index[i]
        pool.recurrent[layer, slot] = states[keep - 1]
        pool.conv[layer, slot] = tails[keep - 1]
    cfg = model.cfg
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for i, (tail, state, mixed, g, beta) in record.layers.items():
        layer = model.state_index[i]
        conv_w = model.w[f"layers.{i}.linear_attn.conv1d.weight"]
        y, pool.conv[layer, slot] = causal_conv(mixed[:keep], tail, conv_w)
        q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        rule = recurrent_gated_delta if keep == 1 else chunked_gated_delta
        _, pool.recurrent[layer, slot] = rule(
            q.reshape(keep, Hk, Dk),
            k.reshape(keep, Hk, Dk),
            v.reshape(keep, Hv, Dv),
            g[:keep],
            beta[:keep],
            state,
        )


@torch.no_grad()
def rollback_window(
    model: ModelParts,
    pool: StatePool,
    slot: torch.Tensor,
    records: WindowRecords,
    window: torch.Tensor,
    keep: int,
) -> None:
    """:func:`rollback` for a window recorded into shared buffers by a graphed window batch
    (``records``, window index ``window`` [1]), with ``slot`` [1] a tensor: no host work,
    so it can be captured. Replays the kept rows through the kernels' span recurrence, or with
    row-state records copies the kept row's state."""
    if records.row_state is not None:
        _copy_rows(pool, slot, records, window, keep - 1)
        return
    cfg = model.cfg
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    dev = pool.conv.device
    cu = torch.tensor([0, keep], dtype=torch.int32)  # host copy: the reference kernels
    # [0, keep] made on the device (a copy from the host cannot be captured).
    cu_dev = torch.arange(0, 2 * keep, keep, dtype=torch.int32, device=dev)
    kept = torch.zeros(1, dtype=torch.bool, device=dev)
    for i in cfg.linear_layers:
        li = model.state_index[i]

        def pick(t: torch.Tensor, li: int = li) -> torch.Tensor:
            return t[li].index_select(0, window)[0]

        y, tail = causal_conv(
            pick(records.mixed)[:keep],
            pick(records.tail),
            model.w[f"layers.{i}.linear_attn.conv1d.weight"],
        )
        pool.conv[li].index_copy_(0, slot, tail[None])
        pool.recurrent[li].index_copy_(0, slot, records.state[li].index_select(0, window))
        q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        model.kernels.gdn_spans(
            q.reshape(keep, Hk, Dk),
            k.reshape(keep, Hk, Dk),
            v.reshape(keep, Hv, Dv),
            pick(records.g)[:keep],
            pick(records.beta)[:keep],
            cu_dev,
            slot,
            kept,
            pool.recurrent[li],
            cu,
        )


@torch.no_grad()
def rollback_windows(
    model: ModelParts,
    pool: StatePool,
    slots: torch.Tensor,
    records: WindowRecords,
    keep: torch.Tensor,
    width: int,
) -> None:
    """:func:`rollback_window` for the first ``n`` windows of a graphed batch at once, window
    ``j`` (on ``slots[j]``) keeping its first ``keep[j]`` rows (1 .. ``width``), with ``keep`` a
    device tensor. The whole window is replayed from the recorded state with no decay and no
    update on rows past ``keep[j]`` (so they leave the state as it was), and the conv tail is
    the ``K-1`` inputs ending at the last kept row: no host work, no shape that depends on
    ``keep``. With row-state records, each window's kept row's state is copied instead."""
    if records.row_state is not None:
        n = slots.shape[0]
        _copy_rows(pool, slots, records, torch.arange(n, device=keep.device), keep - 1)
        return
    cfg = model.cfg
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    n = slots.shape[0]
    kept = torch.arange(width, device=keep.device)[None, :] < keep[:, None]  # [n, W]
    for i in cfg.linear_layers:
        li = model.state_index[i]
        y, tail = causal_conv_upto_each(
            records.mixed[li, :n, :width],
            records.tail[li, :n],
            model.w[f"layers.{i}.linear_attn.conv1d.weight"],
            keep,
        )
        pool.conv[li].index_copy_(0, slots, tail.to(pool.conv.dtype))
        q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        g = torch.where(kept[..., None], records.g[li, :n, :width], 0.0)
        beta = torch.where(kept[..., None], records.beta[li, :n, :width], 0.0)
        model.kernels.gdn_padded(
            q.reshape(n, width, Hk, Dk),
            k.reshape(n, width, Hk, Dk),
            v.reshape(n, width, Hv, Dv),
            g,
            beta,
            slots,
            pool.recurrent[li],
            initial=records.state[li, :n],
        )
