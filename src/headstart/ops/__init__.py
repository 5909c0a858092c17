"""Tensor operations of the model, one subpackage per op family; each op is a function over packed
rows and state pools.

Every family keeps its pure-PyTorch reference (``reference.py``: runs anywhere, the executable
spec) beside its GPU kernels (``triton.py``), as flash-linear-attention keeps ``naive.py`` next to
each kernel; the kernels implement the references' signatures and are tested against them. Callers
import ``.reference`` / ``.triton`` explicitly (the family packages re-export nothing), and which
set the model runs is chosen in one place, :func:`headstart.kernels.select_kernels`.

* ``attention``: causal attention of new rows over a stream's KV rows; flash-decoding straight
  from the KV pool (``triton``).
* ``gated_delta``: the gated delta rule, recurrent, chunked and one step; the in-place decode
  step (``triton``) and flash-linear-attention's chunked kernel over packed spans (``fla``).
* ``conv``: GDN's causal depthwise conv continuing from a per-stream tail (reference only; its
  decode step has a kernel in ``pointwise.triton``).
* ``pointwise``: the per-row pieces around the matmuls (norms, gates, conv step, RoPE, the decode
  rows' attention inputs); one Triton kernel per piece.
* ``quant_matmul``: ``x @ W^T`` from MLX affine-quantized weights (dequantize + matmul as the
  reference; the fused 4-bit kernel and its weight layouts).
* ``triton_support``: the optional Triton import, SM count, programmatic dependent launch.
"""
