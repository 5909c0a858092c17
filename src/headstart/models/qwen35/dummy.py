"""Random weights at a checkpoint's shapes, made on the device as the model takes them
(``serve --load-format dummy``, vLLM's name for the same thing): speed measurements at a real
shape on machines that have no real weights. Only the shapes and formats are real; the values
are scaled so activations stay finite through every layer, and the model says nothing sensible.

Weights come as the checkpoint would give them: MLX affine 4-bit for a config that declares
that quantization (every matrix whose input width is a multiple of 64), bf16 otherwise; vectors
in fp32. A :class:`~headstart.models.qwen35.weights.LazyWeights` of recipes, so the model plans
its arena from meta stand-ins and holds the arena plus one layer in flight, never a second copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headstart.models.qwen35.config import ModelConfig
from headstart.models.qwen35.weights import LazyWeights, expected_shapes
from headstart.quant import QuantizedTensor

__all__ = ["random_weights"]


def random_tensor(
    name: str,
    shape: tuple[int, ...],
    bits: int | None,
    device: str,
    gen: torch.Generator | None,
    dtype: torch.dtype = torch.bfloat16,
):
    """One random weight (``bits``: MLX affine with groups of 64 where K allows; matrices in
    ``dtype``); on the meta device, no data."""
    if device == "meta":
        return _meta_tensor(shape, bits, dtype, name.endswith("conv1d.weight"))
    if len(shape) == 1:
        t = (
            torch.ones(shape, device=device)
            if "norm" in name
            else torch.rand(shape, device=device, generator=gen) - 0.5
        )
        return t.float()
    if name.endswith("conv1d.weight"):
        return (torch.randn(shape, device=device, generator=gen) * 0.3).to(dtype)
    if bits == 4 and shape[1] % 64 == 0:
        out, inp = shape
        packed = torch.randint(
            -(2**31), 2**31 - 1, (out, inp // 8), dtype=torch.int32, device=device, generator=gen
        )
        # Uniform codes 0..15 around 7.5, scaled to a unit-variance output per row.
        scales = torch.full(
            (out, inp // 64), 2.0 / 15 / inp**0.5, dtype=torch.bfloat16, device=device
        )
        return QuantizedTensor(packed, scales, -7.5 * scales, 4, 64)
    return (torch.randn(shape, device=device, generator=gen) / shape[1] ** 0.5).to(dtype)


def _meta_tensor(shape: tuple[int, ...], bits: int | None, dtype: torch.dtype, conv: bool):
    """:func:`random_tensor`'s result on the meta device, made with ``torch.empty`` alone: a
    random or arithmetic op there runs Python meta functions, and its first use imports
    torch's compiler stack (seconds of every start-up's arena planning)."""
    if len(shape) == 1:
        return torch.empty(shape, device="meta")
    if bits == 4 and shape[1] % 64 == 0 and not conv:
        out, inp = shape
        scales = torch.empty(out, inp // 64, dtype=torch.bfloat16, device="meta")
        packed = torch.empty(out, inp // 8, dtype=torch.int32, device="meta")
        return QuantizedTensor(packed, scales, torch.empty_like(scales), 4, 64)
    return torch.empty(shape, dtype=dtype, device="meta")


@dataclass(frozen=True)
class RandomRecipe:
    """A :class:`LazyWeights` recipe that makes a random weight when read."""

    name: str
    shape: tuple[int, ...]
    bits: int | None
    gen: torch.Generator
    dtype: torch.dtype = torch.bfloat16

    def meta(self):
        return random_tensor(self.name, self.shape, self.bits, "meta", None, self.dtype)

    def read(self, device: torch.device):
        return random_tensor(self.name, self.shape, self.bits, str(device), self.gen, self.dtype)


def random_weights(
    cfg: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    bits: int | None = None,
) -> LazyWeights:
    """Random weights at ``cfg``'s shapes, matrices in ``dtype`` (``bits``: 4 for MLX 4-bit;
    default: the config's declared quantization when it is 4-bit, else none)."""
    if bits is None and cfg.quantization is not None and cfg.quantization.default.bits == 4:
        bits = 4
    gen = torch.Generator(device=torch.device(device)).manual_seed(seed)
    return LazyWeights(
        {n: RandomRecipe(n, s, bits, gen, dtype) for n, s in expected_shapes(cfg).items()},
        device,
    )
