"""Decode attention on the CPU as one opaque op, for traced decode programs
(:mod:`headstart.engine.cpu_programs`).

A traced program has fixed shapes, but a decode row attends to a history whose length changes
every step; this op hides that length from the trace. It writes each stream's new key and value
row into the pool at its position and attends each stream over its own slot's rows as views (no
gather of the histories, which at long contexts would copy megabytes a layer). The spec is the
reference: the same writes, then :func:`headstart.ops.attention.reference.attend_decode`.

Over an fp32 pool the op runs ``decode_f32.c`` (built at first use, :mod:`headstart.ops.
c_build`): one call writes the rows and attends every stream. Why our own: in PyTorch the op is
a dozen small aten calls (the writes are index_puts), and at 16 streams it cost about 0.85 ms a
layer, most of it dispatch, against a step of about 10 ms (BENCHMARKS.md). Without a compiler,
or for other dtypes and layouts, the PyTorch path below runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from headstart.ops import c_build
from headstart.ops.attention.reference import attend_decode

__all__ = ["GATHER_ROWS", "decode_attention", "decode_attention_torch"]

# Up to this many history rows in all, the streams' histories are gathered and attended in one
# batch (a copy of at most 2 x GATHER_ROWS x kv heads x head_dim values); above, each stream
# attends over its own slot's rows as views.
GATHER_ROWS = 8192

SOURCE = Path(__file__).with_name("decode_f32.c")
_P, _I, _L = c_build.POINTER, c_build.INT, c_build.INT64
_ARGS = (_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _L, _L, _L, c_build.FLOAT, _P)


def _kernel():
    return c_build.function(SOURCE, "decode_attention_f32", _ARGS)


def _takes(q, k, v, keys, values, slots, positions) -> bool:
    """Whether the C kernel serves this call: fp32 throughout, int64 indices, rows of
    contiguous values, keys and values laid out alike, on a machine where it builds."""
    f32 = all(t.dtype == torch.float32 for t in (q, k, v, keys, values))
    return (
        f32
        and slots.dtype == positions.dtype == torch.int64
        and keys.stride() == values.stride()
        and keys.stride(-1) == 1
        and _kernel() is not None
    )


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
    if not _takes(q, k, v, keys, values, slots, positions):
        return decode_attention_torch(q, k, v, keys, values, slots, positions)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    slots, positions = slots.contiguous(), positions.contiguous()
    n, nh, hd = q.shape
    out = torch.empty_like(q)
    rc = _kernel()(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), keys.data_ptr(), values.data_ptr(),
        slots.data_ptr(), positions.data_ptr(), n, nh, k.shape[1], hd,
        keys.stride(0), keys.stride(1), keys.stride(2), hd**-0.5, out.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("the CPU decode attention could not allocate its scratch")
    return out


def decode_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """The op in PyTorch, over one layer's ``keys`` and ``values`` [slots, nkv, max_tokens,
    hd]: the C kernel's reference, and the path for what it does not take."""
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
_LIB.impl("decode_attention_cpu", _decode_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("headstart::decode_attention_cpu")
def _(q, k, v, keys, values, layer, slots, positions):
    return torch.empty_like(q)


decode_attention = torch.ops.headstart.decode_attention_cpu
