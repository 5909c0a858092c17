"""What every kind of ``headstart bench`` receipt is checked with: the report, the manifest and
file-hash check, stored-vs-recomputed comparison, and the note about the client's sources.

``check.py`` (prompt-workload receipts) and ``scenario_check.py`` (prefill scenarios) both build
on these; neither imports the other's checks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headstart.bench.env import client_hash, sha256_file
from headstart.bench.receipt import MANIFEST, REQUIRED, load_json

_SHOW = 10  # problems of one kind listed before "... and N more"


@dataclass
class CheckReport:
    folder: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rows: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        head = (
            f"bench check {self.folder}: OK ({self.rows} rows)"
            if self.ok
            else f"bench check {self.folder}: FAILED, {len(self.problems)} problem(s):"
        )
        lines = [head, *(f"  - {p}" for p in self.problems), *(f"  note: {n}" for n in self.notes)]
        return "\n".join(lines)


def capped(kind: str, items: list[str]) -> list[str]:
    extra = [f"{kind}: ... and {len(items) - _SHOW} more"] if len(items) > _SHOW else []
    return [f"{kind}: {i}" for i in items[:_SHOW]] + extra


def same(a: Any, b: Any) -> bool:
    if (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    """Paths where stored ``a`` and recomputed ``b`` differ (numbers within 1e-9)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: {'missing' if k not in a else 'unexpected'}")
            else:
                diff(a[k], b[k], f"{path}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} entries stored, {len(b)} recomputed")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            diff(x, y, f"{path}[{i}]", out)
    elif not same(a, b):
        out.append(f"{path}: stored {a!r}, recomputed {b!r}")


def files_check(
    folder: Path, report: CheckReport, required: tuple[str, ...] = REQUIRED
) -> dict[str, Any] | None:
    """Check 1 (the manifest, the files it lists and their hashes); the manifest, or None
    if there is none."""
    path = folder / MANIFEST
    if not path.is_file():
        report.problems.append(f"{MANIFEST} is missing: not a bench receipt, or it was removed")
        return None
    manifest = load_json(path)
    listed = manifest.get("files", {})
    for name in required:
        if name not in listed:
            report.problems.append(f"{MANIFEST} does not list {name}")
    for name, meta in listed.items():
        p = folder / name
        if not p.is_file():
            report.problems.append(f"{name}: listed in {MANIFEST} but missing")
        elif sha256_file(p) != meta["sha256"]:
            report.problems.append(
                f"{name}: sha256 differs from {MANIFEST} (the file was changed after the run)"
            )
    present = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    for name in sorted(present - set(listed) - {MANIFEST}):
        report.notes.append(f"{name} is not in the manifest (added after the run?)")
    return manifest


def client_note(folder: Path, report: CheckReport) -> None:
    """Note when the bench client's sources differ from the ones that wrote the receipt."""
    try:
        recorded = load_json(folder / "env.json")["client"]["sha256"]
        if recorded != client_hash()["sha256"]:
            report.notes.append(
                "the bench client changed since this receipt was written "
                "(summaries were recomputed with the current code)"
            )
    except (OSError, KeyError, json.JSONDecodeError):
        report.notes.append("env.json has no client hash")
