"""Qwen3.5's Gated DeltaNet over a packed batch, one method per batch shape.

One matmul gives every row's conv input ``[q | k | v]``, output gate ``z`` and gate inputs
``b``, ``a``. Each shape of rows then runs the causal conv and the gated delta rule from its
slot's conv tail and recurrent state and leaves them updated: decode rows as one batched step
(the step kernels compute the gates and, when every row is a decode row, the output norm
themselves), a graph-captured continued chunk, graph-captured verify windows as W batched
one-row steps (recorded for rollback), graph-captured new prompts padded to one length,
multi-row spans (one conv pass and one varlen recurrence
for all of them), and token trees. A stream at position 0 starts from a zero tail and state,
whatever its slot held. The gated RMSNorm and the output projection close the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headstart.batch import ForwardBatch, WindowRows
from headstart.models.qwen35.parts import ModelParts
from headstart.models.qwen35.speculative import GDNRecord, tree_gated_delta
from headstart.ops.conv.reference import conv_spans_plan
from headstart.ops.linear import linear
from headstart.state import StatePool

__all__ = ["GatedDeltaNet"]


def _copied_back(wd: WindowRows) -> bool:
    """Whether these windows' rollback copies a kept row's state (the records hold the state
    after each row) rather than replaying the kept rows."""
    return wd.records is not None and wd.records.row_state is not None


def _conv_plan(batch: ForwardBatch, k1: int) -> tuple[torch.Tensor, ...]:
    m = batch.multi
    if ("conv", k1) not in m.memo:
        plan = conv_spans_plan([s.length for s in batch.multi_row], k1)
        m.memo[("conv", k1)] = tuple(t.to(m.rows.device) for t in plan)
    return m.memo[("conv", k1)]


@dataclass
class _Rows:
    """One layer's per-row inputs and its slice of the pool, shared by the shape methods."""

    i: int
    mixed: torch.Tensor  # [T, conv_dim] pre-conv rows
    a: torch.Tensor
    b: torch.Tensor
    g: torch.Tensor | None  # log decays (fp32); None when only the step kernels run
    beta: torch.Tensor | None
    tails: torch.Tensor  # the pool's conv tails of this layer [slots, conv_dim, K-1]
    states: torch.Tensor  # the pool's recurrent states of this layer [slots, Hv, Dk, Dv]
    conv_w: torch.Tensor
    core: torch.Tensor | None  # [T, Hv, Dv] the rule's outputs, before the output norm


class GatedDeltaNet:
    """The GDN layers of one model (reads its weights, kernels and config)."""

    def __init__(self, model: ModelParts) -> None:
        self.m = model
        cfg = model.cfg
        self.heads = (
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
        )

    def __call__(
        self,
        i: int,
        x: torch.Tensor,
        batch: ForwardBatch,
        pool: StatePool,
        records: dict[int, GDNRecord] | None = None,
    ) -> torch.Tensor:
        """Layer ``i`` over the batch's rows ``x``; spans marked ``record`` (and graphed
        windows) leave what a rollback replays in ``records``."""
        m, cfg, p = self.m, self.m.cfg, f"layers.{i}.linear_attn."
        T, Hv, Dv = x.shape[0], cfg.linear_num_value_heads, cfg.linear_value_head_dim
        mixed, z, b, a = torch.split(
            linear(x, m.w[p + "in_proj.weight"]), [cfg.conv_dim, cfg.value_dim, Hv, Hv], dim=-1
        )
        norm = (z.view(T, Hv, Dv), m.w[p + "norm.weight"], cfg.rms_norm_eps)
        d = batch.decode
        only_decode = d is not None and batch.all_decode is d
        # Verify windows (a batch of nothing else) run as one-row steps, gates computed in
        # the step kernels; tensors of them only for the records a replayed rollback reads.
        windows = batch.windows if batch.windows is not None and not batch.windows.span else None
        g = beta = None
        if not only_decode and (windows is None or not _copied_back(windows)):
            # New prompts' padding rows get no decay and no update, zeroed in the same kernel.
            valid = batch.padded.valid if batch.padded is not None else None
            g, beta = m.kernels.gdn_gates(a, b, m.w[p + "A_log"], m.w[p + "dt_bias"], valid)
        layer = m.state_index[i]
        rows = _Rows(
            i,
            mixed,
            a,
            b,
            g,
            beta,
            pool.conv[layer],
            pool.recurrent[layer],
            m.w[p + "conv1d.weight"],
            None
            if only_decode or windows is not None
            else torch.empty(T, Hv, Dv, dtype=x.dtype, device=x.device),
        )
        if d is not None:
            o = self._decode(rows, batch, norm if only_decode else None)
            if only_decode:  # the rows in order, output norm applied: straight to out_proj
                return linear(o.to(x.dtype).view(T, -1), m.w[p + "out_proj.weight"])
            rows.core[d.rows] = o.to(x.dtype)
        if windows is not None:  # the rows in order, output norm applied: straight to out_proj
            o = self._windows(rows, windows, records, norm)
            return linear(o.to(x.dtype).view(T, -1), m.w[p + "out_proj.weight"])
        if batch.windows is not None:
            self._window_span(rows, batch)
        if batch.padded is not None:
            self._padded(rows, batch)
        if batch.multi is not None:
            self._spans(rows, batch, records)
        self._trees(rows, batch, records)
        return linear(m.kernels.gated_rms_norm(rows.core, *norm), m.w[p + "out_proj.weight"])

    def _qkv(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.m.cfg
        Hk, Hv, Dk, Dv = self.heads
        n = y.shape[0]
        q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        return q.reshape(n, Hk, Dk), k.reshape(n, Hk, Dk), v.reshape(n, Hv, Dv)

    def _decode(self, r: _Rows, batch: ForwardBatch, norm) -> torch.Tensor:
        """One row per stream: the step form, batched over streams. The kernels read the rows
        and compute the gates themselves (no gathers); a new stream starts from zero."""
        m, d = self.m, batch.decode
        p = f"layers.{r.i}.linear_attn."
        y = m.kernels.conv_step_rows(r.mixed, d.rows, r.conv_w, r.tails, d.slots, d.fresh)
        return m.kernels.gdn_decode_gates(
            *self._qkv(y),
            r.a,
            r.b,
            d.rows,
            m.w[p + "A_log"],
            m.w[p + "dt_bias"],
            d.slots,
            d.fresh,
            r.states,
            norm=norm,
        )

    def _window_span(self, r: _Rows, batch: ForwardBatch) -> None:
        """A continued chunk addressed by a slot tensor (graph-capturable); padded, its
        padding rows get no decay and no update, and the conv tail ends at its last real row."""
        wd, dev = batch.windows, r.mixed.device
        rows, L = wd.rows[0], wd.rows.shape[1]
        tail0 = r.tails.index_select(0, wd.slots)[0]
        # A span batch holds this stream's rows alone, in order (ForwardBatch.windows_of): no
        # gathers then.
        if r.mixed.shape[0] == L:
            x, g, beta = r.mixed, r.g, r.beta
        else:
            x, g, beta = r.mixed[rows], r.g[rows], r.beta[rows]
        if wd.length is None:
            y, tail = self.m.kernels.conv_span(x, tail0, r.conv_w)
        else:
            y, tail = self.m.kernels.conv_upto(x, tail0, r.conv_w, wd.length)
            keep = (torch.arange(L, device=dev) < wd.length)[:, None]
            g, beta = torch.where(keep, g, 0.0), torch.where(keep, beta, 0.0)
        r.tails.index_copy_(0, wd.slots, tail[None].to(r.tails.dtype))
        o = self.m.kernels.gdn_spans(
            *self._qkv(y),
            g,
            beta,
            torch.arange(0, 2 * L, L, dtype=torch.int32, device=dev),
            wd.slots,
            torch.zeros(1, dtype=torch.bool, device=dev),
            r.states,
            torch.tensor([0, L], dtype=torch.int32),
        )
        r.core[rows] = o.to(r.core.dtype)

    def _padded(self, r: _Rows, batch: ForwardBatch) -> None:
        """New prompts padded to one length (graph-capturable): a batched conv from zero tails,
        and the chunked rule from zero states with padding rows given no decay and no update
        (by the gates kernel), so each stream's state is the one after its last prompt row."""
        pr, (Hk, Hv, Dk, Dv) = batch.padded, self.heads
        n, L = pr.rows.shape
        # q, k and v come out as three dense tensors: the chunked kernel copies none of them.
        (q, k, v), _ = self.m.kernels.conv_padded(
            r.mixed.view(n, L, -1), pr.lengths, r.conv_w, (r.tails, pr.slots), Hk * Dk
        )
        o = self.m.kernels.gdn_padded(
            q.view(n, L, Hk, Dk),
            k.view(n, L, Hk, Dk),
            v.view(n, L, Hv, Dv),
            r.g.view(n, L, Hv),  # g and beta: zero on the padding rows (gdn_gates)
            r.beta.view(n, L, Hv),
            pr.slots,
            r.states,
        )
        # A padded batch holds nothing else: the rule's output is the layer's core as it is.
        r.core = o.reshape(n * L, Hv, Dv).to(r.core.dtype)

    def _windows(
        self, r: _Rows, wd: WindowRows, records: dict[int, GDNRecord] | None, norm
    ) -> torch.Tensor:
        """Verify windows as W one-row steps of every stream in one launch each for the conv
        and the rule (graph-capturable), the decode step's own kernels looping over the rows,
        so that a window equals one-row steps. Returns the normed output of every row in
        order (a window batch holds its rows stream after stream, ``ForwardBatch.windows_of``).
        Recorded for rollback: when the shared records keep the state after each row
        (:class:`WindowRecords` ``row_state``), the kernels write them there; else the inputs a
        replay needs."""
        m = self.m
        n, W = wd.rows.shape
        li = m.state_index[r.i]
        p = f"layers.{r.i}.linear_attn."
        copied = _copied_back(wd)
        if records is not None and not copied:
            self._record_windows(r, wd, records)
        # The records are as wide as the widest window graph: this window's rows are a slice.
        row_tails = wd.records.row_tail[li, :n, :W] if copied else None
        row_states = wd.records.row_state[li, :n, :W] if copied else None
        kept = torch.zeros(n, dtype=torch.bool, device=r.mixed.device)  # no window is fresh
        rows = wd.rows.reshape(-1)
        y = m.kernels.conv_step_rows(
            r.mixed, rows, r.conv_w, r.tails, wd.slots, kept, width=W, row_tails=row_tails
        )
        o = m.kernels.gdn_decode_gates(
            *self._qkv(y),
            r.a,
            r.b,
            rows,
            m.w[p + "A_log"],
            m.w[p + "dt_bias"],
            wd.slots,
            kept,
            r.states,
            norm=norm,
            width=W,
            row_states=row_states,
        )
        if copied and records is not None:
            for j in range(n):
                records[j].rows[r.i] = (row_states[j], row_tails[j])
        return o

    def _record_windows(self, r: _Rows, wd, records: dict[int, GDNRecord]) -> None:
        """What a rollback replays, per window: into the shared buffers (graphs), kept as
        views, or as gathered copies."""
        n, W = wd.rows.shape
        flat = wd.rows.reshape(-1)
        sources = ((r.tails, wd.slots), (r.states, wd.slots), (r.mixed, flat), (r.g, flat))
        sources += ((r.beta, flat),)
        buf = wd.records
        if buf is None:  # gathers: copies
            tail0, state0, mixed_w, g_w, beta_w = (t[i] for t, i in sources)
            mixed_w, g_w, beta_w = (t.view(n, W, -1) for t in (mixed_w, g_w, beta_w))
        else:
            li = self.m.state_index[r.i]
            parts = (
                buf.tail[li, :n],
                buf.state[li, :n],
                buf.mixed[li, :n, :W],
                buf.g[li, :n, :W],
                buf.beta[li, :n, :W],
            )
            for dst, (src, index) in zip(parts, sources, strict=True):
                if dst.is_contiguous():  # gathered straight into the buffer: one copy
                    torch.index_select(src, 0, index, out=dst.view(-1, *src.shape[1:]))
                else:
                    dst.copy_(src[index].view(dst.shape))
            tail0, state0, mixed_w, g_w, beta_w = parts
        for j in range(n):
            records[j].layers[r.i] = (tail0[j], state0[j], mixed_w[j], g_w[j], beta_w[j])

    def _spans(self, r: _Rows, batch: ForwardBatch, records: dict[int, GDNRecord] | None) -> None:
        """Multi-row spans: the conv (of all of them in one pass when several), then one
        varlen recurrence."""
        m = batch.multi
        if len(batch.multi_row) > 1:
            init = torch.where(m.fresh[:, None, None], 0.0, r.tails.index_select(0, m.slots))
            for j, s in enumerate(batch.multi_row):
                if s.record:
                    state = (
                        torch.zeros_like(r.states[s.slot])
                        if s.start == 0
                        else r.states[s.slot].clone()
                    )
                    records[s.slot].layers[r.i] = (
                        init[j],
                        state,
                        r.mixed[s.begin : s.end],
                        r.g[s.begin : s.end],
                        r.beta[s.begin : s.end],
                    )
            y, new_tails = self.m.kernels.conv_spans(
                r.mixed[m.rows],
                init,
                r.conv_w,
                lambda: _conv_plan(batch, init.shape[-1]),
                m.cu_seqlens,
            )
            r.tails.index_copy_(0, m.slots, new_tails.to(r.tails.dtype))
        else:
            s = batch.multi_row[0]
            fresh = s.start == 0
            tail = torch.zeros_like(r.tails[s.slot]) if fresh else r.tails[s.slot]
            if s.record:
                tail = tail.clone()
                state = torch.zeros_like(r.states[s.slot]) if fresh else r.states[s.slot].clone()
                records[s.slot].layers[r.i] = (
                    tail,
                    state,
                    r.mixed[s.begin : s.end],
                    r.g[s.begin : s.end],
                    r.beta[s.begin : s.end],
                )
            y, r.tails[s.slot] = self.m.kernels.conv_span(r.mixed[s.begin : s.end], tail, r.conv_w)
        o = self.m.kernels.gdn_spans(
            *self._qkv(y),
            r.g[m.rows],
            r.beta[m.rows],
            m.cu_seqlens,
            m.slots,
            m.fresh,
            r.states,
            m.cu_seqlens_cpu,
        )
        r.core[m.rows] = o.to(r.core.dtype)

    def _trees(self, r: _Rows, batch: ForwardBatch, records: dict[int, GDNRecord] | None) -> None:
        """Token trees, one by one: every node continues from its parent's tail and state."""
        for s in batch.trees:
            fresh = s.start == 0
            o, node_states, node_tails = tree_gated_delta(
                r.mixed[s.begin : s.end],
                r.g[s.begin : s.end],
                r.beta[s.begin : s.end],
                s.parents,
                torch.zeros_like(r.tails[s.slot]) if fresh else r.tails[s.slot],
                torch.zeros_like(r.states[s.slot]) if fresh else r.states[s.slot],
                r.conv_w,
                self.m.cfg,
            )
            r.core[s.begin : s.end] = o.to(r.core.dtype)
            if records is not None and s.slot in records:
                records[s.slot].tree[r.i] = (node_states, node_tails)
