"""What Qwen3.5's layers read of their model (a protocol, so that the layers and the
speculative surgery do not import the model that composes them)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from headstart.models.qwen35.config import ModelConfig
from headstart.ops.pointwise.reference import Rotary

__all__ = ["ModelParts"]


class ModelParts(Protocol):
    cfg: ModelConfig
    w: dict[str, Any]  # name -> weight, in the form the kernels read
    kernels: Any  # headstart.kernels.Kernels
    rotary: Rotary
    state_index: dict[int, int]  # layer index -> its row in the pool's tensors of its kind


class StepParts(ModelParts, Protocol):
    """What the traceable decode step reads besides the layers' parts (``decode_step.py``)."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor: ...

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor: ...

    def lm_head(self, h: torch.Tensor) -> torch.Tensor: ...
