"""Nemotron-H: NVIDIA's hybrid of Mamba2 mixers, attention (no positional encoding) and
squared-ReLU MLP layers, one mixer per layer (``hybrid_override_pattern``)."""

from __future__ import annotations

from pathlib import Path

import torch

from headstart.models.contract import ChatFormat, ModelFamily

__all__ = ["FAMILY"]


def _load(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    kernels: str,
    dummy: bool = False,
):
    from headstart.models.nemotron_h.model import NemotronHModel

    return NemotronHModel.load(model_dir, dtype, device, kernels, dummy=dummy)


FAMILY = ModelFamily(
    name="nemotron_h",
    architectures=("NemotronHForCausalLM",),
    model_types=("nemotron_h",),
    load=_load,
    # No reasoning split and no tool-call parsing yet: all text is content.
    chat=ChatFormat(),
)
