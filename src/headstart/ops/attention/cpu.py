"""Decode attention on the CPU as one opaque op, for traced decode programs
(:mod:`headstart.engine.cpu_programs`).

A traced program has fixed shapes, but a decode row attends to a history whose length changes
every step; this op hides that length from the trace. It writes each stream's new key and value
row into the pool at its position and attends each stream over its own slot's rows as views (no
gather of the histories, which at long contexts would copy megabytes a layer). The spec is the
reference: the same writes, then :func:`headstart.ops.attention.reference.attend_decode`.
"""

from __future__ import annotations

import torch

from headstart.ops.attention.reference import attend_decode

__all__ = ["GATHER_ROWS", "decode_attention"]

# Up to this many history rows in all, the streams' histories are gathered and attended in one
# batch (a copy of at most 2 x GATHER_ROWS x kv heads x head_dim values); above, each stream
# attends over its own slot's rows as views.
GATHER_ROWS = 8192


def _decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: int,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """q [n, nh, hd], k/v [n, nkv, hd] of one decode row per stream at ``positions`` of
    ``slots``; keys/values the pool's whole groups, [layers, slots, nkv, max_tokens, hd], of
    which ``layer``'s is written at those rows and read. (Whole groups, not a layer's view:
    two mutated views of one traced input came out wrong from inductor under a tracing
    context.) Returns [n, nh, hd] in q's dtype (softmax in fp32)."""
    keys, values = keys[layer], values[layer]
    keys[slots, :, positions] = k
    values[slots, :, positions] = v
    n, nh, hd = q.shape
    nkv = k.shape[1]
    longest = int(positions.max()) + 1
    if n > 1 and n * longest <= GATHER_ROWS:
        # Short histories: one batched attention over gathered copies beats n small ones.
        kr, vr = keys[slots, :, :longest], values[slots, :, :longest]
        return attend_decode(q, kr, vr, positions + 1)
    out = torch.empty_like(q)
    for j, (s, p) in enumerate(zip(slots.tolist(), positions.tolist(), strict=True)):
        kr, vr = keys[s, :, : p + 1], values[s, :, : p + 1]  # [nkv, p+1, hd] views
        qh = q[j].view(nkv, nh // nkv, hd)
        scores = torch.bmm(qh, kr.transpose(1, 2)).float() * hd**-0.5
        probs = scores.softmax(-1).to(vr.dtype)
        out[j] = torch.bmm(probs, vr).view(nh, hd)
    return out


# An operator of the low-level library API, not ``torch.library.custom_op``: custom_op's Python
# wrappers for a mutating op (aliasing checks, version bumps) cost more than the attention
# itself at short histories, once per layer of every traced decode step.
_LIB = torch.library.Library("headstart", "FRAGMENT")
_LIB.define(
    "decode_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor(a!) keys, Tensor(b!) values, "
    "int layer, Tensor slots, Tensor positions) -> Tensor"
)
_LIB.impl("decode_attention_cpu", _decode_attention, "CPU")


@torch.library.register_fake("headstart::decode_attention_cpu")
def _(q, k, v, keys, values, layer, slots, positions):
    return torch.empty_like(q)


decode_attention = torch.ops.headstart.decode_attention_cpu
