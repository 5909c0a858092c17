"""Qwen3.5's weight-loading pipeline: checkpoint tensors to the weights the forward reads.

Projections that read the same input are stacked into one weight (one matmul instead of two to
four), quantized weights are unpacked once where the reference path gains from it, and every
weight is put in the form the kernels consume and handed to ``place`` (the arena's copy, or the
arena plan's record) as soon as it is final. The pipeline runs on meta stand-ins too, to plan the
arena, so it depends only on shapes and dtypes, never on values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from headstart.models.contract import dense_copy_budget
from headstart.models.qwen35.config import ModelConfig
from headstart.models.qwen35.weights import Weight
from headstart.ops.quant_matmul import cpu as cpu_quant
from headstart.ops.quant_matmul import cpu_f32
from headstart.ops.quant_matmul.cpu import UNPACK_BYTES
from headstart.quant import QuantizedTensor

__all__ = [
    "EMBED",
    "FUSED",
    "HEAD",
    "UNPACK_BYTES",
    "Convert",
    "consume",
    "dense_budget",
    "fuse_layer",
    "layer_bytes",
    "layer_of",
    "layers_within",
    "unpack_fits",
]


FUSED = {  # fused weight -> the checkpoint's projections it stacks along the output dimension
    "linear_attn.in_proj.weight": (
        "linear_attn.in_proj_qkv.weight",
        "linear_attn.in_proj_z.weight",
        "linear_attn.in_proj_b.weight",
        "linear_attn.in_proj_a.weight",
    ),
    "self_attn.qkv_proj.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` along rows; on the meta device (arena planning) the result's shape alone:
    an op there runs Python meta functions, and its first use imports torch's compiler stack
    (seconds of a start-up)."""
    if not parts[0].is_meta:
        return torch.cat(parts, dim=0)
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in parts))
    rows = sum(t.shape[0] for t in parts)
    return torch.empty(rows, *parts[0].shape[1:], dtype=dtype, device="meta")


def _stack(parts: list[Weight]) -> Weight:
    if all(isinstance(t, torch.Tensor) for t in parts):
        return _cat(parts)
    first = parts[0]
    assert all(
        isinstance(t, QuantizedTensor) and t.bits == first.bits and t.group_size == first.group_size
        for t in parts
    )
    return QuantizedTensor(
        _cat([t.packed for t in parts]),
        _cat([t.scales for t in parts]),
        _cat([t.biases for t in parts]),
        first.bits,
        first.group_size,
    )


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
        kinds = {
            (t.bits, t.group_size) if isinstance(t, QuantizedTensor) else None for t in tensors
        }
        if len(kinds) > 1:  # mixed: bring every part to full precision
            dtype = (
                next(t.dtype for t in tensors if isinstance(t, torch.Tensor))
                if any(isinstance(t, torch.Tensor) for t in tensors)
                else torch.float32
            )
            tensors = [
                t.dequantize(dtype) if isinstance(t, QuantizedTensor) else t for t in tensors
            ]
        weights[p + fused] = _stack(tensors)


# On the GPU, prefill-sized matmuls on a 4-bit weight unpack it whole per call (at 27B on an
# H200 that is 18 ms of a 72 ms burst step) unless a dense copy is kept. At load, copies are
# kept when all of them fit this fraction of the device's memory, leaving the rest to the
# packed weights (which decode reads) and the state pool: at 27B, 51 GB of copies fit a 141 GB
# H200, not an 80 GB GPU. There ``serve`` keeps those of the first layers that fit beside the
# state pool once its size is known (``Qwen35Model.keep_dense_copies``).
DENSE_FRACTION = 0.4


def dense_budget(device: torch.device) -> int:
    """Bytes the dense prefill copies may take on ``device`` by default (0 off CUDA): the
    fraction above of its memory, and never more than half of what is free before loading
    (another process may hold part of the GPU)."""
    if device.type != "cuda":
        return 0
    return dense_copy_budget(DENSE_FRACTION, *torch.cuda.mem_get_info(device))


EMBED = "embed_tokens.weight"
HEAD = "lm_head.weight"


def layer_of(name: str) -> int | None:
    """The layer index of a ``layers.<i>.`` weight name; None for any other name."""
    head, _, rest = name.partition(".")
    index = rest.partition(".")[0]
    return int(index) if head == "layers" and index.isdigit() else None


def layer_bytes(
    weights: Mapping[str, Any], dtype: torch.dtype, num_layers: int, copyable: Callable[[Any], bool]
) -> list[int]:
    """Bytes a dense ``dtype`` copy of each layer's ``copyable`` weights takes (``layers.<i>.``
    names; their ``shape`` only, so meta stand-ins do)."""
    size = torch.tensor([], dtype=dtype).element_size()
    per_layer = [0] * num_layers
    for k, t in weights.items():
        i = layer_of(k)
        if i is not None and i < num_layers and copyable(t):
            per_layer[i] += t.shape[0] * t.shape[1] * size
    return per_layer


def layers_within(per_layer: list[int], budget: int) -> int:
    """How many layers, from the first, fit ``budget`` bytes together (0 where none has bytes)."""
    if not any(per_layer):
        return 0
    kept = used = 0
    for nbytes in per_layer:
        if used + nbytes > budget:
            break
        used, kept = used + nbytes, kept + 1
    return kept


def unpack_fits(weights: Mapping[str, Weight], dtype: torch.dtype, budget: int) -> bool:
    """Whether the quantized linear weights of ``weights`` all fit ``budget`` bytes unpacked to
    ``dtype`` (the embedding table does not count: it stays packed, its rows are unpacked as
    they are looked up). Reads only shapes, so meta stand-ins do."""
    packed = [t for k, t in weights.items() if isinstance(t, QuantizedTensor) and k != EMBED]
    size = torch.tensor([], dtype=dtype).element_size()
    return bool(packed) and sum(t.shape[0] * t.shape[1] for t in packed) * size <= budget


def consume(
    weights: MutableMapping[str, Weight],
    cfg: ModelConfig,
    kernels,
    dtype: torch.dtype,
    unpack: bool,
    unpack_bytes: int,
    place: Callable[[str, Weight], Weight],
    dense: int = 0,
    cpu_int4: bool = False,
    packed_f32: bool = False,
) -> tuple[dict[str, Weight], Weight]:
    """The pipeline: every weight popped from ``weights`` (unpacked to ``dtype`` when
    ``unpack``: the reference path's small models), fused layer by layer, prepared for
    ``kernels`` (the embedding table stays as loaded: rows are looked up), and handed to
    ``place``. Returns (name -> weight, head); a tied head is its own prepared copy of the
    embedding table, or the table itself where preparing changes nothing. ``dense``: the
    prepared weights of the first ``dense`` layers also keep a copy unpacked to ``dtype`` for
    prefill (the head does not: it multiplies only the rows whose logits are asked for).
    ``cpu_int4``: 4-bit weights left packed go to torch's int4 CPU kernel's layout (bf16 models
    on the CPU).
    ``packed_f32`` (with ``unpack``, fp32 on the CPU): the 4-bit weights our fp32 kernel takes
    keep their codes for decode beside the unpacked copy (:class:`~headstart.ops.quant_matmul.
    cpu_f32.CpuPacked`)."""

    def convert(k: str, t: Weight) -> Weight:
        if not unpack or k == EMBED or not isinstance(t, QuantizedTensor):
            return t
        return t if packed_f32 and cpu_f32.fits(t) else t.dequantize(dtype)

    w: dict[str, Weight] = {}

    def take(keys: list[str], copy: bool = False) -> None:
        for k in keys:  # each original is dropped once its placed form exists
            t = convert(k, weights.pop(k))
            if k == EMBED:
                w[k] = place(k, t)
            else:
                w[k] = place(k, prepare(t, copy))

    def prepare(t: Weight, copy: bool = False) -> Weight:
        if packed_f32 and isinstance(t, QuantizedTensor) and cpu_f32.fits(t):
            return cpu_f32.prepare(t)
        if cpu_int4 and isinstance(t, QuantizedTensor) and cpu_quant.fits(t):
            return cpu_quant.prepare(t)
        return kernels.prepare(t, dense=dtype if copy else None)

    for i in range(cfg.num_hidden_layers):
        fuse_layer(weights, i, convert)
        take([k for k in weights if k.startswith(f"layers.{i}.")], copy=i < dense)
    take(list(weights))
    if not cfg.tie_word_embeddings:
        return w, w[HEAD]
    head = prepare(w[EMBED])
    if (
        not kernels.fused_matmul
        and isinstance(head, QuantizedTensor)
        and unpack_fits({"head": head}, dtype, unpack_bytes)
    ):
        # A tied head shares the packed embedding table; unpack a copy under the same rule.
        head = head.dequantize(dtype)
    return w, place("head", head)
