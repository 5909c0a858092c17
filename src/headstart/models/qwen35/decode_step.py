"""Qwen3.5's decode step as one function the engine can trace and compile (on the CPU).

:meth:`Qwen35Model.forward_ex` over a batch of decode rows, written for tracing: fixed shapes
for a given stream count, no host syncs, and no in-place writes into the pool's fixed-size
state, which a compiler would turn into copies of whole pool tensors. Instead the new conv
tails and recurrent states of the rows' slots are returned and the caller writes them back
(:mod:`headstart.engine.cpu_programs`); keys and values are written by the opaque attention op
(:func:`headstart.ops.attention.cpu.decode_attention`), which hides the history's length. The
math is the reference kernels' (the same functions), so the step equals the eager forward up to
the compiler's fusion (``tests/test_cpu_programs.py``).
"""

from __future__ import annotations

import torch

from headstart.models.qwen35.config import FULL
from headstart.models.qwen35.parts import StepParts
from headstart.ops.attention.cpu import decode_attention
from headstart.ops.conv.reference import causal_conv_step
from headstart.ops.gated_delta.reference import gated_delta_step
from headstart.ops.linear import linear
from headstart.ops.pointwise import reference as pointwise

__all__ = ["decode_step"]


def decode_step(
    m: StepParts,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    conv: torch.Tensor,
    recurrent: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode row per stream: token ``ids[i]`` at ``positions[i]`` of ``slots[i]`` (a fresh
    stream, ``fresh[i]``, ignores what its slot held), over the pool's group tensors ``conv``,
    ``recurrent``, ``keys``, ``values`` (``[layers, slots, ...]``, the state groups' order).
    Writes the rows' keys and values; returns (logits [n, vocab], the slots' new conv tails
    [linear layers, n, C, K-1] and recurrent states [linear layers, n, Hv, Dk, Dv])."""
    cfg, w = m.cfg, m.w
    eps, n = cfg.rms_norm_eps, ids.shape[0]
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    x = m.embed(ids)
    tails, states = [], []
    pending = None  # the last MLP's output, added with the next norm
    for i, kind in enumerate(cfg.layer_types):
        p, layer = f"layers.{i}.", m.state_index[i]
        x, h = pointwise.add_rms_norm(x, pending, w[p + "input_layernorm.weight"], eps)
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
            tail = torch.where(fresh[:, None, None], 0.0, conv[layer][slots])
            y, tail = causal_conv_step(mixed, tail, w[a + "conv1d.weight"])
            tails.append(tail.to(conv.dtype))
            qr, kr, vr = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
            g, beta = pointwise.gdn_gates(a_, b, w[a + "A_log"], w[a + "dt_bias"])
            state = torch.where(fresh[:, None, None, None], 0.0, recurrent[layer][slots])
            o, state = gated_delta_step(
                qr.reshape(n, Hk, Dk), kr.reshape(n, Hk, Dk), vr.reshape(n, Hv, Dv), g, beta, state
            )
            states.append(state)
            norm = w[a + "norm.weight"]
            o = pointwise.gated_rms_norm(o.to(x.dtype), z.view(n, Hv, Dv), norm, eps)
            h = linear(o, w[a + "out_proj.weight"])
        x, h = pointwise.add_rms_norm(x, h, w[p + "post_attention_layernorm.weight"], eps)
        pending = m.mlp(p + "mlp.", h)
    x = x + pending
    logits = m.lm_head(pointwise.rms_norm(x, w["norm.weight"], eps))
    return logits, torch.stack(tails), torch.stack(states)
