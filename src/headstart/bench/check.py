"""``headstart bench check RECEIPT``: trust nothing in a receipt that can be recomputed.

Checks, in order, each failure named precisely:

1. the manifest lists every required file; each file's sha256 and the row counts match;
2. ``requests.csv`` and ``requests.json`` hold the same rows, value for value;
3. every row the run's design calls for (arm x order x prompt x burst x stream) is there
   exactly once, in the right order slot, with the request body the config implies;
4. each row's derived fields (TTFT, decode rate, e2e) follow from its timestamps, the
   timestamps are in order, and no request failed;
5. ``summary.json`` and ``table.txt`` equal a fresh summary of the rows;
6. outputs agree across arms where the config says they must (see ``agreement.py``).

A scenario receipt (config ``"kind": "scenario"``) gets the same kind of checks from
``scenario_check.py``.

Non-goals: judging whether the numbers are *good*; re-running anything.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headstart.bench import rows as R
from headstart.bench.arms import arm_orders
from headstart.bench.env import client_hash, sha256_file
from headstart.bench.receipt import MANIFEST, REQUIRED, load_json, run_title
from headstart.bench.summary import format_table, summarize
from headstart.bench.workload import Prompt, Sampling, request_body, request_sha, salt_for, schedule
from headstart.errors import HeadstartError

_SHOW = 10  # problems of one kind listed before "... and N more"


class ReceiptError(HeadstartError):
    """A receipt failed ``bench check``; the message lists every problem."""


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


def _describe(row: R.Row) -> str:
    return (
        f"arm {row['arm']!r} order {row['order']} prompt {row['prompt_id']!r} "
        f"{row['phase']}@{row['streams']} rep {row['rep']} stream {row['stream']}"
    )


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


def _load_rows(folder: Path, manifest: dict[str, Any], report: CheckReport) -> list[R.Row] | None:
    loaded: dict[str, list[R.Row]] = {}
    for name, parse in (("requests.json", R.from_json), ("requests.csv", R.from_csv)):
        try:
            loaded[name] = parse((folder / name).read_text())
        except (OSError, ValueError, KeyError, TypeError) as e:
            report.problems.append(f"{name}: cannot be read as bench rows: {e}")
            continue
        want = manifest.get("rows", {}).get(name)
        if want != len(loaded[name]):
            report.problems.append(f"{name}: {len(loaded[name])} rows, {MANIFEST} says {want}")
    if len(loaded) < 2:
        return loaded.get("requests.json") or loaded.get("requests.csv")
    js, cs = loaded["requests.json"], loaded["requests.csv"]
    if len(js) != len(cs):
        report.problems.append(f"requests.csv has {len(cs)} rows, requests.json {len(js)}")
    diffs = [
        f"row {i} ({_describe(a)}): field {f!r}: JSON {a[f]!r}, CSV {b[f]!r}"
        for i, (a, b) in enumerate(zip(js, cs, strict=False))
        for f in R.FIELDS
        if a[f] != b[f]
    ]
    report.problems += capped("CSV and JSON rows differ", diffs)
    return js


def _design(rows: list[R.Row], config: dict[str, Any], report: CheckReport) -> None:
    """Every designed row present once, in its slot, with the request body it should have."""
    names = [a["name"] for a in config["arms"]]
    orders = arm_orders(names, int(config["orders"]))
    sampling = Sampling(**config["sampling"])
    prompts = [
        Prompt(
            p["id"],
            messages=tuple(p["messages"]) if "messages" in p else None,
            prompt=p.get("prompt"),
            source=p["source"],
        )
        for p in config["prompts"]
    ]
    plan = schedule(config["streams"], int(config["bursts"]))
    expected: dict[tuple, tuple[int, str]] = {}
    for k, order in enumerate(orders):
        for slot, arm in enumerate(order):
            for p in prompts:
                salt = salt_for(config["run_id"], k, p.id) if config["salted"] else None
                sha = request_sha(request_body(p, sampling, salt))
                for phase, streams, rep in plan:
                    for s in range(streams):
                        expected[(arm, k, p.id, phase, streams, rep, s)] = (slot, sha)
    seen = Counter(R.key_of(r) for r in rows)
    missing = [
        f"arm {k[0]!r} order {k[1]} prompt {k[2]!r} {k[3]}@{k[4]} rep {k[5]} stream {k[6]}"
        for k in expected
        if k not in seen
    ]
    report.problems += capped("missing row", missing)
    report.problems += capped(
        "unexpected row", [_describe(r) for r in rows if R.key_of(r) not in expected]
    )
    report.problems += capped(
        "duplicate row", [f"{k} appears {n} times" for k, n in seen.items() if n > 1]
    )
    wrong = []
    for r in rows:
        slot, sha = expected.get(R.key_of(r), (r["slot"], r["request_sha"]))
        if (r["slot"], r["request_sha"]) != (slot, sha):
            wrong.append(
                f"{_describe(r)}: slot {r['slot']} request {r['request_sha']}, "
                f"the config implies slot {slot} request {sha}"
            )
    report.problems += capped("row does not match the design", wrong)


def _row_values(rows: list[R.Row], report: CheckReport) -> None:
    derived, order, failed = [], [], []
    for r in rows:
        for f, v in R.derive(r).items():
            if not (v is None and r[f] is None) and (
                v is None or r[f] is None or not same(r[f], v)
            ):
                derived.append(f"{_describe(r)}: {f} is {r[f]!r}, its timestamps give {v!r}")
        times = [r[k] for k in ("t_send", "t_first", "t_last", "t_done") if r[k] is not None]
        if times != sorted(times):
            order.append(f"{_describe(r)}: timestamps out of order {times}")
        if r["error"] or r["status"] != 200:
            failed.append(f"{_describe(r)}: status {r['status']}: {r['error']}")
    report.problems += capped("derived field does not match", derived)
    report.problems += capped("timestamps", order)
    report.problems += capped("request failed", failed)


def check_receipt(folder: str | Path) -> CheckReport:
    """Run every check (see the module docstring); never raises for a bad receipt."""
    folder = Path(folder)
    report = CheckReport(folder)
    if not folder.is_dir():
        report.problems.append(f"{folder} is not a folder")
        return report
    if _kind(folder) == "scenario":
        from headstart.bench.scenario_check import check_scenario_receipt

        return check_scenario_receipt(folder, report)
    manifest = files_check(folder, report)
    if manifest is None:
        return report
    try:
        config = load_json(folder / "config.json")
        stored = load_json(folder / "summary.json")
        table = (folder / "table.txt").read_text()
    except (OSError, json.JSONDecodeError) as e:
        report.problems.append(f"cannot read the receipt: {e}")
        return report
    rows = _load_rows(folder, manifest, report)
    if rows is None:
        return report
    report.rows = len(rows)
    try:
        _design(rows, config, report)
        _row_values(rows, report)
        fresh = summarize(rows, config)
    except (KeyError, TypeError, ValueError) as e:
        # A hand-edited config or a row naming an unknown arm/phase: say so, don't crash.
        report.problems.append(
            f"config.json and the rows do not fit together ({type(e).__name__}: {e})"
        )
        return report
    diffs: list[str] = []
    diff(stored, fresh, "summary", diffs)
    report.problems += capped("summary.json does not match the rows", diffs)
    if table != format_table(fresh, run_title(config)):
        report.problems.append("table.txt does not match the summary recomputed from the rows")
    mismatches = fresh["agreement"]["mismatches"]
    report.problems += capped(f"outputs disagree (--agree {config['agree']})", mismatches)
    if mismatches and config["agree"] == "all" and not any("@1:" in m for m in mismatches):
        report.notes.append(
            "only concurrent requests disagree: if the server's batched "
            "kernels are not batch-invariant, run with --agree single"
        )
    client_note(folder, report)
    return report


def _kind(folder: Path) -> str:
    """The receipt's kind from its config ("prompts" when unreadable: check 1 says why)."""
    try:
        return str(load_json(folder / "config.json").get("kind", "prompts"))
    except (OSError, json.JSONDecodeError, AttributeError):
        return "prompts"


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


def verify(folder: str | Path) -> CheckReport:
    """:func:`check_receipt`, raising :class:`ReceiptError` listing the problems if any."""
    report = check_receipt(folder)
    if not report.ok:
        raise ReceiptError(report.text())
    return report
