"""Reading and validating the configuration of a Nemotron-H checkpoint.

One job: turn a checkpoint folder's ``config.json`` (and ``generation_config.json`` if present) into
a frozen :class:`ModelConfig`, with every size checked. Any missing or invalid field raises
:class:`~headstart.errors.ConfigError` naming the field and the file; nothing else escapes.

Both spellings real checkpoints use are read:

* NVIDIA's original (remote-code) files: ``hybrid_override_pattern`` (one character per layer:
  ``M`` Mamba2, ``*`` attention, ``-`` MLP, ``E`` MoE), ``num_hidden_layers``, and the
  ``mamba_``-prefixed aliases (``mamba_n_groups``, ``mamba_d_conv``, ...);
* transformers 5's (``save_pretrained``): an explicit ``layers_block_type`` list, no
  ``num_hidden_layers``, ``time_step_limit`` upper bound written as ``{"__float__": "Infinity"}``.

Where fields overlap, we compute what transformers' ``NemotronHForCausalLM`` computes:

* the Mamba inner size is ``mamba_num_heads * mamba_head_dim``; ``expand`` is kept but never used
  (real checkpoints disagree with it: Nemotron-Nano-9B-v2 has 128 x 80 = 10240 != 2 x 4480);
* norms (block, final and the gated Mamba norm) use ``layer_norm_epsilon``; ``rms_norm_eps`` is
  accepted in its place, and refused when both are given and disagree;
* attention has no positional encoding at all (no RoPE: rope keys are ignored), no biases
  whatever ``attention_bias`` says, and ``head_dim`` (else ``attention_head_dim``, else
  ``hidden_size // num_attention_heads``) need not multiply out to ``hidden_size``.

Quantization: MLX's affine block (``quantization``, which mlx-lm mirrors as
``quantization_config``; 2, 4 or 8 bits, per-module overrides) is read as Qwen3.5 reads it; any
other scheme (a ``quant_method``: fp8, GPTQ, AWQ, ...) is refused.

Non-goals (a ConfigError says so): MoE layers, sliding-window attention, attention biases,
activations other than relu2 (MLP) and silu (Mamba), quantization other than MLX affine. MTP
layers are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headstart.errors import ConfigError

# Generic field readers, shared with Qwen3.5's loader (they know nothing of that family).
from headstart.models.qwen35.config import (
    Quantization,
    _eos_ids,
    _generation_config,
    _quantization,
    _read_json,
    _Reader,
)

__all__ = ["ATTENTION", "MAMBA", "MLP", "MOE", "ModelConfig", "load_config"]

# Layer kinds, spelled as transformers' ``layers_block_type`` spells them.
MAMBA = "linear_attention"  # a Mamba2 mixer
ATTENTION = "full_attention"
MLP = "mlp"
MOE = "moe"

_PATTERN_CHARS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
# Names older files (and transformers' remapping) use in layers_block_type.
_LEGACY_KINDS = {"mamba": MAMBA, "attention": ATTENTION}

# (field, alias): transformers' NemotronHConfig accepts the alias in place of the field (and lets
# the alias win when both are given; we refuse a disagreement instead of picking one).
_ALIASES = {
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "expand": "mamba_expand",
    "time_step_min": "mamba_dt_min",
    "time_step_max": "mamba_dt_max",
    "time_step_limit": "mamba_dt_limit",
    "time_step_floor": "mamba_dt_init_floor",
    "use_conv_bias": "mamba_conv_bias",
    "chunk_size": "mamba_chunk_size",
    # Not transformers aliases, but spellings real files use for the same value.
    "layer_norm_epsilon": "rms_norm_eps",
    "head_dim": "attention_head_dim",
}

_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ModelConfig:
    """The text model of a Nemotron-H checkpoint, validated. Field names follow HF's config.

    Sizes of a layer kind the pattern does not use (e.g. ``intermediate_size`` of a model with
    no MLP layer) hold transformers' defaults and mean nothing.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # one of MAMBA, ATTENTION, MLP per layer
    # MLP layers: down_proj(relu(up_proj(x)) ** 2).
    intermediate_size: int
    mlp_bias: bool
    # Attention layers (GQA, no positional encoding).
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # Mamba2 layers.
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    use_bias: bool  # in_proj and out_proj biases
    expand: int  # as written; transformers ignores it (see mamba_intermediate_size)
    # The dt clamp as written (upper bound may be inf). transformers ignores it and clamps
    # dt >= time_step_min in its prefill path only; NVIDIA's mamba_ssm path uses this pair.
    time_step_limit: tuple[float, float]
    time_step_min: float
    time_step_max: float  # min/max/floor: dt_bias initialisation only
    time_step_floor: float
    mamba_ssm_cache_dtype: str  # the dtype transformers keeps the SSM state in
    # Whole model.
    layer_norm_epsilon: float
    residual_in_fp32: bool  # as written; transformers' blocks ignore it
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: str = "bfloat16"
    # MLX affine quantization of the checkpoint's projections and embedding table, if any.
    quantization: Quantization | None = None
    # Sampling defaults from generation_config.json (temperature, top_p, top_k, ...), if any.
    generation_defaults: tuple[tuple[str, float], ...] = field(default=())

    # Derived sizes, as transformers' NemotronHMamba2Mixer computes them.
    @property
    def mamba_intermediate_size(self) -> int:
        """The Mamba inner width: heads x head_dim (``expand * hidden_size`` is not used)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_bc_dim(self) -> int:
        """Width of B (and of C): one state vector per group."""
        return self.n_groups * self.ssm_state_size

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C."""
        return self.mamba_intermediate_size + 2 * self.mamba_bc_dim

    @property
    def mamba_in_proj_dim(self) -> int:
        """in_proj's output, split in this order: gate z, x/B/C (conv input), dt per head."""
        return self.mamba_intermediate_size + self.mamba_conv_dim + self.mamba_num_heads

    @property
    def mamba_norm_group_size(self) -> int:
        """The gated RMSNorm normalises each of n_groups slices of the inner width apart."""
        return self.mamba_intermediate_size // self.n_groups

    @property
    def mamba_heads_per_group(self) -> int:
        return self.mamba_num_heads // self.n_groups

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == MAMBA)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)

    @property
    def mlp_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == MLP)

    @property
    def hybrid_override_pattern(self) -> str:
        """The layer kinds in NVIDIA's one-character-per-layer spelling."""
        back = {kind: char for char, kind in _PATTERN_CHARS.items()}
        return "".join(back[t] for t in self.layer_types)


def _decode_floats(value: Any) -> Any:
    """transformers 5 writes non-finite floats as ``{"__float__": "Infinity"}``; undo that
    everywhere (bare ``Infinity``/``NaN``, as older files write them, JSON already decodes)."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(value["__float__"].replace("Infinity", "inf"))
        return {k: _decode_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_floats(v) for v in value]
    return value


def _key(r: _Reader, name: str) -> str:
    """The key that holds ``name``'s value: the field or its alias. Both given and different is
    ambiguous (transformers would silently take the alias), so it is an error."""
    alias = _ALIASES.get(name)
    if alias is None or not r.has(alias):
        return name
    if r.has(name) and r.data[name] != r.data[alias]:
        raise r.error(alias, f"{r.data[alias]!r} disagrees with {name} {r.data[name]!r}")
    return alias


def _optional_id(r: _Reader, key: str) -> int | None:
    if not r.has(key):
        return None
    return r.int(key, minimum=0)


def _choice(r: _Reader, key: str, default: str, allowed: tuple[str, ...], why: str) -> str:
    value = r.data.get(key)
    if value is None:
        return default
    if value not in allowed:
        raise r.error(key, f"{value!r} is not supported ({why}; supported: {', '.join(allowed)})")
    return value


def _layer_types(r: _Reader) -> tuple[str, ...]:
    """The per-layer kinds from ``layers_block_type`` and/or ``hybrid_override_pattern``."""
    from_list = from_pattern = None
    if r.has("layers_block_type"):
        value = r.data["layers_block_type"]
        if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
            raise r.error("layers_block_type", "must be a list of strings")
        kinds = [_LEGACY_KINDS.get(t, t) for t in value]
        for i, t in enumerate(kinds):
            if t not in (MAMBA, ATTENTION, MLP, MOE):
                raise r.error("layers_block_type", f"layer {i}: unknown layer type {value[i]!r}")
        from_list = tuple(kinds)
    if r.has("hybrid_override_pattern"):
        pattern = r.data["hybrid_override_pattern"]
        if not isinstance(pattern, str):
            raise r.error("hybrid_override_pattern", f"must be a string, got {pattern!r}")
        for i, char in enumerate(pattern):
            if char not in _PATTERN_CHARS:
                raise r.error(
                    "hybrid_override_pattern",
                    f"layer {i}: unknown layer character {char!r} (known: M * - E)",
                )
        from_pattern = tuple(_PATTERN_CHARS[c] for c in pattern)
    if from_list is None and from_pattern is None:
        raise r.error("layers_block_type", "missing (and so is hybrid_override_pattern)")
    if from_list is not None and from_pattern is not None and from_list != from_pattern:
        # transformers takes the list and drops the pattern; a file holding both, different,
        # says two things about the model.
        raise r.error("hybrid_override_pattern", "disagrees with layers_block_type")
    key = "layers_block_type" if from_list is not None else "hybrid_override_pattern"
    kinds = from_list if from_list is not None else from_pattern
    assert kinds is not None
    if not kinds:
        raise r.error(key, "names no layer")
    if MOE in kinds:
        raise r.error(
            key,
            f"layer {kinds.index(MOE)} is a mixture-of-experts layer, which is not supported yet",
        )
    if r.has("num_hidden_layers"):
        declared = r.int("num_hidden_layers")
        if declared != len(kinds):
            raise r.error("num_hidden_layers", f"is {declared} but {key} has {len(kinds)} layers")
    return kinds


def _time_step_limit(r: _Reader) -> tuple[float, float]:
    key = _key(r, "time_step_limit")
    if not r.has(key):
        return (0.0, math.inf)
    value = r.data[key]
    if (
        not isinstance(value, list)
        or len(value) != 2
        or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value)
    ):
        raise r.error(key, f"must be a pair of numbers [low, high], got {value!r}")
    try:
        low, high = float(value[0]), float(value[1])
    except OverflowError:  # an integer too large for a float
        raise r.error(key, f"must be a pair of numbers [low, high], got {value!r}") from None
    # The upper bound may be inf (no clamp, the usual value); the lower must be a real floor.
    if not (math.isfinite(low) and low >= 0 and high >= low):
        raise r.error(key, f"must satisfy 0 <= low <= high (high may be Infinity), got {value!r}")
    return low, high


def _head_dim(r: _Reader, heads: int, hidden: int, has_attention: bool) -> int:
    key = _key(r, "head_dim")
    if r.has(key):
        return r.int(key)
    if not has_attention:
        return 128  # transformers' default; unused
    # Neither spelling: what vLLM and NVIDIA's code derive (transformers would take its class
    # default, 128, whatever the model). The weights' shapes check the guess.
    if hidden % heads:
        raise r.error("head_dim", f"missing, and hidden_size {hidden} is not a multiple of {heads}")
    return hidden // heads


def _dtype(r: _Reader) -> str:
    key = "dtype" if r.has("dtype") else "torch_dtype"
    return _choice(r, key, "bfloat16", _DTYPES, "weights' dtype")


def _refuse_unsupported(r: _Reader) -> None:
    """Features transformers' model has or claims that no code here runs."""
    if r.has("sliding_window"):
        raise r.error("sliding_window", "sliding-window attention is not supported")
    if r.bool("attention_bias", default=False):
        # transformers builds q/k/v/o without biases whatever this says (NVIDIA's code honours
        # it), so there is no reference to check such a model against; no checkpoint has them.
        raise r.error("attention_bias", "attention biases are not supported")
    _choice(r, "mlp_hidden_act", "relu2", ("relu2",), "the MLP activation")
    _choice(r, "mamba_hidden_act", "silu", ("silu",), "the Mamba conv activation")
    model_type = r.data.get("model_type")
    if model_type is not None and model_type != "nemotron_h":
        raise r.error("model_type", f"must be 'nemotron_h', got {model_type!r}")


def _quantization_block(r: _Reader) -> Quantization | None:
    """The MLX affine block, if any. A ``quant_method`` names a scheme of another toolchain
    (fp8, GPTQ, AWQ, ...): refused here, since its tensors would otherwise fail the weight
    checks one confusing name at a time."""
    for key in ("quantization", "quantization_config"):
        block = r.dict(key)
        if block is not None and "quant_method" in block:
            raise r.error(
                key + ".quant_method",
                f"{block['quant_method']!r} is not supported (only MLX affine quantization)",
            )
    return _quantization(r, r)


def _validate(cfg: ModelConfig, r: _Reader, eos_file: str) -> None:
    """Cross-field checks; sizes of layer kinds the model has no layer of are not checked.
    ``eos_file``: the file the eos ids came from (generation_config.json replaces them)."""
    if cfg.attention_layers and cfg.num_attention_heads % cfg.num_key_value_heads:
        raise r.error(
            "num_key_value_heads",
            f"{cfg.num_key_value_heads} does not divide num_attention_heads "
            f"{cfg.num_attention_heads}",
        )
    # B and C are shared by the heads of a group, and the gated norm works per group.
    if cfg.mamba_layers and cfg.mamba_num_heads % cfg.n_groups:
        raise r.error(
            _key(r, "n_groups"),
            f"{cfg.n_groups} does not divide mamba_num_heads {cfg.mamba_num_heads}",
        )
    lo, hi = cfg.time_step_min, cfg.time_step_max
    if not 0 < lo <= hi:
        raise r.error(
            _key(r, "time_step_min"), f"must satisfy 0 < time_step_min <= time_step_max, got {lo}"
        )
    if cfg.time_step_floor < 0:
        raise r.error(_key(r, "time_step_floor"), f"must be >= 0, got {cfg.time_step_floor}")
    if cfg.layer_norm_epsilon <= 0:
        raise r.error(_key(r, "layer_norm_epsilon"), f"must be > 0, got {cfg.layer_norm_epsilon}")
    for key, ids in (
        ("eos_token_id", cfg.eos_token_ids),
        ("bos_token_id", () if cfg.bos_token_id is None else (cfg.bos_token_id,)),
        ("pad_token_id", () if cfg.pad_token_id is None else (cfg.pad_token_id,)),
    ):
        for token in ids:
            if token >= cfg.vocab_size:
                file = eos_file if key == "eos_token_id" else r.file
                problem = f"{token} is outside the vocabulary ({cfg.vocab_size})"
                raise ConfigError(key, file, problem)


def _kv_heads(r: _Reader, heads: int, has_attn: bool) -> int:
    if "num_key_value_heads" in r.data and r.data["num_key_value_heads"] is None:
        return heads  # transformers' rule for an explicit null: one KV head per head
    if r.has("num_key_value_heads") or has_attn:
        return r.int("num_key_value_heads")
    return heads


def _mamba_fields(r: _Reader, size: Any) -> dict[str, Any]:
    """The Mamba2 mixer's fields (``size(key, default)``: a size required when the pattern
    has Mamba2 layers)."""
    return dict(
        mamba_num_heads=size("mamba_num_heads", 128),
        mamba_head_dim=size("mamba_head_dim", 64),
        ssm_state_size=size("ssm_state_size", 128),
        n_groups=size("n_groups", 8),
        # A kernel of 1 would leave no conv state to carry between steps.
        conv_kernel=r.int(_key(r, "conv_kernel"), default=4, minimum=2),
        chunk_size=r.int(_key(r, "chunk_size"), default=128),
        use_conv_bias=r.bool(_key(r, "use_conv_bias"), default=True),
        use_bias=r.bool("use_bias", default=False),
        expand=r.int(_key(r, "expand"), default=2),
        time_step_limit=_time_step_limit(r),
        time_step_min=r.float(_key(r, "time_step_min"), default=0.001),
        time_step_max=r.float(_key(r, "time_step_max"), default=0.1),
        time_step_floor=r.float(_key(r, "time_step_floor"), default=1e-4),
        mamba_ssm_cache_dtype=_choice(
            r, "mamba_ssm_cache_dtype", "float32", _DTYPES, "the SSM state's dtype"
        ),
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` (+ optional ``generation_config.json``) of a checkpoint folder.

    Raises ConfigError (naming the field and the file) for any missing or invalid field.
    Required: ``vocab_size``, ``hidden_size``, the layer pattern (either spelling), and the
    sizes of each kind of layer the pattern uses (Mamba2: ``mamba_num_heads``,
    ``mamba_head_dim``, ``ssm_state_size``, ``n_groups``; attention: ``num_attention_heads``,
    ``num_key_value_heads``; MLP: ``intermediate_size``). The rest default as in transformers.
    """
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    r = _Reader(_decode_floats(_read_json(path)), str(path))
    _refuse_unsupported(r)

    kinds = _layer_types(r)

    def size(key: str, needed: bool, default: int) -> int:
        """A size that is required when its layer kind is present."""
        return r.int(_key(r, key), default=None if needed else default)

    has_mamba, has_attn, has_mlp = MAMBA in kinds, ATTENTION in kinds, MLP in kinds
    hidden = r.int("hidden_size")
    heads = size("num_attention_heads", has_attn, 32)
    config_eos = _eos_ids(r, "eos_token_id")
    eos, generation = _generation_config(model_dir, config_eos)
    eos_file = r.file if eos == config_eos else str(model_dir / "generation_config.json")

    cfg = ModelConfig(
        vocab_size=r.int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=len(kinds),
        layer_types=kinds,
        intermediate_size=size("intermediate_size", has_mlp, 21504),
        mlp_bias=r.bool("mlp_bias", default=False),
        num_attention_heads=heads,
        num_key_value_heads=_kv_heads(r, heads, has_attn),
        head_dim=_head_dim(r, heads, hidden, has_attn),
        **_mamba_fields(r, lambda key, default: size(key, has_mamba, default)),
        layer_norm_epsilon=r.float(_key(r, "layer_norm_epsilon"), default=1e-5),
        residual_in_fp32=r.bool("residual_in_fp32", default=False),
        tie_word_embeddings=r.bool("tie_word_embeddings", default=False),
        max_position_embeddings=r.int("max_position_embeddings", default=4096),
        eos_token_ids=eos,
        bos_token_id=_optional_id(r, "bos_token_id"),
        pad_token_id=_optional_id(r, "pad_token_id"),
        dtype=_dtype(r),
        quantization=_quantization_block(r),
        generation_defaults=generation,
    )
    _validate(cfg, r, eos_file)
    return cfg
