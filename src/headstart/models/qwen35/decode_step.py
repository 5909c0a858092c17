"""Qwen3.5's decode step as one function the engine can trace and compile (on the CPU).

:meth:`Qwen35Model.forward_ex` over a batch of decode rows, written for tracing: fixed shapes
for a given stream count, no host syncs, and no in-place writes into the pool's fixed-size
state, which a compiler would turn into copies of whole pool tensors. Instead the new conv
tails and recurrent states of the rows' slots are returned and the caller writes them back
(:mod:`headstart.engine.cpu_programs`); keys and values are written by the opaque attention op
(:func:`headstart.ops.attention.cpu.decode_attention`), which hides the history's length. The
math is the reference kernels' (the same functions), so the step equals the eager forward up to
the compiler's fusion (``tests/test_cpu_programs.py``).

With ``width`` > 1 the same function runs a *window*: ``width`` consecutive rows of each stream
(a short prompt chunk, such as the tail a chat prompt leaves after its snapshot boundary), the
last rows of a stream's window possibly padding past its ``lengths``. The matmuls and the
attention take every row at once (the attention op writes every row's keys and values before
any row attends, so a row sees the window's rows before it); the convolution runs over the
window, and the recurrence runs as one chunk (the chunked form) with padding rows' decay
and write strength zeroed, so they leave the state as it was. Padding rows write keys and
values past the stream's real rows, which later rows overwrite before anything reads them.

With ``every_row`` the window is a speculative *verify* window: every row's logits are
returned, and instead of the state after the last real row, the conv tail and recurrent state
after *each* row, so that committing the accepted rows is a copy of one row's state (no
replay). The recurrence then runs in its step form row by row (the decode step's own
arithmetic, so a window row computes what a decode row would), which at a verify window's few
rows is also cheaper here than the chunked form's triangular solve.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headstart.models.qwen35.config import FULL
from headstart.models.qwen35.parts import StepParts
from headstart.ops.attention.cpu import decode_attention
from headstart.ops.conv.reference import causal_conv_step
from headstart.ops.gated_delta.reference import chunked_gated_delta, gated_delta_step
from headstart.ops.linear import linear
from headstart.ops.pointwise import reference as pointwise

__all__ = ["decode_step"]


def decode_step(
    m: StepParts,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    lengths: torch.Tensor,
    conv: torch.Tensor,
    recurrent: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    width: int = 1,
    taps: tuple[int, ...] = (),
    every_row: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``width`` rows per stream (one: a decode row), stream after stream: token ``ids[r]`` at
    ``positions[r]`` of ``slots[r]`` for row ``r``; stream ``i``'s real rows are its first
    ``lengths[i]`` (ignored at width 1), and a fresh stream (``fresh[i]``) ignores what its
    slot held. Over the pool's group tensors ``conv``, ``recurrent``, ``keys``, ``values``
    (``[layers, slots, ...]``, the state groups' order). Writes the rows' keys and values;
    returns (logits of each stream's last real row [streams, vocab], the slots' new conv tails
    [linear layers, streams, C, K-1] and recurrent states [linear layers, streams, Hv, Dk,
    Dv]), and with ``taps`` the residual stream after each of those layers for every row,
    concatenated ``[rows, len(taps) * hidden]``, as ``forward_ex`` gives the drafter).

    ``every_row`` (a verify window, ``width`` > 1): every row's logits ``[rows, vocab]``, and
    the state after each row: conv tails ``[linear layers, streams, width, C, K-1]`` and
    recurrent states ``[linear layers, streams, width, Hv, Dk, Dv]`` (``lengths`` ignored)."""
    cfg, w = m.cfg, m.w
    eps, n = cfg.rms_norm_eps, ids.shape[0]
    streams = n // width
    stream_slots = slots[::width]
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    x = m.embed(ids)
    tails, states = [], []
    pending = None  # the last MLP's output, added with the next norm
    tapped = []
    for i, kind in enumerate(cfg.layer_types):
        p, layer = f"layers.{i}.", m.state_index[i]
        x, h = pointwise.add_rms_norm(x, pending, w[p + "input_layernorm.weight"], eps)
        if i - 1 in taps:
            tapped.append(x)
        if kind == FULL:
            a = p + "self_attn."
            qkv = linear(h, w[a + "qkv_proj.weight"])
            q, k, v = pointwise.decode_qkv(
                qkv, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                w[a + "q_norm.weight"], w[a + "k_norm.weight"], eps, m.rotary.inv_freq, positions,
            )  # fmt: skip
            o = decode_attention(q, k, v, keys, values, layer, slots, positions)
            gate = qkv[:, : 2 * q.shape[1] * cfg.head_dim].view(n, q.shape[1], -1)
            gate = gate[..., cfg.head_dim :]
            h = linear(pointwise.sigmoid_mul(o.reshape(n, -1), gate), w[a + "o_proj.weight"])
        else:
            a = p + "linear_attn."
            mixed, z, b, a_ = torch.split(
                linear(h, w[a + "in_proj.weight"]), [cfg.conv_dim, cfg.value_dim, Hv, Hv], dim=-1
            )
            tail = torch.where(fresh[:, None, None], 0.0, conv[layer][stream_slots])
            if width == 1:
                y, tail = causal_conv_step(mixed, tail, w[a + "conv1d.weight"])
            elif every_row:
                y, tail = _conv_rows(mixed, tail, w[a + "conv1d.weight"], width)
            else:
                y, tail = _conv_window(mixed, tail, w[a + "conv1d.weight"], lengths, width)
            tails.append(tail.to(conv.dtype))
            qr, kr, vr = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
            g, beta = pointwise.gdn_gates(a_, b, w[a + "A_log"], w[a + "dt_bias"])
            state = torch.where(fresh[:, None, None, None], 0.0, recurrent[layer][stream_slots])
            q3, k3, v3 = qr.reshape(n, Hk, Dk), kr.reshape(n, Hk, Dk), vr.reshape(n, Hv, Dv)
            if width == 1:
                o, state = gated_delta_step(q3, k3, v3, g, beta, state)
            elif every_row:
                o, state = _delta_rows(q3, k3, v3, g, beta, state, width)
            else:
                o, state = _delta_window(q3, k3, v3, g, beta, state, lengths, width)
            states.append(state)
            norm = w[a + "norm.weight"]
            o = pointwise.gated_rms_norm(o.to(x.dtype), z.view(n, Hv, Dv), norm, eps)
            h = linear(o, w[a + "out_proj.weight"])
        x, h = pointwise.add_rms_norm(x, h, w[p + "post_attention_layernorm.weight"], eps)
        pending = m.mlp(p + "mlp.", h)
    x = x + pending
    if cfg.num_hidden_layers - 1 in taps:
        tapped.append(x)
    if width > 1 and not every_row:  # each stream's last real row
        x = x.index_select(0, torch.arange(streams) * width + lengths - 1)
    logits = m.lm_head(pointwise.rms_norm(x, w["norm.weight"], eps))
    out = (logits, torch.stack(tails), torch.stack(states))
    return (*out, torch.cat(tapped, dim=-1)) if taps else out


def _conv_columns(
    x: torch.Tensor, tails: torch.Tensor, weight: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal conv over each stream's window: x [streams * width, C] continuing tails
    [streams, C, K-1]. Returns (silu(conv) [streams * width, C], the window's columns
    [streams, C, K-1 + width]: the tails, then the rows)."""
    C, k1 = x.shape[1], weight.shape[1] - 1
    window = torch.cat([tails.to(x.dtype), x.view(-1, width, C).transpose(1, 2)], dim=2)
    # The taps as one fused multiply-sum: a depthwise conv1d call cost more than the rest of
    # a layer here (oneDNN's primitive for a handful of columns).
    y = (window.unfold(2, k1 + 1, 1) * weight.to(x.dtype)[:, None, :]).sum(-1)  # [s, C, width]
    return F.silu(y).transpose(1, 2).reshape(-1, C), window


def _conv_window(
    x: torch.Tensor, tails: torch.Tensor, weight: torch.Tensor, lengths: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_conv_columns`, and the tails ending at each stream's last real row."""
    y, window = _conv_columns(x, tails, weight, width)
    C, k1 = window.shape[1], weight.shape[1] - 1
    at = lengths[:, None] + torch.arange(k1)  # window columns lengths .. lengths + K-2
    return y, window.gather(2, at[:, None, :].expand(-1, C, k1))


def _delta_window(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    lengths: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over each stream's window in chunked form, one chunk of ``width`` rows
    (matmuls: unrolled row by row, the compiled program was slower than eager here); rows past
    a stream's length get zero decay and zero write strength, so the state returned is the one
    after its last real row."""
    real = torch.arange(width)[None, :, None] < lengths[:, None, None]  # [streams, width, 1]
    g = torch.where(real, g.view(-1, width, g.shape[-1]), 0.0)
    beta = torch.where(real, beta.view(-1, width, beta.shape[-1]), 0.0)
    q, k, v = (t.view(-1, width, *t.shape[1:]) for t in (q, k, v))
    out, states = [], []
    for i in range(q.shape[0]):
        o, s = chunked_gated_delta(q[i], k[i], v[i], g[i], beta[i], state[i], chunk=width)
        out.append(o)
        states.append(s)
    state = torch.stack(states)
    return torch.stack(out).flatten(0, 1), state


def _conv_rows(
    x: torch.Tensor, tails: torch.Tensor, weight: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_conv_columns`, and the tail after each row [streams, width, C, K-1]."""
    y, window = _conv_columns(x, tails, weight, width)
    k1 = weight.shape[1] - 1
    return y, window[:, :, 1:].unfold(2, k1, 1).transpose(1, 2)  # row r: columns r+1 ..


def _delta_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over each stream's window one row at a time (the decode step's
    :func:`gated_delta_step` for all streams at once). Returns (outputs [streams * width, Hv,
    Dv], the state after each row [streams, width, Hv, Dk, Dv])."""
    q, k, v, g, beta = (t.view(-1, width, *t.shape[1:]) for t in (q, k, v, g, beta))
    out, states = [], []
    for r in range(width):
        o, state = gated_delta_step(q[:, r], k[:, r], v[:, r], g[:, r], beta[:, r], state)
        out.append(o)
        states.append(state)
    return torch.stack(out, dim=1).flatten(0, 1), torch.stack(states, dim=1)
