"""Model families and the registry that finds the one a checkpoint belongs to.

``family_for(model_dir)`` reads the folder's ``config.json`` and returns the first registered
family that claims it (by ``architectures`` or ``model_type``); a config no family claims is
given to the default family (the first registered, Qwen3.5), whose config checks then name
what is missing, as before families existed. Families outside the package register with
:func:`register`, or are imported at first lookup from the modules named in
``HEADSTART_MODEL_FAMILIES`` (comma-separated ``module`` or ``module:attribute``; the module
registers itself on import).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from headstart.errors import CheckpointError
from headstart.models.contract import CausalLM, ChatFormat, ForwardOutput, ModelFamily

__all__ = [
    "CausalLM",
    "ChatFormat",
    "ForwardOutput",
    "ModelFamily",
    "families",
    "family_for",
    "register",
]

_FAMILIES: list[ModelFamily] = []
_plugins_loaded = False


def register(family: ModelFamily) -> ModelFamily:
    """Add (or replace, by name) a family; returns it."""
    _FAMILIES[:] = [f for f in _FAMILIES if f.name != family.name]
    _FAMILIES.append(family)
    return family


def families() -> tuple[ModelFamily, ...]:
    _load_builtin()
    return tuple(_FAMILIES)


def _load_builtin() -> None:
    global _plugins_loaded
    if not any(f.name == "qwen35" for f in _FAMILIES):
        from headstart.models.qwen35 import FAMILY

        _FAMILIES.insert(0, FAMILY)
    if not any(f.name == "nemotron_h" for f in _FAMILIES):
        from headstart.models.nemotron_h import FAMILY as NEMOTRON_H

        _FAMILIES.insert(1, NEMOTRON_H)
    if not _plugins_loaded:
        _plugins_loaded = True
        for spec in filter(None, os.environ.get("HEADSTART_MODEL_FAMILIES", "").split(",")):
            module, _, attr = spec.strip().partition(":")
            loaded = importlib.import_module(module)
            if attr:
                register(getattr(loaded, attr))


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: not found (a checkpoint folder has a config.json)"
        ) from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return data


def family_for(model_dir: str | Path) -> ModelFamily:
    """The family of the checkpoint in ``model_dir`` (see the module docstring)."""
    config = _read_config(Path(model_dir))
    known = families()
    for family in known:
        if family.claims(config):
            return family
    return known[0]
