"""Reading a Nemotron-H checkpoint's safetensors into canonical text-model tensors.

One job: find the safetensors files (single or sharded with an index), map their names onto one
canonical naming, check every tensor against the configuration from the files' headers alone,
and hand back a lazy mapping that reads each tensor only when it is taken. Problems raise
:class:`~headstart.errors.CheckpointError` naming the tensor and the file; nothing is read
before every check has passed.

Canonical names are the text model's own names without the wrapper prefix (as for Qwen3.5):
files store ``backbone.*`` (NVIDIA's layout, and what transformers' ``save_pretrained`` writes
back), transformers' in-memory model names them ``model.*``; both map to the same names::

    embeddings.weight                                   [vocab, hidden]
    layers.{i}.norm.weight                              [hidden]        every layer
    layers.{i}.mixer.in_proj.weight                     [z + xBC + dt, hidden]   Mamba2
    layers.{i}.mixer.in_proj.bias                       (use_bias)
    layers.{i}.mixer.conv1d.weight                      [conv_dim, kernel]  (see below)
    layers.{i}.mixer.conv1d.bias                        (use_conv_bias)
    layers.{i}.mixer.{dt_bias, A_log, D}                [mamba heads]
    layers.{i}.mixer.norm.weight                        [mamba inner]   gated RMSNorm
    layers.{i}.mixer.out_proj.weight / .bias            [hidden, mamba inner] / (use_bias)
    layers.{i}.mixer.{q,k,v,o}_proj.weight              attention (never biases)
    layers.{i}.mixer.{up,down}_proj.weight / .bias      MLP / (mlp_bias)
    norm_f.weight                                       [hidden]
    lm_head.weight                                      [vocab, hidden]

``mtp.*`` tensors (multi-token prediction heads) are ignored, as transformers ignores them; any
other tensor the configuration does not imply is an error.

Tied embeddings: transformers never ties this family (its ``_tied_weights_keys`` is empty), so
a checkpoint that says ``tie_word_embeddings`` but stores ``lm_head.weight`` runs that head in
transformers; we return it too. Without one, the head is ``embeddings.weight`` and the mapping
has no ``lm_head.weight``.

``A_log``, ``D``, ``dt_bias`` and every norm weight are returned in fp32 (lossless from the
stored dtype; the SSM and the norms compute in fp32); other tensors are cast to ``dtype``.

MLX checkpoints (mlx-lm's ``models/nemotron_h.py`` and its converter) keep transformers' names
(``backbone.*``, ``lm_head.*``) and its norm weights as they are (no ``1 + w`` shift: this
family's norms are plain ``w * x``). Two things differ:

* the conv weight is stored ``[C, K, 1]`` (MLX's Conv1d layout, ``[out, kernel, in/groups]``)
  where transformers stores ``[C, 1, K]``; the config's kernel (at least 2) tells them apart;
* quantized modules (every projection, the embedding table and the head whose input size the
  group size divides) store ``<module>.weight`` as uint32 words beside ``<module>.scales`` and
  ``<module>.biases``; they are returned packed, as
  :class:`~headstart.quant.QuantizedTensor`, at the bits and group size config.json's
  ``quantization`` block gives that module. Conv weights, norms, ``A_log``, ``D``, ``dt_bias``
  and Linear ``.bias`` tensors are never quantized.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import Path

import torch
from safetensors import safe_open

from headstart.checkpoint import safetensors_files
from headstart.errors import CheckpointError
from headstart.models.nemotron_h.config import ATTENTION, MAMBA, MLP, ModelConfig

# The lazy mapping and its recipes know nothing of Qwen3.5 (a recipe is anything with
# ``read(device)`` and ``meta()``); they live in its module until a shared one exists.
from headstart.models.qwen35.weights import LazyWeights, Weight, _Plain, _Quant, _Source

__all__ = ["expected_shapes", "load_weights", "stored_name"]

_PREFIXES = (("backbone.", ""), ("model.", ""), ("lm_head.", "lm_head."))  # first match wins
_IGNORED = ("mtp.", "backbone.mtp.", "model.mtp.")
_FP32_SUFFIXES = ("mixer.A_log", "mixer.D", "mixer.dt_bias", "norm.weight", "norm_f.weight")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> logical shape of every tensor the text model needs (the conv weight
    without its unit axis). ``lm_head.weight`` is listed only for an untied model."""
    H, V = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embeddings.weight": (V, H)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        m = p + "mixer."
        shapes[p + "norm.weight"] = (H,)
        if kind == MAMBA:
            inner, nh = cfg.mamba_intermediate_size, cfg.mamba_num_heads
            shapes[m + "in_proj.weight"] = (cfg.mamba_in_proj_dim, H)
            if cfg.use_bias:
                shapes[m + "in_proj.bias"] = (cfg.mamba_in_proj_dim,)
            shapes[m + "conv1d.weight"] = (cfg.mamba_conv_dim, cfg.conv_kernel)
            if cfg.use_conv_bias:
                shapes[m + "conv1d.bias"] = (cfg.mamba_conv_dim,)
            shapes[m + "dt_bias"] = (nh,)
            shapes[m + "A_log"] = (nh,)
            shapes[m + "D"] = (nh,)
            shapes[m + "norm.weight"] = (inner,)
            shapes[m + "out_proj.weight"] = (H, inner)
            if cfg.use_bias:
                shapes[m + "out_proj.bias"] = (H,)
        elif kind == ATTENTION:
            shapes[m + "q_proj.weight"] = (cfg.q_dim, H)
            shapes[m + "k_proj.weight"] = (cfg.kv_dim, H)
            shapes[m + "v_proj.weight"] = (cfg.kv_dim, H)
            shapes[m + "o_proj.weight"] = (H, cfg.q_dim)
        elif kind == MLP:
            inter = cfg.intermediate_size
            shapes[m + "up_proj.weight"] = (inter, H)
            shapes[m + "down_proj.weight"] = (H, inter)
            if cfg.mlp_bias:
                shapes[m + "up_proj.bias"] = (inter,)
                shapes[m + "down_proj.bias"] = (H,)
        else:  # load_config admits no other kind
            raise AssertionError(f"layer {i}: unexpected kind {kind!r}")
    shapes["norm_f.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def stored_name(name: str) -> str:
    """The name a canonical tensor has in NVIDIA's (and transformers' saved) files."""
    return name if name.startswith("lm_head.") else "backbone." + name


def _canonical(name: str) -> str | None:
    for prefix, canon in _PREFIXES:
        if name.startswith(prefix):
            return canon + name[len(prefix) :]
    return None


def _read_headers(files: list[Path]) -> dict[str, _Source]:
    """Every text-model tensor by canonical name, from the headers alone (safetensors checks
    there that the file covers every tensor, so a truncated file fails here). A tensor of no
    known prefix, or one stored twice, is an error."""
    raw: dict[str, _Source] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    if name.startswith(_IGNORED):
                        continue
                    canon = _canonical(name)
                    if canon is None:
                        raise CheckpointError(
                            f"{path}: unexpected tensor '{name}' (not a Nemotron-H text-model "
                            "tensor)"
                        )
                    if canon in raw:
                        first = raw[canon]
                        raise CheckpointError(
                            f"{path}: tensor '{name}' is stored twice (also as '{first.name}' "
                            f"in {first.path})"
                        )
                    part = f.get_slice(name)
                    raw[canon] = _Source(path, name, tuple(part.get_shape()), part.get_dtype())
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises several types for damaged files
            raise CheckpointError(
                f"{path}: cannot read safetensors file (truncated or corrupt?): {e}"
            ) from None
    return raw


def _recipe(name: str, src: _Source, shape: tuple[int, ...], dtype: torch.dtype) -> _Plain:
    got, drop, stored_shape = src.shape, None, shape
    if name.endswith("conv1d.weight") and len(got) == 3:
        # transformers' Conv1d [C, 1, K] or MLX's [C, K, 1]; K >= 2 (load_config), so the unit
        # axis says which.
        stored_shape = (shape[0], 1, shape[1])
        if got[1] == 1:
            drop, got = 1, (got[0], got[2])
        elif got[2] == 1:
            drop, got = 2, (got[0], got[1])
    if got != shape:
        raise CheckpointError(
            f"{src.path}: tensor '{src.name}' has shape {src.shape}, config implies {stored_shape}"
        )
    if src.dtype is None or not src.dtype.is_floating_point:
        raise CheckpointError(
            f"{src.path}: tensor '{src.name}' has non-float dtype {src.describe_dtype()}"
        )
    final = torch.float32 if name.endswith(_FP32_SUFFIXES) else dtype
    return _Plain(src, shape, final, drop, plus_one=False)


_QUANT_PARTS = (".scales", ".biases")


def _quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether mlx-lm may have quantized this tensor: a Linear's or the Embedding's weight."""
    return name.endswith(".weight") and len(shape) == 2 and not name.endswith("conv1d.weight")


def _quant_recipe(
    name: str, raw: dict[str, _Source], shape: tuple[int, ...], cfg: ModelConfig
) -> _Quant:
    """The packed recipe of quantized ``name`` (its ``.scales`` are in ``raw``), every part
    checked against the spec config.json gives its module."""
    module = name[: -len(".weight")]
    packed, scales = raw[name], raw[module + ".scales"]
    stored = scales.name[: -len(".scales")]  # the module as the file names it
    at = f"{scales.path}: tensor '{scales.name}'"
    if not _quantizable(name, shape):
        raise CheckpointError(f"{at} marks '{packed.name}' quantized, which MLX never does")
    if cfg.quantization is None:
        raise CheckpointError(f"{at} marks '{stored}' quantized; config.json has no quantization")
    spec = cfg.quantization.spec_for(module)
    if spec is None:
        raise CheckpointError(f"{at} marks '{stored}' quantized, but config.json says unquantized")
    biases = raw.get(module + ".biases")
    if biases is None:
        raise CheckpointError(
            f"{at} has no '{stored}.biases' beside it (only affine quantization is supported)"
        )
    out_f, in_f = shape
    if in_f % spec.group_size:
        raise CheckpointError(
            f"{at}: group size {spec.group_size} does not divide the input size {in_f}"
        )
    want_packed = (out_f, in_f * spec.bits // 32)
    if packed.dtype not in (torch.uint32, torch.int32) or packed.shape != want_packed:
        raise CheckpointError(
            f"{packed.path}: tensor '{packed.name}' is {packed.describe_dtype()} {packed.shape}, "
            f"expected uint32 {want_packed} for {spec.bits}-bit weights of shape {shape}"
        )
    want_groups = (out_f, in_f // spec.group_size)
    for s in (scales, biases):
        if s.shape != want_groups or s.dtype is None or not s.dtype.is_floating_point:
            raise CheckpointError(
                f"{s.path}: tensor '{s.name}' is {s.describe_dtype()} {s.shape}, expected float "
                f"{want_groups} (group size {spec.group_size})"
            )
    return _Quant(packed, scales, biases, spec.bits, spec.group_size)


def _check_names(raw: dict[str, _Source], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every stored tensor is one the config implies, or a quantized module's scales/biases."""
    for name, src in raw.items():
        if name in shapes:
            continue
        part = next((p for p in _QUANT_PARTS if name.endswith(p)), None)
        weight = name[: -len(part)] + ".weight" if part else None
        if weight is None or weight not in shapes:
            raise CheckpointError(
                f"{src.path}: unexpected tensor '{src.name}' (config.json implies no such tensor)"
            )
        module = weight[: -len(".weight")]
        if part == ".biases" and module + ".scales" not in raw:
            raise CheckpointError(
                f"{src.path}: tensor '{src.name}' has no '.scales' beside it (a quantized "
                "module stores both)"
            )


def _plan(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, _Plain | _Quant]:
    """How to read and convert each tensor of the text model, every check done (headers only)."""
    raw = _read_headers(safetensors_files(model_dir))
    shapes = expected_shapes(cfg)
    if cfg.tie_word_embeddings and "lm_head.weight" in raw:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)  # see the module docstring
    _check_names(raw, shapes)
    recipes: dict[str, _Plain | _Quant] = {}
    for name, shape in shapes.items():
        if name not in raw:
            raise CheckpointError(
                f"{model_dir}: tensor '{stored_name(name)}' is missing from the checkpoint"
            )
        if name.endswith(".weight") and name[: -len(".weight")] + ".scales" in raw:
            recipes[name] = _quant_recipe(name, raw, shape, cfg)
        else:
            recipes[name] = _recipe(name, raw[name], shape, dtype)
    return recipes


def load_weights(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    lazy: bool = True,
) -> MutableMapping[str, Weight]:
    """Check every tensor of the text model from the file headers (see the module docstring),
    then return a :class:`~headstart.models.qwen35.weights.LazyWeights` that reads each one
    (cast, moved to ``device``) when it is taken, or (``not lazy``) a dict of them all read.
    Values are plain tensors, or :class:`~headstart.quant.QuantizedTensor` (still packed) for
    an MLX checkpoint's quantized modules. Problems raise :class:`CheckpointError` before any
    tensor is read."""
    weights = LazyWeights(_plan(Path(model_dir), cfg, dtype), device)
    return weights if lazy else {k: weights.pop(k) for k in weights}
