"""A checkpoint folder's safetensors weight files (any family)."""

from __future__ import annotations

import json
from pathlib import Path

from headstart.errors import CheckpointError

__all__ = ["safetensors_files"]


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
    files = sorted(
        p
        for p in model_dir.iterdir()
        if ".safetensors" in p.name and p.is_file() and not p.name.endswith(".json")
    )
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors weight files found")
    return files
