"""Tiny random Qwen3.5 checkpoints built with HF transformers (the reference), saved locally."""

from __future__ import annotations

from pathlib import Path

import torch

from headstart.quant import quantize


def text_config(**overrides):
    from transformers import Qwen3_5TextConfig

    base = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        tie_word_embeddings=False,
        eos_token_id=1,
        rms_norm_eps=1e-6,
    )
    base.update(overrides)
    return Qwen3_5TextConfig(**base)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """HF initialises norms to zero/one and decays to a narrow band; spread everything out."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            std = 0.5 if p.ndim == 1 else 0.15
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def causal_lm(seed: int = 0, **overrides):
    """A random Qwen3_5ForCausalLM (float32, eval mode)."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(text_config(**overrides)).float().eval()
    randomize(model, seed)
    return model


def save_text_only(model, out: Path) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    return out


def save_wrapper(model, out: Path) -> Path:
    """Save a text model in the official vision-language wrapper placement (tiny vision tower)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tc = model.config.to_dict()
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=tc["hidden_size"],
        patch_size=2,
        temporal_patch_size=2,
        spatial_merge_size=2,
        num_position_embeddings=16,
    )
    cfg = Qwen3_5Config(
        text_config=tc, vision_config=vision, tie_word_embeddings=tc["tie_word_embeddings"]
    )
    wrapper = Qwen3_5ForConditionalGeneration(cfg).float().eval()
    state = {}
    for k, v in model.state_dict().items():
        state[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = v
    missing, unexpected = wrapper.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k.startswith("model.visual.") for k in missing), missing
    wrapper.save_pretrained(out, safe_serialization=True)
    return out


def dequantized_copy(model, bits: int, group: int):
    """Quantize every Linear/Embedding weight (MLX rule) and put the dequantized values back.

    Returns (reference model with dequantized weights, {hf name: QuantizedTensor})."""
    import copy

    ref = copy.deepcopy(model)
    packed = {}
    seen = set()  # a tied head shares the embedding's tensor: quantize it once
    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                w = module.weight
                if w.shape[-1] % group or id(w) in seen:
                    continue
                seen.add(id(w))
                qt = quantize(w.detach(), bits, group)
                packed[name] = qt
                w.copy_(qt.dequantize(torch.float32))
    return ref, packed


def save_mlx(model, packed: dict, out: Path, bits: int, group: int) -> Path:
    """Write the MLX affine layout (see headstart.models.qwen35.convert) with the given quantized
    modules."""
    from headstart.models.qwen35.convert import write_mlx

    return write_mlx(model.state_dict(), model.config.to_dict(), out, bits, group, packed)


def save_mlx_nemotron_h(
    model, packed: dict, out: Path, bits: int = 4, group: int = 64, head: bool = True
) -> Path:
    """Write a transformers ``NemotronHForCausalLM`` in mlx-lm's layout (its
    ``models/nemotron_h.py``): the names of NVIDIA's files (``backbone.*``, ``lm_head.weight``),
    conv weights ``[C, K, 1]``, norms as they are, and each module of ``packed`` (HF module name
    -> QuantizedTensor, e.g. from :func:`dequantized_copy`; empty: an unquantized MLX export)
    as uint32 ``.weight`` + ``.scales`` + ``.biases``; ``{"format": "mlx"}`` file metadata;
    config.json with the ``quantization`` block (and mlx-lm's ``quantization_config`` mirror)
    when anything is packed. ``head``: False leaves ``lm_head`` out (a tied checkpoint)."""
    import json

    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        module, leaf = name.rsplit(".", 1)
        stored = "backbone." + name.removeprefix("model.") if name.startswith("model.") else name
        if not head and name.startswith("lm_head."):
            continue
        if module in packed and leaf == "weight":
            qt, base = packed[module], stored.rsplit(".", 1)[0]
            tensors[base + ".weight"] = qt.packed.view(torch.uint32).contiguous()
            tensors[base + ".scales"] = qt.scales.contiguous()
            tensors[base + ".biases"] = qt.biases.contiguous()
            continue
        t = t.detach().clone()
        if name.endswith("conv1d.weight"):
            t = t.transpose(1, 2)  # transformers' [C, 1, K] -> MLX's [C, K, 1]
        tensors[stored] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "mlx"})
    model.config.save_pretrained(out)
    if packed:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization"] = {"group_size": group, "bits": bits, "mode": "affine"}
        cfg["quantization_config"] = dict(cfg["quantization"])
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def save_drafter(
    out: Path,
    target_config,
    *,
    layers: int = 2,
    block: int = 6,
    taps=None,
    mask_token_id: int = 3,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 96,
    causal: bool | None = None,
) -> Path:
    """A random DFlash drafter for ``target_config`` in the DFlash checkpoint format."""
    import json

    from safetensors.torch import save_file

    H = target_config.hidden_size
    L = target_config.num_hidden_layers
    taps = list(taps if taps is not None else range(min(L - 1, 2)))
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": H,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "max_position_embeddings": 4096,
        "vocab_size": target_config.vocab_size,
        "tie_word_embeddings": False,
        "num_target_layers": L,
        "layer_types": ["full_attention"] * layers,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": taps,
            "block_size": block,
        },
    }
    if causal is not None:
        cfg["is_causal"] = causal
    from headstart.engine.spec.drafter import DrafterConfig, drafter_shapes

    dc = DrafterConfig(
        H,
        intermediate,
        layers,
        heads,
        kv_heads,
        head_dim,
        1e-6,
        1e6,
        block,
        mask_token_id,
        tuple(taps),
        (False,) * layers,
        (0,) * layers,
    )
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in drafter_shapes(dc).items():
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / shape[1] ** 0.5
        tensors[name] = t.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def target_with_drafter(tmp: Path, seed: int, block: int):
    """A tiny target (4 value heads of 24) loaded in headstart, with a random drafter checkpoint
    for it at ``model.drafter_dir`` (taps 0 and 2)."""
    from headstart.models.qwen35.model import Qwen35Model

    ref = causal_lm(seed=seed, linear_num_value_heads=4, linear_value_head_dim=24)
    model = Qwen35Model.load(save_text_only(ref, tmp / "target"))
    model.drafter_dir = save_drafter(tmp / "drafter", ref.config, taps=[0, 2], block=block)
    return model


def small_tokenizer(vocab: int = 160):
    """The default model's tokenizer, cut to the tiny models' ids (detokenization only)."""
    from headstart.loading import default_model_dir
    from headstart.tokenizer import Tokenizer

    t = Tokenizer.from_dir(default_model_dir())

    class Small(type(t)):
        @property
        def vocab_size(self):
            return vocab

    t.__class__ = Small
    return t
