"""The sequence-mixing cores and quantized matmul, chosen once at start-up.

The model's forward calls these through a :class:`Kernels` value and never branches on the
platform itself. Three sets exist with the same signatures:

* ``reference``: pure PyTorch (the ``reference`` module of each :mod:`headstart.ops` family), runs
  anywhere; the executable spec.
* ``cpu``: the reference with prefill attention through PyTorch's SDPA (its CPU flash kernel)
  and a one-stream span's GDN convolution in a small C kernel; tested against the reference
  (``tests/test_kernels_cpu.py``).
* ``gpu``: CUDA + Triton: in-place GDN decode step and flash-decoding attention straight from the
  slot pools (no gathers of whole states or histories), flash-linear-attention's chunked kernel
  for multi-row spans, a fused 4-bit matmul on the MLX layout, the GDN convolution of prefill
  rows in two kernels (:mod:`headstart.ops.conv.triton`), and one kernel per per-row piece
  of :mod:`headstart.ops.pointwise.reference` (:mod:`headstart.ops.pointwise.triton`); the
  ``triton`` module beside each reference, and ``ops/gated_delta/fla.py``. Every GPU kernel is
  tested against its reference (``tests/test_gpu_ops.py``, ``tests/test_fused_ops.py``).

:func:`select_kernels` picks ``gpu`` on a CUDA device when Triton and flash-linear-attention import,
``cpu`` on any other device (``reference`` on CUDA without them), and logs the choice.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from headstart.ops.attention import sdpa
from headstart.ops.attention.reference import attend, attend_chunk, attend_decode
from headstart.ops.conv.reference import (
    causal_conv,
    causal_conv_padded,
    causal_conv_spans,
    causal_conv_upto,
)
from headstart.ops.gated_delta.reference import chunked_gated_delta, gated_delta_step
from headstart.ops.pointwise import reference as pointwise

log = logging.getLogger("headstart.kernels")


def _ref_gdn_decode_gates(
    q, k, v, a, b, rows, A_log, dt_bias, slots, fresh, states, norm=None, width=1, row_states=None
):
    if width > 1 or row_states is not None:  # a window: that many one-row steps
        n = slots.shape[0]
        kept = torch.zeros(n, dtype=torch.bool, device=fresh.device)
        outs = []
        for t in range(width):
            at = rows.view(n, width)[:, t]
            step = [x.unflatten(0, (n, width))[:, t] for x in (q, k, v)]
            start = fresh if t == 0 else kept
            outs.append(
                _ref_gdn_decode_gates(*step, a, b, at, A_log, dt_bias, slots, start, states, norm)
            )
            if row_states is not None:
                row_states[:, t] = states[slots]
        return torch.stack(outs, 1).flatten(0, 1)
    g, beta = pointwise.gdn_gates(a[rows], b[rows], A_log, dt_bias)
    state = torch.where(fresh[:, None, None, None], 0.0, states[slots])
    o, states[slots] = gated_delta_step(q, k, v, g, beta, state)
    if norm is None:
        return o
    z, weight, eps = norm
    return pointwise.gated_rms_norm(o.to(v.dtype), z, weight, eps, gate_rows=rows).view(o.shape)


def _ref_gdn_spans(q, k, v, g, beta, cu_seqlens, slots, fresh, states, cu_seqlens_cpu, chunk=64):
    """Per span, the chunked reference (``cu_seqlens_cpu`` gives the spans on the host)."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    bounds = cu_seqlens_cpu.tolist()
    for n, slot in enumerate(slots.tolist()):
        a, b = bounds[n], bounds[n + 1]
        state = torch.zeros_like(states[slot]) if bool(fresh[n]) else states[slot]
        out[a:b], states[slot] = chunked_gated_delta(
            q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state, chunk
        )
    return out


def _ref_gdn_padded(q, k, v, g, beta, slots, states, initial=None):
    """Per stream, the chunked reference over all its rows (padding rows included: the caller
    gave them zero decay and zero beta, so they leave the state as it was), from a zero state
    or from ``initial[j]``."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for j in range(q.shape[0]):
        start = torch.zeros_like(states[0]) if initial is None else initial[j].float()
        out[j], states[slots[j]] = chunked_gated_delta(q[j], k[j], v[j], g[j], beta[j], start)
    return out


def _each_fresh_span(attn_span: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``attn_fresh_spans`` from a one-span ``attn_span``: each packed new prompt attended on its
    own rows (start 0)."""

    def fresh_spans(q, k, v, cu_seqlens, cu_seqlens_cpu):
        out = torch.empty_like(q)
        for a, b in itertools.pairwise(cu_seqlens_cpu.tolist()):
            out[a:b] = attn_span(q[a:b], k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), 0)
        return out

    return fresh_spans


_ref_attn_fresh_spans = _each_fresh_span(attend)


def _ref_attn_padded(q, k, v):
    out = torch.empty_like(q)
    for j in range(q.shape[0]):
        out[j] = attend(q[j], k[j].transpose(0, 1), v[j].transpose(0, 1), 0)
    return out


def _ref_attn_decode(q, keys, values, slots, lengths):
    longest = int(lengths.max())  # a host sync: fine for the reference
    return attend_decode(q, keys[slots, :, :longest], values[slots, :, :longest], lengths)


def _no_prepare(w: Any, dense: torch.dtype | None = None) -> Any:
    return w


@dataclass(frozen=True)
class Kernels:
    name: str
    # One GDN step per stream, gates computed from the raw projections: (q [n,Hk,Dk], k,
    # v [n,Hv,Dv], a [T,Hv], b [T,Hv], rows [n], A_log, dt_bias, slots [n], fresh [n] bool,
    # state pool [slots,Hv,Dk,Dv] fp32 updated in place, norm=None) -> o [n,Hv,Dv]; with
    # norm=(z [T,Hv,Dv], weight, eps), o after pointwise.gated_rms_norm with z at the same rows;
    # width=W > 1: W rows per stream, stream after stream (q/k/v [n*W, ...], rows [n*W]), as W
    # one-row steps in one call (a verify window), o [n*W,Hv,Dv]; row_states [n,W,Hv,Dk,Dv]
    # fp32: the state after each row, written there (conv_step_rows: the same with row_tails)
    gdn_decode_gates: Callable[..., torch.Tensor]
    # (q, k, v, g, beta packed [T, ...], cu_seqlens [N+1], slots [N], fresh [N], state pool,
    #  cu_seqlens on the host) -> o [T,Hv,Dv]
    gdn_spans: Callable[..., torch.Tensor]
    # (q [n,nh,hd], keys/values [slots,nkv,max_tokens,hd], slots [n], lengths [n]) -> [n,nh,hd]
    attn_decode: Callable[..., torch.Tensor]
    # (q [T,nh,hd] at positions start.., keys/values [nkv, start+T, hd], start) -> [T,nh,hd]
    attn_span: Callable[..., torch.Tensor] = attend
    # (q [F,nh,hd], k/v [F,nkv,hd], cu_seqlens [N+1] int32, the same on the host) -> [F,nh,hd]:
    # several new streams' prompts packed, each attending causally to its own rows
    attn_fresh_spans: Callable[..., torch.Tensor] = _ref_attn_fresh_spans
    # (q [N,L,nh,hd], k/v [N,L,nkv,hd]) -> [N,L,nh,hd]: new prompts padded to L rows, causal
    # within each (graph-capturable)
    attn_padded: Callable[..., torch.Tensor] = _ref_attn_padded
    # (q, k [N,L,Hk,Dk], v [N,L,Hv,Dv], g, beta [N,L,Hv], slots [N], state pool,
    # initial=None) -> o [N,L,Hv,Dv] fp32: streams padded to L rows from a zero state (new
    # prompts) or from ``initial`` [N,Hv,Dk,Dv] (a verify window replayed); final states
    # written to the pool's slots (graph-capturable)
    gdn_padded: Callable[..., torch.Tensor] = _ref_gdn_padded
    # (a loaded weight, dense=None) -> the form linear() consumes (e.g. a repacked quantized
    # weight; with dense=dtype, one that also keeps an unpacked copy for prefill)
    prepare: Callable[..., Any] = _no_prepare
    graphs: bool = False  # whether the decode forward may be captured in CUDA graphs
    # Whether ``prepare`` hands quantized weights to a fused matmul of this set (which may keep
    # a dense copy for prefill); False: PyTorch's matmul, so a model unpacks them when they fit.
    fused_matmul: bool = False
    # The per-row pieces around the matmuls, signatures as in headstart.ops.pointwise.reference.
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = pointwise.add_rms_norm
    gated_rms_norm: Callable[..., torch.Tensor] = pointwise.gated_rms_norm
    silu_mul: Callable[..., torch.Tensor] = pointwise.silu_mul
    sigmoid_mul: Callable[..., torch.Tensor] = pointwise.sigmoid_mul
    gdn_gates: Callable[..., tuple[torch.Tensor, torch.Tensor]] = pointwise.gdn_gates
    conv_step_rows: Callable[..., torch.Tensor] = pointwise.conv_step_rows
    attn_decode_inputs: Callable[..., torch.Tensor] = pointwise.attn_decode_inputs
    # (q [W,nh,hd] at positions start.. of stream slot, keys/values [slots,nkv,max_tokens,hd]
    # with the rows written, slot [1], start [1] tensors) -> [W,nh,hd] (graph-capturable)
    attn_chunk: Callable[..., torch.Tensor] = attend_chunk
    # (x [T,C], tail [C,K-1], weight [C,K]) -> (silu(conv) [T,C], new tail [C,K-1]): the GDN
    # convolution of one stream's multi-row span
    conv_span: Callable[..., tuple[torch.Tensor, torch.Tensor]] = causal_conv
    # The GDN convolution of the other multi-row shapes, signatures as in ops/conv/reference.py:
    # one span whose real rows are the first ``length`` (graph-capturable), new prompts padded
    # to one length (graph-capturable; tails straight into the pool, q/k/v as dense tensors),
    # several spans of one forward.
    conv_upto: Callable[..., tuple[torch.Tensor, torch.Tensor]] = causal_conv_upto
    conv_padded: Callable[..., tuple[torch.Tensor, torch.Tensor]] = causal_conv_padded
    conv_spans: Callable[..., tuple[torch.Tensor, torch.Tensor]] = causal_conv_spans


REFERENCE = Kernels("reference", _ref_gdn_decode_gates, _ref_gdn_spans, _ref_attn_decode)


def cpu_kernels() -> Kernels:
    """The reference with prefill attention through PyTorch's SDPA, whose CPU flash kernel
    skips the masked half and materializes no scores: 4000 causal rows (4 heads of 64 over 2
    KV heads) took 238 ms against the reference's 1,871 ms on one core of this project's CI
    machine. Decode rows and graph chunks keep the reference (one row per stream: nothing to
    skip). A one-stream span's GDN convolution is a small C kernel (``ops/conv/cpu.py``: 0.9
    against 6.8 ms for 1,000 rows of 768 channels)."""
    from headstart.ops.conv import cpu as cpu_conv

    return replace(
        REFERENCE,
        name="cpu",
        attn_span=sdpa.attn_span,
        attn_fresh_spans=_each_fresh_span(sdpa.attn_span),
        attn_padded=sdpa.attn_padded,
        conv_span=cpu_conv.causal_conv,
        # Chunks of 32 rows, not 64: measured faster on a CPU at the default model's heads and
        # no slower at 2B's (BENCHMARKS.md, "CPU: prompt steps on both cores").
        gdn_spans=functools.partial(_ref_gdn_spans, chunk=32),
    )


def gpu_kernels() -> Kernels:
    from headstart.ops.attention.triton import chunk_attention, decode_attention
    from headstart.ops.conv import triton as gpu_conv
    from headstart.ops.gated_delta.fla import gdn_prefill_varlen
    from headstart.ops.gated_delta.triton import gdn_decode_gates
    from headstart.ops.pointwise import triton as gpu_fused
    from headstart.ops.quant_matmul.triton import prepare as prepare_quant
    from headstart.quant import QuantizedTensor

    def spans(q, k, v, g, beta, cu_seqlens, slots, fresh, states, cu_seqlens_cpu):
        return gdn_prefill_varlen(
            q, k, v, g, beta, cu_seqlens, slots, fresh, states, cu_seqlens_cpu=cu_seqlens_cpu
        )

    def prepare(w: Any, dense: torch.dtype | None = None) -> Any:
        return prepare_quant(w, dense=dense) if isinstance(w, QuantizedTensor) else w

    from headstart.ops.gated_delta.triton import gdn_padded

    return Kernels(
        "gpu",
        gdn_decode_gates,
        spans,
        decode_attention,
        sdpa.attn_span,
        sdpa.attn_fresh_spans,
        sdpa.attn_padded,
        gdn_padded,
        prepare,
        graphs=True,
        fused_matmul=True,
        add_rms_norm=gpu_fused.add_rms_norm,
        gated_rms_norm=gpu_fused.gated_rms_norm,
        silu_mul=gpu_fused.silu_mul,
        sigmoid_mul=gpu_fused.sigmoid_mul,
        gdn_gates=gpu_fused.gdn_gates,
        conv_step_rows=gpu_fused.conv_step_rows,
        attn_decode_inputs=gpu_fused.attn_decode_inputs,
        attn_chunk=chunk_attention,
        conv_span=gpu_conv.causal_conv,
        conv_upto=gpu_conv.causal_conv_upto,
        conv_padded=gpu_conv.causal_conv_padded,
        conv_spans=gpu_conv.causal_conv_spans,
    )


def select_kernels(device: torch.device | str, want: str = "auto") -> Kernels:
    """``want``: "auto" (the GPU set on CUDA, else the CPU set), "reference", "cpu" or "gpu"."""
    device = torch.device(device)
    if want == "reference":
        chosen = REFERENCE
    elif want == "cpu" or (want == "auto" and device.type != "cuda"):
        chosen = cpu_kernels()
    else:
        try:
            from headstart.ops.gated_delta import fla as fla_gdn

            if device.type == "cuda":
                fla_gdn.use_shipped_configs(device)
            import fla  # noqa: F401
            import triton  # noqa: F401

            chosen = gpu_kernels()
            fla_gdn.import_in_background()  # while the weights load (after the configs' env)
        except ImportError as e:
            if want == "gpu":
                raise
            log.warning("GPU kernels unavailable (%s); using the PyTorch reference", e)
            chosen = REFERENCE
    log.info("kernels: %s on %s", chosen.name, device)
    return chosen
