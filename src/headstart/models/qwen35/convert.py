"""Writing a Qwen3.5 text model in the MLX affine-quantized checkpoint layout.

The same layout mlx-lm's converter produces (``language_model.model.*`` names, uint32 weights +
``scales`` + ``biases`` for every Linear/Embedding whose input dimension the group size divides,
conv weights ``[C, K, 1]``, zero-centred norms stored as ``1 + w``, ``{"format": "mlx"}`` header
metadata, a ``quantization`` block in config.json). Used to ship the embedded default model small
and to make test fixtures. Non-goal: reading (that is :mod:`headstart.weights`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from headstart.quant import QuantizedTensor, quantize

_ZERO_CENTRED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


def quantize_state_dict(
    state: Mapping[str, torch.Tensor], bits: int = 4, group: int = 64, tied: bool = False
) -> dict[str, QuantizedTensor]:
    """Module path (HF text-only names) -> its quantized weight, by mlx-lm's rule: every 2-D
    projection or embedding whose input dimension ``group`` divides. A tied head is skipped
    (it is the embedding)."""
    out = {}
    for name, t in state.items():
        if not name.endswith(".weight") or t.ndim != 2 or t.shape[-1] % group:
            continue
        if name.endswith("conv1d.weight") or (tied and name == "lm_head.weight"):
            continue
        out[name[: -len(".weight")]] = quantize(t.detach().float(), bits, group)
    return out


def write_mlx(
    state: Mapping[str, torch.Tensor],
    config: dict[str, Any],
    out: Path,
    bits: int,
    group: int,
    packed: Mapping[str, QuantizedTensor] | None = None,
) -> Path:
    """Write ``state`` (an HF ``Qwen3_5ForCausalLM`` state dict) and its text ``config`` to
    ``out`` in the MLX layout. ``packed`` gives the quantized modules (default: quantize now)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tied = bool(config.get("tie_word_embeddings"))
    packed = quantize_state_dict(state, bits, group, tied) if packed is None else packed
    tensors = {}
    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        new = "language_model." + name if name.startswith(("model.", "lm_head.")) else name
        if module in packed:
            qt = packed[module]
            base = new.rsplit(".", 1)[0]
            tensors[base + ".weight"] = qt.packed.view(torch.uint32).contiguous()
            tensors[base + ".scales"] = qt.scales.contiguous()
            tensors[base + ".biases"] = qt.biases.contiguous()
            continue
        t = t.detach().clone()
        if name.endswith("conv1d.weight"):
            t = t.transpose(1, 2).contiguous()  # [C, 1, K] -> [C, K, 1]
        elif name.endswith(_ZERO_CENTRED) or name == "model.norm.weight":
            t = t + 1.0
        tensors[new] = t.contiguous()
    if tied:
        tensors.pop("language_model.lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "mlx"})
    cfg = dict(config)
    cfg["quantization"] = {"group_size": group, "bits": bits, "mode": "affine"}
    cfg["quantization_config"] = dict(cfg["quantization"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
