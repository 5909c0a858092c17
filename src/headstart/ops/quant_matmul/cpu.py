"""``y = x @ W^T`` from a 4-bit MLX affine weight on the CPU, through torch's weight-only int4
CPU kernel (``aten._weight_int4pack_mm_for_cpu``), for bf16 activations.

Why: a CPU decode step of a model too big to unpack at load reads every weight once; kept as
4-bit codes it reads a quarter of bf16's bytes and an eighth of fp32's, and torch's kernel
unpacks them in registers instead of materialising the weight per call as the reference does
(BENCHMARKS.md has the figures). The spec is :func:`headstart.ops.quant_matmul.reference.
quant_matmul`: MLX's ``w = scales * q + biases`` becomes the kernel's ``(q - 8) * scale + zero``
with ``zero = biases + 8 * scales``, both rounded to bf16; x is bf16 and the kernel accumulates
in fp32. With fp32 activations the same kernel is an order of magnitude slower than unpacking,
so it is only used for bf16.

Non-goals: other bit widths (they stay :class:`~headstart.quant.QuantizedTensor`), fp32 or
fp16 activations, autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headstart.quant import QuantizedTensor, unpack

GROUPS = (32, 64, 128, 256)  # the kernel's group sizes

# On the CPU, quantized linear weights that unpack to at most this many bytes in all are
# unpacked once at load: unpacking per call costs the reference path most of a small model's
# step (the embedded default decodes several times faster unpacked). A larger model keeps its
# memory saving: packed, through this kernel in bf16, else unpacked per call.
UNPACK_BYTES = 1 << 30


def takes(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of ``dtype`` on ``device`` runs its packed 4-bit weights through this
    kernel (each weight that :func:`fits`)."""
    return device.type == "cpu" and dtype == torch.bfloat16


@dataclass(frozen=True)
class CpuInt4:
    """A 4-bit weight in the CPU kernel's layout: ``packed`` [N, K/2] uint8, ``scale_zero``
    [K/group, N, 2] bf16 (scale, zero)."""

    packed: torch.Tensor
    scale_zero: torch.Tensor
    group_size: int
    n: int
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)


def fits(w: QuantizedTensor) -> bool:
    """Whether the kernel takes ``w``: 4-bit, a group size it knows, N a multiple of 16."""
    n, k = w.shape
    return w.bits == 4 and w.group_size in GROUPS and n % 16 == 0 and k % w.group_size == 0


def prepare(w: QuantizedTensor) -> CpuInt4:
    """``w`` (4-bit, :func:`fits`) in the kernel's layout; meta in, meta out (for planning)."""
    n, k = w.shape
    scales, biases = w.scales.to(torch.float32), w.biases.to(torch.float32)
    if w.packed.is_meta:
        packed = torch.empty((n, k // 2), dtype=torch.uint8, device="meta")
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack(w.packed, 4), 1)
    scale_zero = torch.stack([scales, biases + 8 * scales], -1).transpose(0, 1)
    return CpuInt4(packed, scale_zero.contiguous().to(torch.bfloat16), w.group_size, n, k)


def int4_matmul(x: torch.Tensor, w: CpuInt4) -> torch.Tensor:
    """``x [..., K] @ W^T -> [..., N]``, x bf16 on the CPU."""
    if x.shape[-1] != w.k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {w.k}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the int4 CPU kernel takes bf16 activations, not {x.dtype}")
    rows = x.reshape(-1, w.k)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        rows.contiguous(), w.packed, w.group_size, w.scale_zero
    )
    return y.reshape(*x.shape[:-1], w.n)
