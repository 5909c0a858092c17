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

from collections.abc import Callable
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

    def made(make: Callable[[], torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype):
        # On the meta device only ``torch.empty``: a random or arithmetic op there runs Python
        # meta functions, and its first use imports torch's compiler stack (seconds of every
        # start-up's arena planning).
        return torch.empty(shape, dtype=dtype, device="meta") if device == "meta" else make()

    if len(shape) == 1:
        return made(
            lambda: (
                torch.ones(shape, device=device)
                if "norm" in name
                else torch.rand(shape, device=device, generator=gen) - 0.5
            ).float(),
            shape,
            torch.float32,
        )
    if name.endswith("conv1d.weight"):
        return made(
            lambda: (torch.randn(shape, device=device, generator=gen) * 0.3).to(dtype),
            shape,
            dtype,
        )
    if bits == 4 and shape[1] % 64 == 0:
        out, inp = shape
        words = (out, inp // 8)
        packed = made(
            lambda: torch.randint(
                -(2**31), 2**31 - 1, words, dtype=torch.int32, device=device, generator=gen
            ),
            words,
            torch.int32,
        )
        # Uniform codes 0..15 around 7.5, scaled to a unit-variance output per row.
        groups = (out, inp // 64)
        scales = made(
            lambda: torch.full(groups, 2.0 / 15 / inp**0.5, dtype=torch.bfloat16, device=device),
            groups,
            torch.bfloat16,
        )
        biases = made(lambda: -7.5 * scales, groups, torch.bfloat16)
        return QuantizedTensor(packed, scales, biases, 4, 64)
    return made(
        lambda: (torch.randn(shape, device=device, generator=gen) / shape[1] ** 0.5).to(dtype),
        shape,
        dtype,
    )


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
