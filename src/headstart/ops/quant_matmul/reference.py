"""``y = x @ W^T`` from an MLX affine-quantized weight, in PyTorch (reference).

The spec of :func:`headstart.ops.quant_matmul.triton.quant_matmul`: the weight ``scales * q +
biases`` (:class:`headstart.quant.QuantizedTensor`, the file's packed layout, no repacking) is
dequantized in fp32, multiplied with x in fp32, and the product rounded once to x's dtype. The
fused kernel multiplies the exact codes too and accumulates in fp32; it differs in summation order,
rounds fp32 scales and biases to bf16, and its tiled layout rounds the dequantized weight to x's
dtype for the tensor cores (tolerances: ``tests/test_gpu_ops.py``). Runs anywhere; for every row
count (the kernel itself falls back to dequantize + matmul above 64 rows).
"""

from __future__ import annotations

import torch

from headstart.quant import QuantizedTensor


def quant_matmul(x: torch.Tensor, w: QuantizedTensor) -> torch.Tensor:
    """``x [..., K] @ W^T -> [..., N]`` in x's dtype, fp32 arithmetic."""
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {w.shape[1]}")
    return (x.float() @ w.dequantize(torch.float32).T).to(x.dtype)
