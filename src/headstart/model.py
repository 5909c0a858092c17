"""The Qwen3.5 hybrid text model, as one forward over packed rows from many streams.

``Qwen35Model.forward(batch, pool)`` embeds the batch's rows, runs every decoder layer (Gated
DeltaNet or gated full attention, then a SwiGLU MLP), reads and updates each stream's state in the
:class:`~headstart.state.StatePool` slot named by its chunk, and returns logits only for the rows
the chunks asked for. Projections, norms and MLPs run once over all rows; the sequence-mixing cores
run per stream. This is the pure-PyTorch reference path (CPU, float32 by default); faster kernels
of later stages keep its interface. The math follows HF transformers' ``modeling_qwen3_5`` (see
``shared/docs/qwen35-architecture.md``), including where it rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from headstart.arena import ArenaPlan, WeightArena
from headstart.batch import ForwardBatch
from headstart.config import FULL, ModelConfig, load_config
from headstart.kernels import Kernels, select_kernels
from headstart.ops.conv.reference import (
    causal_conv,
    causal_conv_spans,
    causal_conv_step,
    conv_spans_plan,
)
from headstart.ops.gated_delta.reference import (
    chunked_gated_delta,
    gated_delta_step,
    recurrent_gated_delta,
)
from headstart.ops.pointwise.reference import Rotary, gdn_gates, rms_norm
from headstart.ops.quant_matmul.triton import PreparedQuant, quant_matmul
from headstart.quant import QuantizedTensor
from headstart.state import StateGroup, StatePool, WindowRecords
from headstart.weights import Weight, load_weights, stand_ins


def linear(x: torch.Tensor, w: Weight | PreparedQuant) -> torch.Tensor:
    if isinstance(w, PreparedQuant):  # GPU: the fused kernel reads the packed words directly
        return quant_matmul(x, w)
    # CPU reference: quantized weights are dequantized per call, so memory holds only the packed
    # form.
    if isinstance(w, QuantizedTensor):
        return x @ w.dequantize(x.dtype).T
    return F.linear(x, w)


def ancestry(parents: Sequence[int]) -> torch.Tensor:
    """[N, N] bool: row i may see row j iff j is i or one of its ancestors."""
    n = len(parents)
    seen = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        seen[i] |= seen[parents[i]]
    return seen


def attend_tree(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, start: int,
                sees: torch.Tensor) -> torch.Tensor:
    """q: [N, nh, hd] tree rows; k_rows, v_rows: [nkv, start+N, hd]; sees: [N, N] ancestry."""
    N, nh, hd = q.shape
    nkv = k_rows.shape[0]
    group = nh // nkv
    qh = q.transpose(0, 1).reshape(nkv, group * N, hd)
    scores = (qh @ k_rows.transpose(1, 2)).float() * hd ** -0.5  # [nkv, group*N, start+N]
    allowed = torch.cat([torch.ones(N, start, dtype=torch.bool), sees], dim=1).to(q.device)
    probs = scores.masked_fill(~allowed.repeat(group, 1), float("-inf")).softmax(-1)
    out = (probs.to(v_rows.dtype) @ v_rows).reshape(nh, N, hd).transpose(0, 1)
    return out.to(q.dtype)


def tree_gated_delta(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     parents: Sequence[int], tail: torch.Tensor, state: torch.Tensor,
                     conv_w: torch.Tensor, cfg: ModelConfig
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
        y, tails[i] = causal_conv_step(mixed[i:i + 1], before_tail[None], conv_w)
        q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        o, new_state = gated_delta_step(q.view(1, Hk, Dk), k.view(1, Hk, Dk), v.view(1, Hv, Dv),
                                        g[i:i + 1], beta[i:i + 1], before_state[None].float())
        out[i], states[i] = o[0], new_state[0]
    return out, states, tails


FUSED = {  # fused weight -> the checkpoint's projections it stacks along the output dimension
    "linear_attn.in_proj.weight": ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                                   "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"),
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def _stack(parts: list[Weight]) -> Weight:
    if all(isinstance(t, torch.Tensor) for t in parts):
        return torch.cat(parts, dim=0)
    first = parts[0]
    assert all(isinstance(t, QuantizedTensor) and t.bits == first.bits
               and t.group_size == first.group_size for t in parts)
    return QuantizedTensor(torch.cat([t.packed for t in parts]), torch.cat([t.scales for t in parts]),
                           torch.cat([t.biases for t in parts]), first.bits, first.group_size)


Convert = Callable[[str, Weight], Weight]


def _as_is(name: str, t: Weight) -> Weight:
    return t


def fuse_layer(weights: MutableMapping[str, Weight], i: int, convert: Convert = _as_is) -> None:
    """Stack layer ``i``'s projections that read the same input into one weight each (one
    matmul instead of two to four: fewer, larger kernels). Parts that cannot be stacked
    (quantized with different bits or groups, or quantized next to unquantized) are stacked
    after dequantizing the odd ones out, never silently changed in precision otherwise.

    In place: the parts are popped (and passed through ``convert`` with their names) and the
    stack is stored under the fused name."""
    p = f"layers.{i}."
    for fused, parts in FUSED.items():
        if p + parts[0] not in weights:
            continue
        tensors = [convert(p + name, weights.pop(p + name)) for name in parts]
        kinds = {(t.bits, t.group_size) if isinstance(t, QuantizedTensor) else None
                 for t in tensors}
        if len(kinds) > 1:  # mixed: bring every part to full precision
            dtype = next(t.dtype for t in tensors if isinstance(t, torch.Tensor)) \
                if any(isinstance(t, torch.Tensor) for t in tensors) else torch.float32
            tensors = [t.dequantize(dtype) if isinstance(t, QuantizedTensor) else t
                       for t in tensors]
        weights[p + fused] = _stack(tensors)


@dataclass
class GDNRecord:
    """One span's GDN inputs per layer: (initial tail, initial state, pre-conv rows, g, beta)."""

    layers: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    # Tree windows instead: per layer, every node's (state [N,Hv,Dk,Dv], tail [N,C,K-1]).
    tree: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R, vocab]
    taps: torch.Tensor | None  # [T, len(taps) * hidden]
    records: dict[int, GDNRecord]  # by slot


# Unpacking per call costs the reference path most of a small model's step (the embedded default
# decodes several times faster unpacked); a large model keeps its memory saving instead.
UNPACK_BYTES = 1 << 30


EMBED = "embed_tokens.weight"


def _unpack_fits(weights: Mapping[str, Weight], dtype: torch.dtype, budget: int) -> bool:
    """Whether the quantized linear weights of ``weights`` all fit ``budget`` bytes unpacked to
    ``dtype`` (the embedding table does not count: it stays packed, its rows are unpacked as
    they are looked up). Reads only shapes, so meta stand-ins do."""
    packed = [t for k, t in weights.items() if isinstance(t, QuantizedTensor) and k != EMBED]
    size = torch.tensor([], dtype=dtype).element_size()
    return bool(packed) and sum(t.shape[0] * t.shape[1] for t in packed) * size <= budget


def _span_rows(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot and position of every row of the batch's multi-row spans (packed order)."""
    m = batch.multi
    if "rows" not in m.memo:
        slots = [s.slot for s in batch.multi_row for _ in range(s.length)]
        positions = [s.start + d for s in batch.multi_row for d in range(s.length)]
        m.memo["rows"] = tuple(torch.tensor(t, dtype=torch.int64).to(m.rows.device)
                               for t in (slots, positions))
    return m.memo["rows"]


def _fresh_spans(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(packed rows, [F, F] block-diagonal causal mask) of the multi-row spans that start a
    stream, when there are at least two of them (else None: each attends alone)."""
    m = batch.multi
    if "fresh" not in m.memo:
        fresh = [s for s in batch.multi_row if s.start == 0]
        m.memo["fresh"] = None
        if len(fresh) > 1:
            dev = m.rows.device
            rows = torch.tensor([r for s in fresh for r in range(s.begin, s.end)], device=dev)
            seg = torch.tensor([j for j, s in enumerate(fresh) for _ in range(s.length)],
                               device=dev)
            pos = torch.tensor([d for s in fresh for d in range(s.length)], device=dev)
            m.memo["fresh"] = (rows, (seg[:, None] == seg[None, :])
                               & (pos[None, :] <= pos[:, None]))
    return m.memo["fresh"]


def _conv_plan(batch: ForwardBatch, k1: int) -> tuple[torch.Tensor, ...]:
    m = batch.multi
    if ("conv", k1) not in m.memo:
        plan = conv_spans_plan([s.length for s in batch.multi_row], k1)
        m.memo[("conv", k1)] = tuple(t.to(m.rows.device) for t in plan)
    return m.memo[("conv", k1)]


class Qwen35Model:
    """Weights plus the reference forward. Build with :meth:`load` or from a weight dict."""

    def __init__(self, cfg: ModelConfig, weights: MutableMapping[str, Weight],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kernels: Kernels | str = "auto",
                 unpack_bytes: int = UNPACK_BYTES, arena: bool = True) -> None:
        """``weights`` (a dict, or a :class:`~headstart.weights.LazyWeights` that reads each
        tensor when it is taken) is consumed: its entries move into the model (fused, prepared)
        one at a time and the mapping is left empty.

        ``unpack_bytes``: with the reference kernels, quantized linear weights are unpacked to
        ``dtype`` once at load when all of them together take at most this many bytes unpacked
        (else they stay packed and are unpacked per call; the GPU kernels read them packed).

        ``arena``: every final weight tensor (the head, the embedding table and the norms
        included) is a view into one allocation on ``device``, :attr:`arena`
        (:class:`~headstart.arena.WeightArena`; None when off). It is planned by running the
        loading pipeline once on meta stand-ins (shapes only), then each weight is copied into
        its slot as soon as it is made and the original dropped: from a ``LazyWeights`` (as
        :meth:`load` does), loading holds the arena plus one layer's weights in flight, never
        two copies of the model (a dict's caller holds its own copy until it is consumed)."""
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.kernels = kernels if isinstance(kernels, Kernels) else select_kernels(device, kernels)
        self.unpack_bytes = unpack_bytes
        shapes = stand_ins(weights)  # meta: nothing is read or copied
        unpack = self.kernels.name == "reference" and _unpack_fits(shapes, dtype, unpack_bytes)
        self.arena: WeightArena | None = None
        place: Callable[[str, Weight], Weight] = _as_is
        if arena:
            plan = ArenaPlan()
            self._consume(shapes, unpack, plan.add)
            self.arena = plan.allocate(self.device)
            place = self.arena.fill
        self.w, self.head = self._consume(weights, unpack, place)
        if self.arena is not None:
            self.arena.check_complete()
        self.rotary = Rotary.create(cfg.rotary_dim, cfg.rope_theta, self.device)
        # Layer index -> index within its kind, i.e. its row in the StatePool tensors.
        self.state_index = {i: n for n, i in enumerate(cfg.linear_layers)}
        self.state_index.update({i: n for n, i in enumerate(cfg.attention_layers)})

    def _consume(self, weights: MutableMapping[str, Weight], unpack: bool,
                 place: Callable[[str, Weight], Weight]) -> tuple[dict[str, Weight], Weight]:
        """The loading pipeline: every weight popped from ``weights`` (unpacked when ``unpack``,
        the reference path's small models), fused layer by layer, put in the form the kernels
        consume (the embedding table stays as loaded: rows are looked up), and handed to
        ``place`` (the arena's copy, or the plan's record) as soon as it is final. Returns
        (name -> weight, head); a tied head is its own prepared copy of the embedding table, or
        the table itself where preparing changes nothing.

        Runs on meta stand-ins too (to plan the arena), so it must depend only on shapes and
        dtypes, never on values."""
        def convert(k: str, t: Weight) -> Weight:
            return t.dequantize(self.dtype) if unpack and k != EMBED \
                and isinstance(t, QuantizedTensor) else t

        w: dict[str, Weight] = {}

        def take(keys: list[str]) -> None:
            for k in keys:  # each original is dropped once its placed form exists
                t = convert(k, weights.pop(k))
                w[k] = place(k, t if k == EMBED else self.kernels.prepare(t))

        for i in range(self.cfg.num_hidden_layers):
            fuse_layer(weights, i, convert)
            take([k for k in weights if k.startswith(f"layers.{i}.")])
        take(list(weights))
        if not self.cfg.tie_word_embeddings:
            return w, w["lm_head.weight"]
        head = self.kernels.prepare(w[EMBED])
        if self.kernels.name == "reference" and isinstance(head, QuantizedTensor) \
                and _unpack_fits({"head": head}, self.dtype, self.unpack_bytes):
            # A tied head shares the packed embedding table; unpack a copy under the same rule.
            head = head.dequantize(self.dtype)
        return w, place("head", head)

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", kernels: Kernels | str = "auto",
             unpack_bytes: int = UNPACK_BYTES, arena: bool = True) -> Qwen35Model:
        """Load a checkpoint folder; tensors are read one at a time as the model takes them."""
        cfg = load_config(model_dir)
        return cls(cfg, load_weights(model_dir, cfg, dtype, device, lazy=True), dtype, device,
                   kernels, unpack_bytes, arena)

    def state_groups(self) -> tuple[StateGroup, ...]:
        """Per GDN layer a conv tail (last K-1 pre-conv rows) and a recurrent state (fp32,
        HF/FLA layout); per attention layer post-norm, post-RoPE key and value rows."""
        cfg = self.cfg
        n_lin, n_att = len(cfg.linear_layers), len(cfg.attention_layers)
        kv = (cfg.num_key_value_heads, cfg.head_dim)
        return (StateGroup("conv", n_lin, (cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)),
                StateGroup("recurrent", n_lin, (cfg.linear_num_value_heads,
                                                cfg.linear_key_head_dim,
                                                cfg.linear_value_head_dim), torch.float32),
                StateGroup("keys", n_att, kv, token_axis=1),
                StateGroup("values", n_att, kv, token_axis=1))

    def new_state_pool(self, num_slots: int, max_tokens: int) -> StatePool:
        return StatePool.allocate(self.state_groups(), num_slots, max_tokens, self.dtype,
                                  self.device)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, pool: StatePool) -> torch.Tensor:
        """Run the batch, updating its slots in ``pool``; logits ``[R, vocab]`` of the asked rows."""
        return self.forward_ex(batch, pool).logits

    @torch.no_grad()
    def forward_ex(self, batch: ForwardBatch, pool: StatePool, taps: Sequence[int] = ()
                   ) -> ForwardOutput:
        """:meth:`forward`, plus the residual stream after each layer in ``taps`` for every row
        (the drafter's context features), and a :class:`GDNRecord` per span marked ``record``
        (to roll its GDN state back to any of its rows, see :meth:`rollback`)."""
        cfg, w = self.cfg, self.w
        records: dict[int, GDNRecord] = {s.slot: GDNRecord() for s in batch.spans
                                         if s.record or s.parents is not None}
        if batch.windows is not None and not batch.windows.span:  # keyed by stream index
            records.update({j: GDNRecord() for j in range(batch.windows.rows.shape[0])})
        tapped: list[torch.Tensor] = []
        for span in batch.spans:
            if span.start + span.length > pool.max_tokens:
                raise ValueError(
                    f"slot {span.slot}: {span.start + span.length} tokens exceed the pool's "
                    f"{pool.max_tokens}"
                )
        x = self.embed(batch.input_ids)
        # Rows that are all decode rows get RoPE inside the attention-input kernel.
        cos, sin = (None, None) if batch.all_decode is not None else \
            self.rotary.cos_sin(batch.positions, self.dtype)
        # Their attention lengths (the new row included), once for all layers.
        lengths = batch.all_decode.positions + 1 if batch.all_decode is not None else None
        add_norm, eps = self.kernels.add_rms_norm, cfg.rms_norm_eps
        pending: torch.Tensor | None = None  # the last MLP's output, added with the next norm
        for i, kind in enumerate(cfg.layer_types):
            p = f"layers.{i}."
            x, h = add_norm(x, pending, w[p + "input_layernorm.weight"], eps)
            if i - 1 in taps:
                tapped.append(x)
            if kind == FULL:
                h = self.attention(i, h, cos, sin, batch, pool, lengths)
            else:
                h = self.gated_deltanet(i, h, batch, pool, records)
            x, h = add_norm(x, h, w[p + "post_attention_layernorm.weight"], eps)
            pending = self.mlp(p + "mlp.", h)
        x = x + pending
        if cfg.num_hidden_layers - 1 in taps:
            tapped.append(x)
        if taps:
            assert len(tapped) == len(taps), "tap ids must be distinct layer indices"
        h = rms_norm(x[batch.logit_index], w["norm.weight"], eps)
        return ForwardOutput(self.lm_head(h), torch.cat(tapped, dim=-1) if taps else None,
                             records)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return linear(h, self.head)

    @torch.no_grad()
    def commit_tree(self, pool: StatePool, slot: int, start: int, record: GDNRecord,
                    path: Sequence[int]) -> None:
        """After a tree window: make the slot hold the state after the accepted ``path`` (row
        indices from the root): that node's GDN state and conv tail, and the path's KV rows
        moved to consecutive positions ``start ..``."""
        node = path[-1]
        for i, (states, tails) in record.tree.items():
            layer = self.state_index[i]
            pool.recurrent[layer, slot] = states[node]
            pool.conv[layer, slot] = tails[node]
        idx = torch.tensor([start + p for p in path], device=pool.keys.device)
        n = len(path)
        pool.keys[:, slot, :, start:start + n] = pool.keys[:, slot, :, idx].clone()
        pool.values[:, slot, :, start:start + n] = pool.values[:, slot, :, idx].clone()

    @torch.no_grad()
    def rollback(self, pool: StatePool, slot: int, record: GDNRecord, keep: int) -> None:
        """Set the slot's GDN state to what it was after the first ``keep`` rows of the recorded
        span, by replaying the recurrence over those rows from the recorded initial state.

        Attention KV rows need nothing: rows past the kept ones are simply never read (the next
        chunk starts at their position and overwrites them)."""
        cfg = self.cfg
        Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        for i, (tail, state, mixed, g, beta) in record.layers.items():
            layer = self.state_index[i]
            conv_w = self.w[f"layers.{i}.linear_attn.conv1d.weight"]
            y, pool.conv[layer, slot] = causal_conv(mixed[:keep], tail, conv_w)
            q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
            rule = recurrent_gated_delta if keep == 1 else chunked_gated_delta
            _, pool.recurrent[layer, slot] = rule(
                q.reshape(keep, Hk, Dk), k.reshape(keep, Hk, Dk), v.reshape(keep, Hv, Dv),
                g[:keep], beta[:keep], state)

    @torch.no_grad()
    def rollback_window(self, pool: StatePool, slot: torch.Tensor, records: WindowRecords,
                        window: torch.Tensor, keep: int) -> None:
        """:meth:`rollback` for a window recorded into shared buffers by a graphed window batch
        (``records``, window index ``window`` [1]), with ``slot`` [1] a tensor: no host work,
        so it can be captured. Replays the kept rows through the kernels' span recurrence."""
        cfg = self.cfg
        Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        dev = pool.conv.device
        cu = torch.tensor([0, keep], dtype=torch.int32)  # host copy: the reference kernels
        # [0, keep] made on the device (a copy from the host cannot be captured).
        cu_dev = torch.arange(0, 2 * keep, keep, dtype=torch.int32, device=dev)
        kept = torch.zeros(1, dtype=torch.bool, device=dev)
        for i in cfg.linear_layers:
            li = self.state_index[i]
            def pick(t: torch.Tensor, li: int = li) -> torch.Tensor:
                return t[li].index_select(0, window)[0]

            y, tail = causal_conv(pick(records.mixed)[:keep], pick(records.tail),
                                  self.w[f"layers.{i}.linear_attn.conv1d.weight"])
            pool.conv[li].index_copy_(0, slot, tail[None])
            pool.recurrent[li].index_copy_(0, slot, records.state[li].index_select(0, window))
            q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
            self.kernels.gdn_spans(q.reshape(keep, Hk, Dk), k.reshape(keep, Hk, Dk),
                                   v.reshape(keep, Hv, Dv), pick(records.g)[:keep],
                                   pick(records.beta)[:keep], cu_dev, slot, kept,
                                   pool.recurrent[li], cu)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.w["embed_tokens.weight"]
        if isinstance(table, QuantizedTensor):
            return table.dequantize(self.dtype, rows=ids)
        return table[ids]

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        return linear(self.kernels.silu_mul(linear(x, w[p + "gate_up_proj.weight"])),
                      w[p + "down_proj.weight"])

    def attention(self, i: int, x: torch.Tensor, cos: torch.Tensor | None,
                  sin: torch.Tensor | None, batch: ForwardBatch, pool: StatePool,
                  lengths: torch.Tensor | None = None) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, f"layers.{i}.self_attn."
        T, hd = x.shape[0], cfg.head_dim
        # q_proj is laid out per head as [query (hd) | gate (hd)].
        nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        qkv = linear(x, w[p + "qkv_proj.weight"])
        gate = qkv[:, :2 * nh * hd].view(T, nh, 2 * hd)[..., hd:]
        layer = self.state_index[i]
        keys, values = pool.keys[layer], pool.values[layer]
        d = batch.all_decode
        if d is not None:  # every row a decode row: norms, RoPE and the KV write in one kernel
            q = self.kernels.attn_decode_inputs(
                qkv, d.rows, nh, nkv, w[p + "q_norm.weight"], w[p + "k_norm.weight"],
                cfg.rms_norm_eps, self.rotary.inv_freq, keys, values, d.slots, d.positions)
            out = self.kernels.attn_decode(q, keys, values, d.slots, lengths)
            return linear(self.kernels.sigmoid_mul(out.reshape(T, -1), gate),
                          w[p + "o_proj.weight"])
        qg, k, v = torch.split(qkv, [2 * nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = qg.reshape(T, nh, 2 * hd)[..., :hd]
        k, v = k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        q = Rotary.apply(rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps), cos, sin)
        k = Rotary.apply(rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps), cos, sin)
        out = torch.empty_like(q)
        # Decode rows (one per stream), and graphed windows whose every row is a decode row of
        # its stream: write all the rows, then attend from the pool in place (a window's later
        # rows are masked by length).
        for d in (batch.decode, batch.windows.as_decode if batch.windows else None):
            if d is not None:
                keys[d.slots, :, d.positions] = k[d.rows]
                values[d.slots, :, d.positions] = v[d.rows]
                out[d.rows] = self.kernels.attn_decode(q[d.rows], keys, values, d.slots,
                                                       d.positions + 1)
        spans = batch.multi_row
        if len(spans) > 1:  # several spans: KV rows written at once, fresh prompts attended at once
            m = batch.multi
            row_slots, row_positions = _span_rows(batch)
            keys[row_slots, :, row_positions] = k[m.rows]
            values[row_slots, :, row_positions] = v[m.rows]
            fresh = _fresh_spans(batch)
            if fresh is not None:
                rows, mask = fresh
                out[rows] = self.kernels.attn_masked(q[rows], k[rows], v[rows], mask)
                spans = tuple(s for s in spans if s.start > 0)
        elif spans:
            s = spans[0]
            keys[s.slot, :, s.start:s.start + s.length] = k[s.begin:s.end].transpose(0, 1)
            values[s.slot, :, s.start:s.start + s.length] = v[s.begin:s.end].transpose(0, 1)
        for s in spans:
            end = s.start + s.length
            out[s.begin:s.end] = self.kernels.attn_span(q[s.begin:s.end], keys[s.slot, :, :end],
                                                        values[s.slot, :, :end], s.start)
        for s in batch.trees:  # token tree: each row sees the committed rows and its ancestors
            end = s.start + s.length
            keys[s.slot, :, s.start:end] = k[s.begin:s.end].transpose(0, 1)
            values[s.slot, :, s.start:end] = v[s.begin:s.end].transpose(0, 1)
            out[s.begin:s.end] = attend_tree(q[s.begin:s.end], keys[s.slot, :, :end],
                                             values[s.slot, :, :end], s.start,
                                             ancestry(s.parents))
        return linear(self.kernels.sigmoid_mul(out.reshape(T, -1), gate), w[p + "o_proj.weight"])

    def gated_deltanet(self, i: int, x: torch.Tensor, batch: ForwardBatch, pool: StatePool,
                       records: dict[int, GDNRecord] | None = None) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, f"layers.{i}.linear_attn."
        T = x.shape[0]
        Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        # One matmul for all four input projections: [q | k | v] (conv input), z, b, a.
        mixed, z, b, a = torch.split(linear(x, w[p + "in_proj.weight"]),
                                     [cfg.conv_dim, cfg.value_dim, Hv, Hv], dim=-1)
        z = z.view(T, Hv, Dv)
        A_log, dt_bias = w[p + "A_log"], w[p + "dt_bias"]
        d = batch.decode
        only_decode = d is not None and batch.all_decode is d
        if not only_decode:  # other rows' paths take the gates as tensors
            g, beta = gdn_gates(a, b, A_log, dt_bias)  # log decay (fp32), write strength

        layer = self.state_index[i]
        tails, states = pool.conv[layer], pool.recurrent[layer]
        conv_w = w[p + "conv1d.weight"]
        norm = (z, w[p + "norm.weight"], cfg.rms_norm_eps)
        core = None if only_decode else torch.empty(T, Hv, Dv, dtype=x.dtype, device=x.device)
        if d is not None:  # one row per stream: the step form, batched over streams
            # A new stream starts from zero tail and state, whatever its slot held (even NaN);
            # the kernels read the rows and compute the gates themselves (no gathers).
            y = self.kernels.conv_step_rows(mixed, d.rows, conv_w, tails, d.slots, d.fresh)
            q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
            n = q.shape[0]
            o = self.kernels.gdn_decode_gates(
                q.reshape(n, Hk, Dk), k.reshape(n, Hk, Dk), v.reshape(n, Hv, Dv), a, b, d.rows,
                A_log, dt_bias, d.slots, d.fresh, states, norm=norm if only_decode else None)
            if only_decode:  # the rows in order, output norm applied: straight to out_proj
                return linear(o.to(x.dtype).view(T, -1), w[p + "out_proj.weight"])
            core[d.rows] = o.to(x.dtype)
        wd = batch.windows
        if wd is not None and wd.span:  # a continued chunk by slot tensor (graph-capturable)
            rows, L = wd.rows[0], wd.rows.shape[1]
            y, tail = causal_conv(mixed[rows], tails.index_select(0, wd.slots)[0], conv_w)
            tails.index_copy_(0, wd.slots, tail[None])
            q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
            o = self.kernels.gdn_spans(
                q.reshape(L, Hk, Dk), k.reshape(L, Hk, Dk), v.reshape(L, Hv, Dv), g[rows],
                beta[rows], torch.arange(0, 2 * L, L, dtype=torch.int32, device=x.device),
                wd.slots, torch.zeros(1, dtype=torch.bool, device=x.device), states,
                torch.tensor([0, L], dtype=torch.int32))
            core[rows] = o.to(x.dtype)
        elif wd is not None:  # verify windows as W batched one-row steps (graph-capturable)
            n, W = wd.rows.shape
            if records is not None:  # inputs to replay any prefix of each window (rollback)
                flat = wd.rows.reshape(-1)
                tail0, state0 = tails[wd.slots], states[wd.slots]  # gathers: copies
                mixed_w, g_w, beta_w = (t[flat].view(n, W, -1) for t in (mixed, g, beta))
                buf = wd.records
                if buf is not None:  # into the shared buffers (graphs), kept as views
                    li = self.state_index[i]
                    parts = (buf.tail[li, :n], buf.state[li, :n], buf.mixed[li, :n, :W],
                             buf.g[li, :n, :W], buf.beta[li, :n, :W])
                    for dst, src in zip(parts, (tail0, state0, mixed_w, g_w, beta_w),
                                        strict=True):
                        dst.copy_(src)
                    tail0, state0, mixed_w, g_w, beta_w = parts
                for j in range(n):
                    records[j].layers[i] = (tail0[j], state0[j], mixed_w[j], g_w[j], beta_w[j])
            kept = torch.zeros(n, dtype=torch.bool, device=x.device)  # no window is fresh
            for t in range(W):  # the decode step's own kernels, so a window == one-row steps
                r = wd.columns[t]
                y = self.kernels.conv_step_rows(mixed, r, conv_w, tails, wd.slots, kept)
                q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
                o = self.kernels.gdn_decode_gates(q.reshape(n, Hk, Dk), k.reshape(n, Hk, Dk),
                                                  v.reshape(n, Hv, Dv), a, b, r, A_log, dt_bias,
                                                  wd.slots, kept, states)
                core[r] = o.to(x.dtype)
        m = batch.multi
        if m is not None and len(batch.multi_row) > 1:
            # Several spans: the conv of all of them in one pass, then one varlen recurrence.
            # A new stream starts from a zero tail and state, whatever its slot held.
            init = torch.where(m.fresh[:, None, None], 0.0, tails.index_select(0, m.slots))
            for j, s in enumerate(batch.multi_row):
                if s.record:  # inputs to replay any prefix of this span (rollback)
                    state = torch.zeros_like(states[s.slot]) if s.start == 0 else \
                        states[s.slot].clone()
                    records[s.slot].layers[i] = (init[j], state, mixed[s.begin:s.end],
                                                 g[s.begin:s.end], beta[s.begin:s.end])
            y, new_tails = causal_conv_spans(mixed[m.rows], init, conv_w,
                                             _conv_plan(batch, init.shape[-1]))
            tails.index_copy_(0, m.slots, new_tails.to(tails.dtype))
        elif m is not None:  # one span: conv, then the recurrence
            s = batch.multi_row[0]
            fresh = s.start == 0  # a new stream: zero tail and state, whatever the slot held
            tail = torch.zeros_like(tails[s.slot]) if fresh else tails[s.slot]
            if s.record:  # inputs to replay any prefix of this span (rollback)
                tail = tail.clone()
                state = torch.zeros_like(states[s.slot]) if fresh else states[s.slot].clone()
                records[s.slot].layers[i] = (tail, state, mixed[s.begin:s.end],
                                             g[s.begin:s.end], beta[s.begin:s.end])
            y, tails[s.slot] = causal_conv(mixed[s.begin:s.end], tail, conv_w)
        if m is not None:
            q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
            L = y.shape[0]
            o = self.kernels.gdn_spans(q.reshape(L, Hk, Dk), k.reshape(L, Hk, Dk),
                                       v.reshape(L, Hv, Dv), g[m.rows], beta[m.rows],
                                       m.cu_seqlens, m.slots, m.fresh, states, m.cu_seqlens_cpu)
            core[m.rows] = o.to(x.dtype)
        for s in batch.trees:
            o, node_states, node_tails = tree_gated_delta(
                mixed[s.begin:s.end], g[s.begin:s.end], beta[s.begin:s.end], s.parents,
                torch.zeros_like(tails[s.slot]) if s.start == 0 else tails[s.slot],
                torch.zeros_like(states[s.slot]) if s.start == 0 else states[s.slot], conv_w, cfg)
            core[s.begin:s.end] = o.to(x.dtype)
            if records is not None and s.slot in records:
                records[s.slot].tree[i] = (node_states, node_tails)
        return linear(self.kernels.gated_rms_norm(core, *norm), w[p + "out_proj.weight"])
