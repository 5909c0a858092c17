"""Finding a model folder (embedded default, local path or hub name) and loading it whole."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from headstart.errors import CheckpointError, HeadstartError
from headstart.models import CausalLM, ModelFamily, family_for
from headstart.ops.quant_matmul.cpu import UNPACK_BYTES
from headstart.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --prefill-weights -> the dense_bytes a family's load takes (None: its own default)
PREFILL_WEIGHTS: dict[str, int | None] = {"auto": None, "dense": 1 << 62, "packed": 0}


def default_model_dir() -> Path:
    """The small model shipped inside the package."""
    return Path(str(resources.files("headstart") / "default_model"))


def default_drafter(device_type: str, model_dir: Path | None = None) -> Path | None:
    """The drafter shipped with the embedded default model, if speculative decoding with it was
    measured to pay on this kind of device. ``headstart.json`` beside the model lists those
    device types (``"drafter_devices"``); without the file, a shipped drafter is used anywhere."""
    import json

    model_dir = model_dir or default_model_dir()
    drafter = model_dir / "drafter"
    if not (drafter / "config.json").exists():
        return None
    policy = model_dir / "headstart.json"
    if policy.exists():
        devices = json.loads(policy.read_text()).get("drafter_devices", [])
        if device_type not in devices:
            return None
    return drafter


def serving_defaults(model_dir: Path) -> dict[str, Any]:
    """The serving defaults a model folder states in ``headstart.json`` (``"serving"``), e.g.
    ``{"chat_template_kwargs": {"enable_thinking": false}}``; a request's own values win.
    Raises CheckpointError naming the file when it is malformed."""
    import json

    path = model_dir / "headstart.json"
    if not path.exists():
        return {}
    try:
        serving = json.loads(path.read_text()).get("serving", {})
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a JSON object ({e})") from None
    kwargs = serving.get("chat_template_kwargs", {}) if isinstance(serving, dict) else None
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise CheckpointError(f"{path}: 'serving.chat_template_kwargs' must be an object")
    return {"chat_template_kwargs": kwargs}


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a CUDA device, else ``cpu``; anything else as given."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_model_dir(name: str | None) -> Path:
    """None -> the embedded default; an existing folder -> itself; ``org/name`` -> a hub
    download."""
    if name is None:
        return default_model_dir()
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{name}: not a folder (give the checkpoint's folder)")
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise CheckpointError(
                f"{name}: no such folder, and huggingface_hub is not installed to fetch it"
            ) from None
        try:
            return Path(
                snapshot_download(
                    name, allow_patterns=["*.json", "*.safetensors", "*.jinja", "tokenizer*"]
                )
            )
        except Exception as e:  # network, auth, missing repo: all reported the same way
            raise CheckpointError(f"{name}: cannot fetch from the hub: {e}") from None
    raise CheckpointError(f"{name}: no such folder")


@dataclass
class LoadedModel:
    path: Path
    model: CausalLM
    tokenizer: Tokenizer
    family: ModelFamily

    @property
    def template_defaults(self) -> dict[str, Any]:
        """Chat-template variables the model folder asks for unless a request sets them."""
        return dict(serving_defaults(self.path).get("chat_template_kwargs", {}))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = self.model.cfg.eos_token_ids
        extra = self.tokenizer.eos_token_id
        return ids if extra is None or extra in ids else (*ids, extra)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel model (nothing to do for one process)."""
        peers = getattr(self.model, "peers", None)
        if peers is not None:
            peers.close()


def load(
    name: str | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    kernels: str = "auto",
    load_format: str = "auto",
    prefill_weights: str = "auto",
    tensor_parallel: int = 1,
) -> LoadedModel:
    """Load model and tokenizer, through the family the checkpoint belongs to. dtype defaults
    as :func:`default_dtype` says; kernels: "auto" (GPU kernels on CUDA when available, else
    the CPU set), "reference", "cpu" or "gpu"; load_format: "auto" (the checkpoint's weights) or
    "dummy" (random weights at its config's shapes: speed measurements without the weights);
    prefill_weights: "auto" (the family's rule for keeping dense copies of quantized weights
    for prefill, by device memory), "dense" (always) or "packed" (never); tensor_parallel: the
    model split over that many processes (rank 0 is this one; see ``headstart.parallel``),
    refused (HeadstartError) for a family or a checkpoint that cannot be split so."""
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    if prefill_weights not in PREFILL_WEIGHTS:
        raise ValueError(f"prefill_weights must be one of {sorted(PREFILL_WEIGHTS)}")
    path = resolve_model_dir(name)
    dtype = dtype or default_dtype(path, device)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    family = family_for(path)
    check_tensor_parallel(family, path, tensor_parallel)
    tokenizer = Tokenizer.from_dir(path)
    params = inspect.signature(family.load).parameters
    extra: dict[str, Any] = {}
    if load_format == "dummy":
        if "dummy" not in params:
            raise HeadstartError(
                f"the {family.name} family cannot make random weights (--load-format dummy)"
            )
        extra["dummy"] = True
    if PREFILL_WEIGHTS[prefill_weights] is not None and "dense_bytes" in params:
        extra["dense_bytes"] = PREFILL_WEIGHTS[prefill_weights]
    if tensor_parallel == 1:
        model = family.load(path, DTYPES[dtype], device, kernels, **extra)
    else:
        from headstart.parallel.launch import load_parallel

        model = load_parallel(family, path, tensor_parallel, DTYPES[dtype], device, kernels, extra)
    return LoadedModel(path, model, tokenizer, family)


def default_dtype(path: Path, device: str) -> str:
    """bfloat16 on an accelerator; on the CPU float32 (exact against fp32 references), except
    for a 4-bit checkpoint too big to unpack at load (more than ``UNPACK_BYTES`` in fp32,
    estimated from config.json): its weights stay packed, and only bf16 activations have a
    fast int4 CPU kernel (``ops/quant_matmul/cpu.py``)."""
    if device != "cpu":
        return "bfloat16"
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"  # the family's loader reports a bad config properly
    text = cfg.get("text_config") or cfg
    quant = cfg.get("quantization") or cfg.get("quantization_config") or {}
    if not isinstance(quant, dict) or quant.get("bits") != 4 or not isinstance(text, dict):
        return "float32"
    h, layers = text.get("hidden_size", 0), text.get("num_hidden_layers", 0)
    inter, vocab = text.get("intermediate_size", 0), text.get("vocab_size", 0)
    if not all(isinstance(v, int) for v in (h, layers, inter, vocab)):
        return "float32"
    params = layers * (4 * h * h + 3 * h * inter) + vocab * h  # attention-sized mixers, MLP, head
    return "bfloat16" if 4 * params > UNPACK_BYTES else "float32"


def check_tensor_parallel(family: ModelFamily, path: Path, world: int) -> None:
    """Raise HeadstartError, before any process starts, when the checkpoint in ``path`` cannot
    be split ``world`` ways: a family without tensor parallelism, or heads that ``world``
    does not divide (the family's ``split`` says which)."""
    if world < 1:
        raise HeadstartError(f"--tensor-parallel must be >= 1, not {world}")
    if world == 1:
        return
    if family.split is None:
        raise HeadstartError(
            f"the {family.name} family has no tensor-parallel support "
            f"(--tensor-parallel {world}); serve it with --tensor-parallel 1"
        )
    family.split(path, world)
