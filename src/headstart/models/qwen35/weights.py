"""Reading a checkpoint's safetensors into canonical text-model tensors.

One job: find the safetensors files (single or sharded with an index), map the names of the three
layouts we accept onto one canonical naming (HF's text-model names, e.g.
``layers.3.self_attn.q_proj``), undo the MLX conversions (conv ``[C, K, 1]``, zero-centred
norms stored as ``1 + w``), keep MLX quantized modules packed, and check every tensor against
the configuration. Problems raise :class:`~headstart.errors.CheckpointError` naming the file or
tensor.

Layouts:
  * HF wrapper   ``model.language_model.*`` + ``lm_head.weight`` (``model.visual.*``, ``mtp.*``
    ignored)
  * HF text-only ``model.*`` + ``lm_head.weight``
  * MLX          ``language_model.model.*`` + ``language_model.lm_head.*``; ``.scales``/``.biases``
    beside a uint32 ``.weight`` mark a quantized module.

Norm weights are returned as the *multiplier* (``1 + w`` for zero-centred norms) in fp32; ``A_log``,
``dt_bias`` and the GDN output norm are fp32 too; other float tensors are cast to ``dtype``.

Everything is checked from the files' headers before any tensor is read (:func:`plan_weights`);
:func:`load_weights` then reads every tensor, or returns a :class:`LazyWeights` mapping that reads
each one (and moves it to the device) only when it is taken, so a loader that builds its own
final copies never holds a second full copy of the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from headstart.arena import to_meta
from headstart.checkpoint import safetensors_files
from headstart.errors import CheckpointError
from headstart.models.qwen35.config import ModelConfig
from headstart.quant import QuantizedTensor

Weight = torch.Tensor | QuantizedTensor

_PREFIXES = (  # (prefix in file, canonical prefix); first match wins
    ("model.language_model.", ""),
    ("language_model.model.", ""),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
    ("model.", ""),
)
_IGNORED = (
    "model.visual.",
    "visual.",
    "vision_tower.",
    "mtp.",
    "model.mtp.",
    "language_model.mtp.",
)

# Norms stored as w with output * (1 + w) in HF; MLX stores 1 + w.
_ZERO_CENTRED = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)
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


def _canonical(name: str) -> str | None:
    if name.startswith(_IGNORED):
        return None
    for prefix, canon in _PREFIXES:
        if name.startswith(prefix):
            return canon + name[len(prefix) :]
    return None


# safetensors header dtype -> torch dtype (those this torch has).
_DTYPES = {
    name: getattr(torch, attr)
    for name, attr in (
        ("BOOL", "bool"),
        ("U8", "uint8"),
        ("I8", "int8"),
        ("I16", "int16"),
        ("U16", "uint16"),
        ("I32", "int32"),
        ("U32", "uint32"),
        ("I64", "int64"),
        ("U64", "uint64"),
        ("F16", "float16"),
        ("BF16", "bfloat16"),
        ("F32", "float32"),
        ("F64", "float64"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
    )
    if hasattr(torch, attr)
}


@dataclass(frozen=True)
class _Source:
    """One stored tensor: its file and name there, and the shape and dtype its header gives."""

    path: Path
    name: str
    shape: tuple[int, ...]
    stored: str  # the header's dtype, e.g. "BF16"

    @property
    def dtype(self) -> torch.dtype | None:
        """None: a dtype torch cannot hold."""
        return _DTYPES.get(self.stored)

    def describe_dtype(self) -> str:
        return str(self.dtype) if self.dtype is not None else self.stored

    def read(self) -> torch.Tensor:
        try:
            with safe_open(str(self.path), framework="pt", device="cpu") as f:
                return f.get_tensor(self.name)
        except Exception as e:  # the file changed or was damaged after its header was checked
            raise CheckpointError(f"{self.path}: cannot read tensor '{self.name}': {e}") from None


@dataclass(frozen=True)
class _Plain:
    """A float tensor: read, the conv's unit axis dropped, cast (zero-centred norms: + 1)."""

    src: _Source
    shape: tuple[int, ...]
    dtype: torch.dtype
    drop_axis: int | None  # conv1d: HF [C, 1, K] -> 1, MLX [C, K, 1] -> 2
    plus_one: bool

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")

    def read(self, device: torch.device) -> torch.Tensor:
        t = self.src.read()
        if self.drop_axis is not None:
            t = t.select(self.drop_axis, 0)
        t = t.to(self.dtype)
        if self.plus_one:
            t = t + 1.0
        return t.to(device)


@dataclass(frozen=True)
class _Quant:
    """An MLX affine-quantized module: packed words (U32 read as int32), scales, biases."""

    packed: _Source
    scales: _Source
    biases: _Source
    bits: int
    group_size: int

    def meta(self) -> QuantizedTensor:
        def empty(s: _Source, dtype: torch.dtype | None = None) -> torch.Tensor:
            return torch.empty(s.shape, dtype=dtype or s.dtype, device="meta")

        return QuantizedTensor(
            empty(self.packed, torch.int32),
            empty(self.scales),
            empty(self.biases),
            self.bits,
            self.group_size,
        )

    def read(self, device: torch.device) -> QuantizedTensor:
        return QuantizedTensor(
            self.packed.read().view(torch.int32).to(device),
            self.scales.read().to(device),
            self.biases.read().to(device),
            self.bits,
            self.group_size,
        )


_Recipe = _Plain | _Quant


def _read_headers(files: list[Path]) -> tuple[dict[str, _Source], bool]:
    """Every text-model tensor by canonical name, from the headers alone (safetensors checks
    there that the file covers every tensor, so a truncated file fails here), and whether any
    file says it is MLX."""
    raw: dict[str, _Source] = {}
    mlx_meta = False
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                mlx_meta |= (f.metadata() or {}).get("format") == "mlx"
                for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    canon = _canonical(name)
                    if canon is not None:
                        part = f.get_slice(name)
                        raw[canon] = _Source(path, name, tuple(part.get_shape()), part.get_dtype())
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises several types for damaged files
            raise CheckpointError(
                f"{path}: cannot read safetensors file (truncated or corrupt?): {e}"
            ) from None
    return raw, mlx_meta


def _plan(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, _Recipe]:
    """How to read and convert each tensor of the text model, every check done (headers only)."""
    raw, mlx_meta = _read_headers(safetensors_files(model_dir))
    if cfg.tie_word_embeddings:
        # A tied checkpoint may still carry a copy of the head; HF ignores it, and so do we.
        for key in [k for k in raw if k.startswith("lm_head.")]:
            del raw[key]
    # MLX's own test for "norms already shifted": any conv weight stored [C, K, 1].
    conv = next((s for k, s in raw.items() if k.endswith("conv1d.weight")), None)
    mlx_layout = mlx_meta or (
        conv is not None
        and len(conv.shape) == 3
        and conv.shape[-1] == 1
        and cfg.linear_conv_kernel_dim != 1
    )
    recipes: dict[str, _Recipe] = {}
    for name, shape in expected_shapes(cfg).items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is not None and module + ".scales" in raw:
            recipes[name] = _quantized(raw, module, shape, cfg)
            continue
        if name not in raw:
            raise CheckpointError(f"{model_dir}: tensor '{name}' is missing from the checkpoint")
        recipes[name] = _plain(model_dir, name, raw[name], shape, dtype, mlx_layout)
    return recipes


def _plain(
    model_dir: Path,
    name: str,
    src: _Source,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    mlx_layout: bool,
) -> _Plain:
    got, drop = src.shape, None
    if name.endswith("conv1d.weight") and len(got) == 3:  # HF [C, 1, K]; MLX [C, K, 1]
        drop = 2 if got[-1] == 1 and got[1] != 1 else 1
        got = got[:drop] + got[drop + 1 :]
    if got != shape:
        raise CheckpointError(
            f"{model_dir}: tensor '{name}' has shape {got}, config implies {shape}"
        )
    if src.dtype is None or not src.dtype.is_floating_point:
        raise CheckpointError(
            f"{model_dir}: tensor '{name}' has non-float dtype {src.describe_dtype()}"
        )
    norm = name.endswith(_ZERO_CENTRED) or name == "norm.weight"
    final = torch.float32 if norm or name.endswith(_FP32) else dtype
    return _Plain(src, shape, final, drop, norm and not mlx_layout)


def _quantized(
    raw: dict[str, _Source], module: str, shape: tuple[int, ...], cfg: ModelConfig
) -> _Quant:
    if cfg.quantization is None:
        raise CheckpointError(f"'{module}' is quantized but config.json has no quantization block")
    spec = cfg.quantization.spec_for(module)
    if spec is None:
        raise CheckpointError(f"'{module}' is quantized but the config marks it unquantized")
    packed, scales = raw.get(module + ".weight"), raw[module + ".scales"]
    if packed is None:
        raise CheckpointError(f"'{module}' has scales but no packed weight")
    biases = raw.get(module + ".biases")
    if biases is None:
        raise CheckpointError(
            f"'{module}' has scales but no biases (only affine mode is supported)"
        )
    out_f, in_f = shape
    want_packed = (out_f, in_f * spec.bits // 32)
    want_groups = (out_f, in_f // spec.group_size) if in_f % spec.group_size == 0 else None
    if want_groups is None:
        raise CheckpointError(f"'{module}': group size {spec.group_size} does not divide {in_f}")
    if packed.dtype not in (torch.uint32, torch.int32) or packed.shape != want_packed:
        raise CheckpointError(
            f"'{module}.weight' is {packed.describe_dtype()} {packed.shape}, expected uint32 "
            f"{want_packed} for {spec.bits}-bit weights of shape {shape}"
        )
    for part, s in (("scales", scales), ("biases", biases)):
        if s.shape != want_groups or s.dtype is None or not s.dtype.is_floating_point:
            raise CheckpointError(
                f"'{module}.{part}' is {s.describe_dtype()} {s.shape}, expected float {want_groups}"
            )
    return _Quant(packed, scales, biases, spec.bits, spec.group_size)


class LazyWeights(MutableMapping[str, Weight]):
    """A checkpoint's tensors by canonical name, each read from its file (converted, moved to
    the device) only when its value is asked for; every name, shape, dtype and quantization was
    checked from the headers when this was made.

    Reads are not cached: ``pop`` reads a tensor once and keeps nothing, while ``[]``,
    ``values()`` and ``items()`` read it anew each time. ``in``, ``len`` and iteration read
    nothing. Values set here (e.g. a stack made of popped parts) are held as given.
    """

    def __init__(self, recipes: Mapping[str, _Recipe], device: torch.device | str) -> None:
        self._recipes = dict(recipes)
        self._held: dict[str, Weight] = {}
        self.device = torch.device(device)

    def __getitem__(self, key: str) -> Weight:
        if key in self._held:
            return self._held[key]
        return self._recipes[key].read(self.device)

    def __setitem__(self, key: str, value: Weight) -> None:
        self._recipes.pop(key, None)
        self._held[key] = value

    def __delitem__(self, key: str) -> None:
        if key in self._held:
            del self._held[key]
        else:
            del self._recipes[key]

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self._recipes or key in self._held

    def __iter__(self) -> Iterator[str]:
        return iter([*self._recipes, *self._held])  # a snapshot: callers pop as they go

    def __len__(self) -> int:
        return len(self._recipes) + len(self._held)

    def meta(self) -> dict[str, Weight]:
        """Meta stand-ins (shapes and dtypes as a read would give, no data) of every value."""
        return {
            k: self._recipes[k].meta() if k in self._recipes else to_meta(self._held[k])
            for k in self
        }


def stand_ins(weights: Mapping[str, Weight]) -> dict[str, Weight]:
    """Meta stand-ins of every value of ``weights``. A mapping with a ``meta()`` method (a
    :class:`LazyWeights`, a benchmark's random weights) gives them without making any value."""
    if hasattr(weights, "meta"):
        return weights.meta()
    return {k: to_meta(v) for k, v in weights.items()}


def load_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    lazy: bool = False,
) -> MutableMapping[str, Weight]:
    """Check every tensor of the text model from the file headers (see the module docstring),
    then read and convert them all into a dict, or (``lazy``) return a :class:`LazyWeights`
    that reads each one when it is taken. Problems raise :class:`CheckpointError` before any
    tensor is read."""
    weights = LazyWeights(_plan(Path(model_dir), cfg, dtype), device)
    return weights if lazy else {k: weights.pop(k) for k in weights}
