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
) -> Path:
    """Write ``model`` (an HF ``Qwen3_5ForCausalLM``) to ``out`` in the MLX affine layout, with
    the tokenizer files from ``tokenizer_dir`` and a generation_config."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    config["architectures"] = ["Qwen3_5ForCausalLM"]
    write_mlx(state, config, out, bits, group)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    gen = {"eos_token_id": eos_ids, "temperature": 0.7, "top_p": 0.9, "top_k": 20}
    gen.update(generation or {})
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def model_files_bytes(out: Path) -> int:
    return sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file())
