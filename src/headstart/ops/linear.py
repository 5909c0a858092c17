"""``x @ w.T`` for a weight in any of its loaded forms: a tensor, MLX affine 4-bit kept packed
(:class:`~headstart.quant.QuantizedTensor`, dequantized per call: memory holds only the packed
form), prepared for the GPU's fused 4-bit kernel (read packed, in the kernel), or for torch's
int4 CPU kernel (:class:`~headstart.ops.quant_matmul.cpu.CpuInt4`, bf16 activations), or
for our fp32 one (:class:`~headstart.ops.quant_matmul.cpu_f32.CpuPacked`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headstart.ops.quant_matmul import cpu_f32
from headstart.ops.quant_matmul.cpu import CpuInt4, int4_matmul
from headstart.ops.quant_matmul.cpu_f32 import CpuPacked
from headstart.ops.quant_matmul.triton import PreparedQuant, quant_matmul
from headstart.quant import QuantizedTensor

__all__ = ["linear"]


def linear(
    x: torch.Tensor, w: torch.Tensor | QuantizedTensor | PreparedQuant | CpuInt4
) -> torch.Tensor:
    if isinstance(w, PreparedQuant):
        return quant_matmul(x, w)
    if isinstance(w, CpuInt4):
        return int4_matmul(x, w)
    if isinstance(w, CpuPacked):
        return cpu_f32.matmul(x, w)
    if isinstance(w, QuantizedTensor):
        return x @ w.dequantize(x.dtype).T
    return F.linear(x, w)
