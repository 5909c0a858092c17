"""``y = x @ W^T`` from a 4-bit MLX affine weight and fp32 activations on the CPU, for the few
rows of a decode step; a dense fp32 copy serves prefill-sized matmuls.

Why our own kernel: a decode step of a small fp32 model (the embedded default) reads every
weight once per step, and unpacked to fp32 that is 8x the bytes of the 4-bit codes: on one core
the step's matmuls were memory-bound at a few GB/s. torch's int4 CPU kernel takes only bf16
activations fast (fp32 ones are an order of magnitude slower, see ``cpu.py``), and bf16 would
change what an fp32 model computes. ``int4_f32.c`` multiplies the exact codes by fp32
activations and applies each group's scale and bias once (``y = s * (x . q) + b * sum(x)`` per
group): the result is the reference's (:func:`headstart.ops.quant_matmul.reference.
quant_matmul`, fp32) up to summation order. It is compiled at first use with the machine's C
compiler (:mod:`headstart.ops.c_build`); without a compiler :func:`available` is False and the
weights stay unpacked as before.

The matmul is a torch operator (``headstart::int4_matmul_f32``), so traced programs
(:mod:`headstart.engine.cpu_programs`) call it as one opaque node.

Non-goals: other bit widths, bf16 or fp16 activations (``cpu.py``), autograd.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from headstart.ops import c_build
from headstart.quant import QuantizedTensor

__all__ = ["CpuPacked", "available", "fits", "matmul", "prepare", "takes"]

log = logging.getLogger("headstart.kernels")

SOURCE = Path(__file__).with_name("int4_f32.c")
# Above this many rows the dense copy's matmul (MKL) is as fast: the kernel converts every code
# per row block, so its advantage (reading 1/8 of the bytes) fades as rows grow.
MAX_ROWS = 8


_P, _I = c_build.POINTER, c_build.INT
_ARGS = (_P, _I, _I, _P, _P, _P, _I, _I, _P, _I, _I)


def _kernel():
    return c_build.function(SOURCE, "int4_matmul_f32", _ARGS)


def available() -> bool:
    """Whether the kernel runs on this machine (it is built on the first call)."""
    return _kernel() is not None


def takes(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of ``dtype`` on ``device`` whose 4-bit weights are unpacked at load
    keeps their codes for this kernel too (each weight that :func:`fits`)."""
    return device.type == "cpu" and dtype == torch.float32 and available()


@dataclass(frozen=True)
class CpuPacked:
    """A 4-bit weight for fp32 activations on the CPU: the file's codes ``packed`` [N, K/8]
    int32, fp32 ``scales`` and ``biases`` [N, K/group], and ``dense``, the weight unpacked to
    fp32 [N, K] for prefill-sized matmuls."""

    packed: torch.Tensor
    scales: torch.Tensor
    biases: torch.Tensor
    dense: torch.Tensor
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.dense.shape)  # type: ignore[return-value]


def fits(w: QuantizedTensor) -> bool:
    """Whether the kernel takes ``w`` (4-bit, whole groups of whole words, at most 256)."""
    k = w.shape[1]
    return w.bits == 4 and w.group_size % 8 == 0 and w.group_size <= 256 and k % w.group_size == 0


def prepare(w: QuantizedTensor) -> CpuPacked:
    """``w`` (:func:`fits`) with fp32 scales and its dense copy; meta in, meta out. The
    operator's C++ kernel is built and loaded first, where it builds (once a process)."""
    from headstart.ops import native

    native.load()
    return CpuPacked(
        w.packed.contiguous(),
        w.scales.to(torch.float32).contiguous(),
        w.biases.to(torch.float32).contiguous(),
        w.dequantize(torch.float32),
        w.group_size,
    )


def _int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group: int
) -> torch.Tensor:
    kernel = _kernel()
    assert kernel is not None, "the 4-bit CPU kernel is not built"
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    rc = kernel(
        x.data_ptr(), m, k, packed.data_ptr(), scales.data_ptr(), biases.data_ptr(), n, group,
        y.data_ptr(), 0, n,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("the 4-bit CPU kernel could not allocate its scratch")
    return y


# An operator of the low-level library API, not ``torch.library.custom_op``: a traced decode
# step calls it ~30 times, and custom_op's Python wrappers (autograd, aliasing checks) cost
# ~15 us a call on this project's CPU, a third of the kernel's own time at the default model's
# sizes. Nothing differentiates through it.
_LIB = torch.library.Library("headstart", "FRAGMENT")
_LIB.define(
    "int4_matmul_f32(Tensor x, Tensor packed, Tensor scales, Tensor biases, int group) -> Tensor"
)
_LIB.impl("int4_matmul_f32", _int4_matmul, "CompositeExplicitAutograd")


@torch.library.register_fake("headstart::int4_matmul_f32")
def _(x, packed, scales, biases, group):
    return x.new_empty(x.shape[0], packed.shape[0])


def matmul(x: torch.Tensor, w: CpuPacked) -> torch.Tensor:
    """``x [..., K] @ W^T -> [..., N]``, x fp32: the kernel for up to :data:`MAX_ROWS` rows,
    the dense copy's matmul above."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {k}")
    rows = x.reshape(-1, k)
    if rows.shape[0] > MAX_ROWS or x.dtype != torch.float32:
        return F.linear(x, w.dense.to(x.dtype))
    y = torch.ops.headstart.int4_matmul_f32(rows, w.packed, w.scales, w.biases, w.group_size)
    return y.reshape(*x.shape[:-1], n)
