"""Exporting the trained target as the embedded default model (MLX 4-bit + tokenizer + template)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from headstart.models.qwen35.convert import write_mlx

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def export_default(
    model,
    tokenizer_dir: Path,
    out: Path,
    eos_ids: list[int],
    bits: int = 4,
    group: int = 64,
    generation: dict | None = None,
    drafter_devices: list[str] | None = None,
) -> Path:
    """Write ``model`` (an HF ``Qwen3_5ForCausalLM``) to ``out`` in the MLX affine layout, with
    the tokenizer files from ``tokenizer_dir``, a generation_config and ``headstart.json``:
    the serving defaults (thinking off: the model was never trained to think, and with
    thinking on its answer would sit in an unclosed ``<think>`` block, empty ``content``) and
    the device types where its drafter was measured to pay (none until measured)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    config["architectures"] = ["Qwen3_5ForCausalLM"]
    write_mlx(state, config, out, bits, group)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    # A repetition penalty of 1.1: at 8M parameters greedy decoding falls into loops
    # ("_set_set_set..."), and the penalty ends most of them (BENCHMARKS.md, 20 chat requests).
    gen = {
        "eos_token_id": eos_ids,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.1,
    }
    gen.update(generation or {})
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_policy(out, drafter_devices or [])
    return out


SERVING = {"chat_template_kwargs": {"enable_thinking": False}}


def write_policy(out: Path, drafter_devices: list[str]) -> None:
    """``headstart.json``, read by ``headstart.loading`` (``default_drafter``,
    ``serving_defaults``)."""
    policy = {"drafter_devices": sorted(drafter_devices), "serving": SERVING}
    (Path(out) / "headstart.json").write_text(json.dumps(policy) + "\n")


def model_files_bytes(out: Path) -> int:
    return sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file())
