"""Qwen3.5's gated full attention over a packed batch, one method per batch shape.

The projections run once over all rows (q_proj laid out per head as [query | gate]); then each
shape of rows reads and writes its slots' KV rows in the pool: all rows decode rows (norms, RoPE
and the KV write fused in one kernel, then flash decoding), decode rows among others (and
graph-captured verify windows, which attend as decode rows), graph-captured new prompts padded
to one length, multi-row spans (prefill chunks: KV rows written at once, fresh prompts attended
together by span), and token trees (each row sees the committed rows and its ancestors). The
output is gated by ``sigmoid(gate)`` and projected.
"""

from __future__ import annotations

import torch

from headstart.batch import DecodeRows, ForwardBatch, SeqSpan
from headstart.models.qwen35.parts import ModelParts
from headstart.models.qwen35.speculative import ancestry, attend_tree
from headstart.ops.linear import linear
from headstart.ops.pointwise.reference import Rotary, rms_norm
from headstart.state import StatePool

__all__ = ["GatedAttention"]


def _span_rows(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot and position of every row of the batch's multi-row spans (packed order)."""
    m = batch.multi
    if "rows" not in m.memo:
        slots = [s.slot for s in batch.multi_row for _ in range(s.length)]
        positions = [s.start + d for s in batch.multi_row for d in range(s.length)]
        m.memo["rows"] = tuple(
            torch.tensor(t, dtype=torch.int64).to(m.rows.device) for t in (slots, positions)
        )
    return m.memo["rows"]


def _fresh_spans(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(packed rows, cu_seqlens on the device and on the host) of the multi-row spans that start
    a stream, when there are at least two of them (else None: each attends alone)."""
    m = batch.multi
    if "fresh" not in m.memo:
        fresh = [s for s in batch.multi_row if s.start == 0]
        m.memo["fresh"] = None
        if len(fresh) > 1:
            dev = m.rows.device
            rows = torch.tensor([r for s in fresh for r in range(s.begin, s.end)], device=dev)
            cu = torch.tensor([0] + [s.length for s in fresh], dtype=torch.int32).cumsum(0)
            m.memo["fresh"] = (rows, cu.to(torch.int32).to(dev), cu.to(torch.int32))
    return m.memo["fresh"]


class GatedAttention:
    """The attention layers of one model (reads its weights, kernels and rotary tables)."""

    def __init__(self, model: ModelParts) -> None:
        self.m = model

    def __call__(
        self,
        i: int,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        batch: ForwardBatch,
        pool: StatePool,
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer ``i`` over the batch's rows ``x``; ``cos``/``sin`` per row (None when every
        row is a decode row: RoPE is then fused), ``lengths`` their attention lengths."""
        m, cfg, p = self.m, self.m.cfg, f"layers.{i}.self_attn."
        T, hd, nh = x.shape[0], cfg.head_dim, cfg.num_attention_heads
        qkv = linear(x, m.w[p + "qkv_proj.weight"])
        gate = qkv[:, : 2 * nh * hd].view(T, nh, 2 * hd)[..., hd:]
        keys, values = pool.keys[m.state_index[i]], pool.values[m.state_index[i]]
        if batch.all_decode is not None:
            span = batch.windows is not None and batch.windows.span
            out = self._all_decode(p, qkv, batch.all_decode, keys, values, lengths, span)
        elif batch.padded is not None:
            out = self._padded(p, qkv, batch, keys, values)
        else:
            q, k, v = self._inputs(p, qkv, cos, sin)
            out = torch.empty_like(q)
            self._decode_rows(batch, q, k, v, keys, values, out)
            self._spans(batch, q, k, v, keys, values, out)
            self._trees(batch, q, k, v, keys, values, out)
        return linear(m.kernels.sigmoid_mul(out.reshape(T, -1), gate), m.w[p + "o_proj.weight"])

    def _all_decode(
        self,
        p: str,
        qkv: torch.Tensor,
        d: DecodeRows,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        span: bool = False,
    ) -> torch.Tensor:
        """Every row a decode row: norms, RoPE and the KV write in one kernel. ``span``: the
        rows are one stream's continued chunk, attended as one (each key block read once per
        block of query rows, not once per row)."""
        m = self.m
        q = self._fused_inputs(p, qkv, d.rows, keys, values, d.slots, d.positions)
        if span:
            return m.kernels.attn_chunk(q, keys, values, d.slots[:1], d.positions[:1])
        return m.kernels.attn_decode(q, keys, values, d.slots, lengths)

    def _fused_inputs(
        self,
        p: str,
        qkv: torch.Tensor,
        rows: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """Queries of ``rows`` normed and rotated, their keys and values (normed, rotated) written
        to the pool at ``(slots, positions)``: one kernel."""
        m, cfg = self.m, self.m.cfg
        return m.kernels.attn_decode_inputs(
            qkv,
            rows,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            m.w[p + "q_norm.weight"],
            m.w[p + "k_norm.weight"],
            cfg.rms_norm_eps,
            m.rotary.inv_freq,
            keys,
            values,
            slots,
            positions,
        )

    def _inputs(
        self, p: str, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row queries, keys and values: split, q/k norms, RoPE."""
        m, cfg = self.m, self.m.cfg
        T, hd, nh, nkv = (
            qkv.shape[0],
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        )
        qg, k, v = torch.split(qkv, [2 * nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = qg.reshape(T, nh, 2 * hd)[..., :hd]
        k, v = k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        q = Rotary.apply(rms_norm(q, m.w[p + "q_norm.weight"], cfg.rms_norm_eps), cos, sin)
        k = Rotary.apply(rms_norm(k, m.w[p + "k_norm.weight"], cfg.rms_norm_eps), cos, sin)
        return q, k, v

    def _decode_rows(self, batch: ForwardBatch, q, k, v, keys, values, out) -> None:
        """Decode rows (one per stream), and graphed windows whose every row is a decode row of
        its stream: write all the rows, then attend from the pool in place (a window's later
        rows are masked by length)."""
        for d in (batch.decode, batch.windows.as_decode if batch.windows else None):
            if d is not None:
                keys[d.slots, :, d.positions] = k[d.rows]
                values[d.slots, :, d.positions] = v[d.rows]
                out[d.rows] = self.m.kernels.attn_decode(
                    q[d.rows], keys, values, d.slots, d.positions + 1
                )

    def _padded(
        self,
        p: str,
        qkv: torch.Tensor,
        batch: ForwardBatch,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        """New prompts padded to one length (graph-capturable; alone in their batch): norms,
        RoPE and every row's KV write in the decode rows' fused kernel (padding rows land past
        the prompt, where nothing reads them), then each stream attends causally to its own
        rows, read back from the pool in the layout attention takes."""
        m, pr = self.m, batch.padded
        n, L = pr.rows.shape
        rows = pr.rows.view(-1)
        q = self._fused_inputs(p, qkv, rows, keys, values, pr.row_slots, batch.positions)
        # Sliced before the gather: only the prompts' L rows are copied.
        k = keys[:, :, :L].index_select(0, pr.slots).transpose(1, 2)
        v = values[:, :, :L].index_select(0, pr.slots).transpose(1, 2)
        o = m.kernels.attn_padded(q.view(n, L, *q.shape[1:]), k, v)
        return o.reshape(q.shape)

    def _spans(self, batch: ForwardBatch, q, k, v, keys, values, out) -> None:
        """Multi-row spans: several are written at once and fresh prompts attended at once;
        one is written as a slice."""
        spans: tuple[SeqSpan, ...] = batch.multi_row
        kernels = self.m.kernels
        if len(spans) > 1:
            row_slots, row_positions = _span_rows(batch)
            keys[row_slots, :, row_positions] = k[batch.multi.rows]
            values[row_slots, :, row_positions] = v[batch.multi.rows]
            fresh = _fresh_spans(batch)
            if fresh is not None:
                rows, cu, cu_cpu = fresh
                out[rows] = kernels.attn_fresh_spans(q[rows], k[rows], v[rows], cu, cu_cpu)
                spans = tuple(s for s in spans if s.start > 0)
        elif spans:
            s = spans[0]
            keys[s.slot, :, s.start : s.start + s.length] = k[s.begin : s.end].transpose(0, 1)
            values[s.slot, :, s.start : s.start + s.length] = v[s.begin : s.end].transpose(0, 1)
        for s in spans:
            end = s.start + s.length
            out[s.begin : s.end] = kernels.attn_span(
                q[s.begin : s.end], keys[s.slot, :, :end], values[s.slot, :, :end], s.start
            )

    @staticmethod
    def _trees(batch: ForwardBatch, q, k, v, keys, values, out) -> None:
        """Token trees: each row sees the committed rows and its ancestors."""
        for s in batch.trees:
            end = s.start + s.length
            keys[s.slot, :, s.start : end] = k[s.begin : s.end].transpose(0, 1)
            values[s.slot, :, s.start : end] = v[s.begin : s.end].transpose(0, 1)
            out[s.begin : s.end] = attend_tree(
                q[s.begin : s.end],
                keys[s.slot, :, :end],
                values[s.slot, :, :end],
                s.start,
                ancestry(s.parents),
            )
