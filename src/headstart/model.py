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

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from headstart.batch import ForwardBatch
from headstart.config import FULL, ModelConfig, load_config
from headstart.ops.attention import attend, attend_decode
from headstart.ops.gated_delta import chunked_gated_delta, gated_delta_step, recurrent_gated_delta
from headstart.ops.short_conv import causal_conv, causal_conv_step
from headstart.quant import QuantizedTensor
from headstart.state import StatePool
from headstart.weights import Weight, load_weights


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    # CPU reference: quantized weights are dequantized per call, so memory holds only the packed
    # form; the GPU path (a later stage) consumes the packed words directly.
    if isinstance(w, QuantizedTensor):
        return x @ w.dequantize(x.dtype).T
    return F.linear(x, w)


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm; ``scale`` is the multiplier ``1 + w`` in fp32. Rounds once at the end."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale
    return y.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
                   ) -> torch.Tensor:
    """GDN output norm (plain weight, no +1), then ``* silu(gate)``; rounds twice, as HF does."""
    x32 = x.float()
    n = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight.to(x.dtype) * n
    return (y * F.silu(gate.float())).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class Rotary:
    """Partial rotate-half RoPE on the first ``rotary_dim`` dims of each head."""

    inv_freq: torch.Tensor  # [rotary_dim / 2] fp32

    @classmethod
    def create(cls, cfg: ModelConfig, device: torch.device | str) -> Rotary:
        rd = cfg.rotary_dim
        exponent = torch.arange(0, rd, 2, dtype=torch.int64, device=device).float() / rd
        return cls(1.0 / (cfg.rope_theta ** exponent))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rd]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = cos.shape[-1]
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


@dataclass
class GDNRecord:
    """One span's GDN inputs per layer: (initial tail, initial state, pre-conv rows, g, beta)."""

    layers: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [R, vocab]
    taps: torch.Tensor | None  # [T, len(taps) * hidden]
    records: dict[int, GDNRecord]  # by slot


class Qwen35Model:
    """Weights plus the reference forward. Build with :meth:`load` or from a weight dict."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Weight],
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.w = weights
        self.dtype = dtype
        self.device = torch.device(device)
        self.rotary = Rotary.create(cfg, self.device)
        # Layer index -> index within its kind, i.e. its row in the StatePool tensors.
        self.state_index = {i: n for n, i in enumerate(cfg.linear_layers)}
        self.state_index.update({i: n for n, i in enumerate(cfg.attention_layers)})

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> Qwen35Model:
        cfg = load_config(model_dir)
        return cls(cfg, load_weights(model_dir, cfg, dtype, device), dtype, device)

    def new_state_pool(self, num_slots: int, max_tokens: int) -> StatePool:
        return StatePool.allocate(self.cfg, num_slots, max_tokens, self.dtype, self.device)

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
        records: dict[int, GDNRecord] = {s.slot: GDNRecord() for s in batch.spans if s.record}
        tapped: list[torch.Tensor] = []
        for span in batch.spans:
            if span.start + span.length > pool.max_tokens:
                raise ValueError(
                    f"slot {span.slot}: {span.start + span.length} tokens exceed the pool's "
                    f"{pool.max_tokens}"
                )
        x = self.embed(batch.input_ids)
        cos, sin = self.rotary.cos_sin(batch.positions, self.dtype)
        for i, kind in enumerate(cfg.layer_types):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            if kind == FULL:
                h = self.attention(i, h, cos, sin, batch, pool)
            else:
                h = self.gated_deltanet(i, h, batch, pool, records)
            x = x + h
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            x = x + self.mlp(p + "mlp.", h)
            if i in taps:
                tapped.append(x)
        if taps:
            assert len(tapped) == len(taps), "tap ids must be distinct layer indices"
        h = rms_norm(x[batch.logit_index], w["norm.weight"], cfg.rms_norm_eps)
        return ForwardOutput(self.lm_head(h), torch.cat(tapped, dim=-1) if taps else None,
                             records)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        w = self.w
        return linear(h, w["embed_tokens.weight" if self.cfg.tie_word_embeddings
                           else "lm_head.weight"])

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

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.w["embed_tokens.weight"]
        if isinstance(table, QuantizedTensor):
            return table.dequantize(self.dtype, rows=ids)
        return table[ids]

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        return linear(F.silu(linear(x, w[p + "gate_proj.weight"])) * linear(x, w[p + "up_proj.weight"]),
                      w[p + "down_proj.weight"])

    def attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  batch: ForwardBatch, pool: StatePool) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, f"layers.{i}.self_attn."
        T, hd = x.shape[0], cfg.head_dim
        # q_proj is laid out per head as [query (hd) | gate (hd)].
        qg = linear(x, w[p + "q_proj.weight"]).view(T, cfg.num_attention_heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, -1)
        k = linear(x, w[p + "k_proj.weight"]).view(T, cfg.num_key_value_heads, hd)
        v = linear(x, w[p + "v_proj.weight"]).view(T, cfg.num_key_value_heads, hd)
        q = Rotary.apply(rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps), cos, sin)
        k = Rotary.apply(rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps), cos, sin)

        layer = self.state_index[i]
        keys, values = pool.keys[layer], pool.values[layer]
        out = torch.empty_like(q)
        d = batch.decode
        if d is not None:  # one row per stream: write the rows, attend in one batch
            keys[d.slots, :, d.positions] = k[d.rows]
            values[d.slots, :, d.positions] = v[d.rows]
            out[d.rows] = attend_decode(q[d.rows], keys[d.slots, :, :d.max_len],
                                        values[d.slots, :, :d.max_len], d.positions + 1)
        for s in batch.multi_row:
            end = s.start + s.length
            keys[s.slot, :, s.start:end] = k[s.begin:s.end].transpose(0, 1)
            values[s.slot, :, s.start:end] = v[s.begin:s.end].transpose(0, 1)
            out[s.begin:s.end] = attend(q[s.begin:s.end], keys[s.slot, :, :end],
                                        values[s.slot, :, :end], s.start)
        out = out.reshape(T, -1) * torch.sigmoid(gate)
        return linear(out, w[p + "o_proj.weight"])

    def gated_deltanet(self, i: int, x: torch.Tensor, batch: ForwardBatch, pool: StatePool,
                       records: dict[int, GDNRecord] | None = None) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, f"layers.{i}.linear_attn."
        T = x.shape[0]
        Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        mixed = linear(x, w[p + "in_proj_qkv.weight"])  # [T, conv_dim] = [q | k | v]
        z = linear(x, w[p + "in_proj_z.weight"]).view(T, Hv, Dv)
        beta = torch.sigmoid(linear(x, w[p + "in_proj_b.weight"]))
        a = linear(x, w[p + "in_proj_a.weight"])
        g = -w[p + "A_log"].exp() * F.softplus(a.float() + w[p + "dt_bias"])  # log decay, fp32

        layer = self.state_index[i]
        tails, states = pool.conv[layer], pool.recurrent[layer]
        conv_w = w[p + "conv1d.weight"]
        core = torch.empty(T, Hv, Dv, dtype=x.dtype, device=x.device)
        d = batch.decode
        if d is not None:  # one row per stream: the step form, batched over streams
            # A new stream starts from zero tail and state, whatever its slot held (even NaN).
            fresh = d.fresh[:, None, None]
            tail = torch.where(fresh, 0.0, tails[d.slots])
            y, tails[d.slots] = causal_conv_step(mixed[d.rows], tail, conv_w)
            q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
            n = q.shape[0]
            state = torch.where(fresh[..., None], 0.0, states[d.slots])
            o, states[d.slots] = gated_delta_step(q.reshape(n, Hk, Dk), k.reshape(n, Hk, Dk),
                                                  v.reshape(n, Hv, Dv), g[d.rows], beta[d.rows],
                                                  state)
            core[d.rows] = o.to(x.dtype)
        for s in batch.multi_row:
            fresh = s.start == 0  # a new stream: zero tail and state, whatever the slot held
            tail = torch.zeros_like(tails[s.slot]) if fresh else tails[s.slot]
            if s.record:  # the slot's tail is overwritten below; keep the initial one
                tail = tail.clone()
            y, tails[s.slot] = causal_conv(mixed[s.begin:s.end], tail, conv_w)
            q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
            L = s.length
            state = torch.zeros_like(states[s.slot]) if fresh else states[s.slot]
            if s.record and records is not None:  # inputs to replay any prefix of this span
                records[s.slot].layers[i] = (tail, state.clone(), mixed[s.begin:s.end],
                                             g[s.begin:s.end], beta[s.begin:s.end])
            o, states[s.slot] = chunked_gated_delta(q.reshape(L, Hk, Dk), k.reshape(L, Hk, Dk),
                                     v.reshape(L, Hv, Dv), g[s.begin:s.end], beta[s.begin:s.end],
                                     state)
            core[s.begin:s.end] = o.to(x.dtype)
        out = gated_rms_norm(core, z, w[p + "norm.weight"], cfg.rms_norm_eps)
        return linear(out.reshape(T, -1), w[p + "out_proj.weight"])
