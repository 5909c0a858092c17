"""MLX affine quantization: the packed layout, dequantization, and a quantizer for fixtures.

Layout (mlx ``affine``): a weight ``[out, in]`` is stored as ``uint32 [out, in * bits / 32]`` with
element ``i`` of a row in word ``i // (32 / bits)`` at bit offset ``bits * (i % (32 / bits))``
(least significant first), plus ``scales`` and ``biases`` ``[out, in / group]``; the weight is
``scales * q + biases`` per group. Weights stay packed in memory (GPU kernels consume them as they
are); the CPU reference dequantizes per call (see :meth:`QuantizedTensor.dequantize`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedTensor:
    """A 2-D weight kept in MLX affine form. ``packed`` is int32 (bit-identical to the file's
    U32)."""

    packed: torch.Tensor  # [out, in * bits // 32] int32
    scales: torch.Tensor  # [out, in // group_size]
    biases: torch.Tensor  # [out, in // group_size]
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 32 // self.bits)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def to(self, device: torch.device | str) -> QuantizedTensor:
        return QuantizedTensor(
            self.packed.to(device),
            self.scales.to(device),
            self.biases.to(device),
            self.bits,
            self.group_size,
        )

    def dequantize(
        self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The full-precision weight (or only ``rows`` of it, for embedding lookups)."""
        packed, scales, biases = self.packed, self.scales, self.biases
        if rows is not None:
            packed, scales, biases = packed[rows], scales[rows], biases[rows]
        return dequantize(packed, scales, biases, self.bits, self.group_size, dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.biases))


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words ``[..., W]`` -> unsigned codes ``[..., W * 32 / bits]`` (int32)."""
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    # The mask also clears the sign fill of the arithmetic right shift on int32.
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    codes = unpack(packed, bits).to(dtype)
    lead = codes.shape[:-1]
    codes = codes.reshape(*lead, -1, group_size)
    w = codes * scales.to(dtype).unsqueeze(-1) + biases.to(dtype).unsqueeze(-1)
    return w.reshape(*lead, -1)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack`: codes ``[..., N]`` in ``[0, 2**bits)`` -> int32
    ``[..., N*bits/32]``."""
    per_word = 32 // bits
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, per_word)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    words = (c << shifts).sum(-1)
    # Wrap into int32 range so the bits match a uint32 word.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def quantize(
    w: torch.Tensor, bits: int = 4, group_size: int = 64, scale_dtype: torch.dtype = torch.bfloat16
) -> QuantizedTensor:
    """Quantize ``w [out, in]`` to the MLX affine layout (min/max per group, as mlx does).

    Used to make test fixtures and the embedded default model; the loader never calls it.
    """
    out, n = w.shape
    g = w.float().reshape(out, n // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).clamp_min(1e-7)
    # Round scales/biases to their storage dtype first so codes are chosen against what is stored.
    scale = scale.to(scale_dtype)
    bias = lo.to(scale_dtype)
    codes = ((g - bias.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).round()
    codes = codes.clamp(0, levels)
    packed = pack(codes.reshape(out, n).to(torch.int32), bits)
    return QuantizedTensor(packed, scale, bias, bits, group_size)
