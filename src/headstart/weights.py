"""Reading a checkpoint's safetensors into canonical text-model tensors.

One job: find the safetensors files (single or sharded with an index), map the names of the three
layouts we accept onto one canonical naming (HF's text-model names, e.g. ``layers.3.self_attn.q_proj``),
undo the MLX conversions (conv ``[C, K, 1]``, zero-centred norms stored as ``1 + w``), keep MLX
quantized modules packed, and check every tensor against the configuration. Problems raise
:class:`~headstart.errors.CheckpointError` naming the file or tensor.

Layouts:
  * HF wrapper   ``model.language_model.*`` + ``lm_head.weight`` (``model.visual.*``, ``mtp.*`` ignored)
  * HF text-only ``model.*`` + ``lm_head.weight``
  * MLX          ``language_model.model.*`` + ``language_model.lm_head.*``; ``.scales``/``.biases``
    beside a uint32 ``.weight`` mark a quantized module.

Norm weights are returned as the *multiplier* (``1 + w`` for zero-centred norms) in fp32; ``A_log``,
``dt_bias`` and the GDN output norm are fp32 too; other float tensors are cast to ``dtype``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from headstart.config import ModelConfig
from headstart.errors import CheckpointError
from headstart.quant import QuantizedTensor

Weight = torch.Tensor | QuantizedTensor

_PREFIXES = (  # (prefix in file, canonical prefix); first match wins
    ("model.language_model.", ""),
    ("language_model.model.", ""),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
    ("model.", ""),
)
_IGNORED = ("model.visual.", "visual.", "vision_tower.", "mtp.", "model.mtp.", "language_model.mtp.")

# Norms stored as w with output * (1 + w) in HF; MLX stores 1 + w.
_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                 "k_norm.weight")
_FP32 = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.norm.weight")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> logical shape of every tensor the text model needs."""
    H, V = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (V, H), "norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, H)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, H)
        shapes[p + "mlp.down_proj.weight"] = (H, cfg.intermediate_size)
        if kind == "full_attention":
            nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            shapes[p + "self_attn.q_proj.weight"] = (2 * nh * hd, H)
            shapes[p + "self_attn.k_proj.weight"] = (nkv * hd, H)
            shapes[p + "self_attn.v_proj.weight"] = (nkv * hd, H)
            shapes[p + "self_attn.o_proj.weight"] = (H, nh * hd)
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        else:
            hv = cfg.linear_num_value_heads
            shapes[p + "linear_attn.in_proj_qkv.weight"] = (cfg.conv_dim, H)
            shapes[p + "linear_attn.in_proj_z.weight"] = (cfg.value_dim, H)
            shapes[p + "linear_attn.in_proj_b.weight"] = (hv, H)
            shapes[p + "linear_attn.in_proj_a.weight"] = (hv, H)
            shapes[p + "linear_attn.conv1d.weight"] = (cfg.conv_dim, cfg.linear_conv_kernel_dim)
            shapes[p + "linear_attn.dt_bias"] = (hv,)
            shapes[p + "linear_attn.A_log"] = (hv,)
            shapes[p + "linear_attn.norm.weight"] = (cfg.linear_value_head_dim,)
            shapes[p + "linear_attn.out_proj.weight"] = (H, cfg.value_dim)
    return shapes


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: those named by the index if there is one, else every file."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = [model_dir / n for n in names]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index} names {f.name}, which does not exist")
        return files
    files = sorted(p for p in model_dir.iterdir() if ".safetensors" in p.name and p.is_file()
                   and not p.name.endswith(".json"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weight files found")
    return files


def _canonical(name: str) -> str | None:
    if name.startswith(_IGNORED):
        return None
    for prefix, canon in _PREFIXES:
        if name.startswith(prefix):
            return canon + name[len(prefix):]
    return None


def _read_raw(files: list[Path]) -> tuple[dict[str, torch.Tensor], bool]:
    """All text-model tensors by canonical name, and whether any file says it is MLX."""
    raw: dict[str, torch.Tensor] = {}
    mlx_meta = False
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                mlx_meta |= (f.metadata() or {}).get("format") == "mlx"
                for name in f.keys():
                    canon = _canonical(name)
                    if canon is not None:
                        raw[canon] = f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises several types for damaged files
            raise CheckpointError(
                f"{path}: cannot read safetensors file (truncated or corrupt?): {e}"
            ) from None
    return raw, mlx_meta


def load_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> dict[str, Weight]:
    """Read, convert and check every tensor of the text model (see the module docstring)."""
    model_dir = Path(model_dir)
    raw, mlx_meta = _read_raw(safetensors_files(model_dir))
    if cfg.tie_word_embeddings:
        # A tied checkpoint may still carry a copy of the head; HF ignores it, and so do we.
        for key in [k for k in raw if k.startswith("lm_head.")]:
            del raw[key]
    # MLX's own test for "norms already shifted": any conv weight stored [C, K, 1].
    conv = next((t for k, t in raw.items() if k.endswith("conv1d.weight")), None)
    mlx_layout = mlx_meta or (conv is not None and conv.ndim == 3 and conv.shape[-1] == 1
                              and cfg.linear_conv_kernel_dim != 1)

    out: dict[str, Weight] = {}
    for name, shape in expected_shapes(cfg).items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is not None and module + ".scales" in raw:
            out[name] = _quantized(raw, module, shape, cfg, device)
            continue
        if name not in raw:
            raise CheckpointError(f"{model_dir}: tensor '{name}' is missing from the checkpoint")
        t = raw[name]
        if name.endswith("conv1d.weight"):
            if t.ndim == 3:  # HF [C, 1, K]; MLX [C, K, 1]
                t = t[:, :, 0] if t.shape[-1] == 1 and t.shape[1] != 1 else t[:, 0, :]
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{model_dir}: tensor '{name}' has shape {tuple(t.shape)}, config implies {shape}"
            )
        if not t.is_floating_point():
            raise CheckpointError(f"{model_dir}: tensor '{name}' has non-float dtype {t.dtype}")
        if name.endswith(_ZERO_CENTRED) or name == "norm.weight":
            t = t.float() if mlx_layout else t.float() + 1.0
        elif name.endswith(_FP32):
            t = t.float()
        else:
            t = t.to(dtype)
        out[name] = t.to(device)
    return out


def _quantized(raw: dict[str, torch.Tensor], module: str, shape: tuple[int, ...],
               cfg: ModelConfig, device: torch.device | str) -> QuantizedTensor:
    if cfg.quantization is None:
        raise CheckpointError(f"'{module}' is quantized but config.json has no quantization block")
    spec = cfg.quantization.spec_for(module)
    if spec is None:
        raise CheckpointError(f"'{module}' is quantized but the config marks it unquantized")
    packed, scales = raw[module + ".weight"], raw[module + ".scales"]
    biases = raw.get(module + ".biases")
    if biases is None:
        raise CheckpointError(f"'{module}' has scales but no biases (only affine mode is supported)")
    out_f, in_f = shape
    want_packed = (out_f, in_f * spec.bits // 32)
    want_groups = (out_f, in_f // spec.group_size) if in_f % spec.group_size == 0 else None
    if want_groups is None:
        raise CheckpointError(f"'{module}': group size {spec.group_size} does not divide {in_f}")
    if packed.dtype not in (torch.uint32, torch.int32) or tuple(packed.shape) != want_packed:
        raise CheckpointError(
            f"'{module}.weight' is {packed.dtype} {tuple(packed.shape)}, expected uint32 "
            f"{want_packed} for {spec.bits}-bit weights of shape {shape}"
        )
    for part, t in (("scales", scales), ("biases", biases)):
        if tuple(t.shape) != want_groups or not t.is_floating_point():
            raise CheckpointError(
                f"'{module}.{part}' is {t.dtype} {tuple(t.shape)}, expected float {want_groups}"
            )
    return QuantizedTensor(packed.view(torch.int32).to(device), scales.to(device),
                           biases.to(device), spec.bits, spec.group_size)
