"""Reading and validating the configuration of a Qwen3.5 checkpoint.

One job: turn a checkpoint folder's ``config.json`` (and ``generation_config.json`` if present) into
a frozen :class:`ModelConfig`, in whichever placement the checkpoint uses (the vision-language
wrapper with ``text_config``, or a text-only export), with every size checked. Any missing or
invalid field raises :class:`~headstart.errors.ConfigError` naming the field and the file;
nothing else escapes. Non-goal: the vision tower and the MTP head (ignored).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headstart.errors import ConfigError

LINEAR = "linear_attention"
FULL = "full_attention"

# Bits per weight we can unpack from uint32 words without a cross-word bit stream.
SUPPORTED_BITS = (2, 4, 8)


@dataclass(frozen=True)
class QuantSpec:
    """Affine quantization of one module (MLX layout): ``W = scales * q + biases`` per group."""

    bits: int
    group_size: int


@dataclass(frozen=True)
class Quantization:
    """The checkpoint's quantization block: a default and per-module overrides.

    ``overrides`` maps a module path (as written in the config, e.g.
    ``language_model.model.layers.0.mlp.down_proj``) to its own spec, or to None where that module
    is explicitly left unquantized.
    """

    default: QuantSpec
    overrides: tuple[tuple[str, QuantSpec | None], ...] = ()

    def spec_for(self, module_path: str) -> QuantSpec | None:
        """The spec of a module, matching overrides on the path's suffix (prefixes differ by
        layout)."""
        for path, spec in self.overrides:
            if (
                module_path == path
                or module_path.endswith("." + path)
                or path.endswith("." + module_path)
            ):
                return spec
        return self.default


@dataclass(frozen=True)
class ModelConfig:
    """The text model of a Qwen3.5 checkpoint, validated. Field names follow HF's config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    dtype: str = "bfloat16"
    quantization: Quantization | None = None
    # Sampling defaults from generation_config.json (temperature, top_p, top_k, ...), if any.
    generation_defaults: tuple[tuple[str, float], ...] = field(default=())

    # Derived sizes (names from the architecture notes).
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)


class _Reader:
    """Typed field access that turns every problem into a ConfigError naming field and file."""

    def __init__(self, data: dict[str, Any], file: str, prefix: str = "") -> None:
        self.data = data
        self.file = file
        self.prefix = prefix

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(self.prefix + key, self.file, problem)

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        if not self.has(key):
            if default is None:
                raise self.error(key, "missing")
            return default
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {value}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        if not self.has(key):
            if default is None:
                raise self.error(key, "missing")
            return default
        value = self.data[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"must be a number, got {value!r}")
        if not math.isfinite(value):
            raise self.error(key, f"must be finite, got {value!r}")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        if not self.has(key):
            return default
        value = self.data[key]
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def dict(self, key: str) -> dict[str, Any] | None:
        if not self.has(key):
            return None
        value = self.data[key]
        if not isinstance(value, dict):
            raise self.error(key, f"must be an object, got {type(value).__name__}")
        return value

    def sub(self, key: str) -> _Reader | None:
        value = self.dict(key)
        return None if value is None else _Reader(value, self.file, f"{self.prefix}{key}.")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("(file)", str(path), "file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("(file)", str(path), f"cannot be read: {e}") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ConfigError("(file)", str(path), f"is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("(file)", str(path), "must hold a JSON object")
    return data


def _layer_types(text: _Reader, num_layers: int) -> tuple[str, ...]:
    if text.has("layer_types"):
        value = text.data["layer_types"]
        if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
            raise text.error("layer_types", "must be a list of strings")
        if len(value) != num_layers:
            raise text.error(
                "layer_types", f"has {len(value)} entries for {num_layers} hidden layers"
            )
        for t in value:
            if t not in (LINEAR, FULL):
                raise text.error("layer_types", f"unknown layer type {t!r}")
        return tuple(value)
    # HF's rule when the list is absent: layer i is full attention iff (i + 1) % interval == 0.
    interval = text.int("full_attention_interval", default=4)
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers))


def _rope(text: _Reader) -> tuple[float, float]:
    """rope_parameters.X first, then the legacy top-level key, then HF's default."""
    params = text.sub("rope_parameters")
    scaling = text.sub("rope_scaling")
    for source in (params, scaling):
        if source is not None and source.has("rope_type"):
            rope_type = source.data["rope_type"]
            if rope_type not in ("default", "mrope"):
                raise source.error("rope_type", f"unsupported rope type {rope_type!r}")
    theta = None
    factor = None
    if params is not None:
        if params.has("rope_theta"):
            theta = params.float("rope_theta")
        if params.has("partial_rotary_factor"):
            factor = params.float("partial_rotary_factor")
            if not 0.0 < factor <= 1.0:
                raise params.error("partial_rotary_factor", f"must be in (0, 1], got {factor}")
    if theta is None:
        theta = text.float("rope_theta", default=10000.0)
    if factor is None:
        factor = text.float("partial_rotary_factor", default=0.25)
        if not 0.0 < factor <= 1.0:
            raise text.error("partial_rotary_factor", f"must be in (0, 1], got {factor}")
    if theta <= 0:
        raise text.error("rope_theta", f"must be > 0, got {theta}")
    return theta, factor


def _quant_spec(
    r: _Reader, key: str, block: dict[str, Any], default: QuantSpec | None
) -> QuantSpec:
    sub = _Reader(block, r.file, f"{r.prefix}{key}.")
    bits = sub.int("bits", default=None if default is None else default.bits)
    group = sub.int("group_size", default=None if default is None else default.group_size)
    if bits not in SUPPORTED_BITS:
        raise sub.error(
            "bits", f"{bits}-bit weights are not supported (supported: {SUPPORTED_BITS})"
        )
    if group not in (32, 64, 128):
        raise sub.error("group_size", f"must be 32, 64 or 128, got {group}")
    mode = block.get("mode", "affine")
    if mode != "affine":
        raise sub.error("mode", f"only affine quantization is supported, got {mode!r}")
    return QuantSpec(bits=bits, group_size=group)


def _quantization(top: _Reader, text: _Reader) -> Quantization | None:
    reader, key = top, None
    for r, k in (
        (top, "quantization"),
        (top, "quantization_config"),
        (text, "quantization"),
        (text, "quantization_config"),
    ):
        if r.dict(k) is not None:
            reader, key = r, k
            break
    if key is None:
        return None
    block = reader.dict(key)
    assert block is not None
    if "quant_method" in block and "bits" not in block:
        raise reader.error(
            key + ".quant_method", f"unsupported quantization {block['quant_method']!r}"
        )
    default = _quant_spec(reader, key, block, None)
    overrides: list[tuple[str, QuantSpec | None]] = []
    for name, value in block.items():
        if name in ("bits", "group_size", "mode", "quant_method"):
            continue
        if value is False:
            overrides.append((name, None))
        elif isinstance(value, dict):
            overrides.append((name, _quant_spec(reader, f"{key}.{name}", value, default)))
        else:
            raise reader.error(f"{key}.{name}", f"must be an object or false, got {value!r}")
    return Quantization(default=default, overrides=tuple(overrides))


def _eos_ids(r: _Reader, key: str) -> tuple[int, ...]:
    if not r.has(key):
        return ()
    value = r.data[key]
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise r.error(key, f"must be a token id or a list of token ids, got {value!r}")
    return tuple(values)


def _validate(cfg: ModelConfig, text: _Reader) -> None:
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise text.error(
            "num_key_value_heads",
            f"{cfg.num_key_value_heads} does not divide num_attention_heads "
            f"{cfg.num_attention_heads}",
        )
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise text.error(
            "linear_num_value_heads",
            f"{cfg.linear_num_value_heads} is not a multiple of linear_num_key_heads "
            f"{cfg.linear_num_key_heads}",
        )
    rd = cfg.head_dim * cfg.partial_rotary_factor
    if rd != int(rd) or int(rd) % 2 or int(rd) < 2:
        raise text.error(
            "partial_rotary_factor",
            f"head_dim {cfg.head_dim} x {cfg.partial_rotary_factor} must be an even whole number",
        )
    if cfg.rms_norm_eps <= 0:
        raise text.error("rms_norm_eps", f"must be > 0, got {cfg.rms_norm_eps}")
    for eos in cfg.eos_token_ids:
        if eos >= cfg.vocab_size:
            raise text.error("eos_token_id", f"{eos} is outside the vocabulary ({cfg.vocab_size})")
    if cfg.quantization is not None:
        # Modules whose input dim the group does not divide stay unquantized (mlx-lm's rule) and
        # are checked tensor by tensor at load; the hidden size feeds nearly every projection.
        group = cfg.quantization.default.group_size
        if cfg.hidden_size % group:
            raise ConfigError(
                "quantization.group_size",
                text.file,
                f"{group} does not divide hidden_size {cfg.hidden_size}",
            )


def _generation_config(
    model_dir: Path, eos: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[tuple[str, float], ...]]:
    """The eos ids and sampling defaults of ``generation_config.json``, if the folder has one.

    Its eos ids, when it lists any, replace ``eos`` (those of ``config.json``), as in HF.
    """
    path = model_dir / "generation_config.json"
    if not path.exists():
        return eos, ()
    gen = _Reader(_read_json(path), str(path))
    eos = _eos_ids(gen, "eos_token_id") or eos
    defaults = tuple(
        (key, gen.float(key))
        for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        if gen.has(key)
    )
    return eos, defaults


def _dtype(top: _Reader, text: _Reader) -> str:
    """The weights' dtype: either key, text config first (then the wrapper's), else bfloat16."""
    dtype = (
        text.data.get("dtype")
        or text.data.get("torch_dtype")
        or top.data.get("dtype")
        or top.data.get("torch_dtype")
        or "bfloat16"
    )
    if dtype not in ("bfloat16", "float16", "float32"):
        raise text.error("dtype", f"unsupported dtype {dtype!r}")
    return dtype


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read ``config.json`` (+ optional ``generation_config.json``) of a checkpoint folder.

    Raises ConfigError (naming the field and the file) for any missing or invalid field.
    """
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    top = _Reader(_read_json(path), str(path))
    text = top.sub("text_config") or top

    num_layers = text.int("num_hidden_layers")
    theta, factor = _rope(text)
    eos = _eos_ids(text, "eos_token_id") or _eos_ids(top, "eos_token_id")
    eos, generation = _generation_config(model_dir, eos)
    dtype = _dtype(top, text)
    # The wrapper repeats tie_word_embeddings at the top level, which HF's wrapper model reads.
    tie = top.bool("tie_word_embeddings", default=text.bool("tie_word_embeddings", default=False))

    cfg = ModelConfig(
        vocab_size=text.int("vocab_size"),
        hidden_size=text.int("hidden_size"),
        intermediate_size=text.int("intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=text.int("num_attention_heads"),
        num_key_value_heads=text.int("num_key_value_heads"),
        head_dim=text.int("head_dim"),
        linear_num_key_heads=text.int("linear_num_key_heads"),
        linear_num_value_heads=text.int("linear_num_value_heads"),
        linear_key_head_dim=text.int("linear_key_head_dim"),
        linear_value_head_dim=text.int("linear_value_head_dim"),
        linear_conv_kernel_dim=text.int("linear_conv_kernel_dim", default=4, minimum=2),
        layer_types=_layer_types(text, num_layers),
        rms_norm_eps=text.float("rms_norm_eps", default=1e-6),
        rope_theta=theta,
        partial_rotary_factor=factor,
        max_position_embeddings=text.int("max_position_embeddings", default=262144),
        tie_word_embeddings=tie,
        eos_token_ids=eos,
        dtype=dtype,
        quantization=_quantization(top, text),
        generation_defaults=generation,
    )
    _validate(cfg, text)
    return cfg
