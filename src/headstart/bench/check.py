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
from collections import Counter
from pathlib import Path
from typing import Any

from headstart.bench import rows as R
from headstart.bench.arms import arm_orders
from headstart.bench.checks import CheckReport, capped, client_note, diff, files_check, same
from headstart.bench.receipt import MANIFEST, load_json, run_title
from headstart.bench.summary import format_table, summarize
from headstart.bench.workload import Prompt, Sampling, request_body, request_sha, salt_for, schedule
from headstart.errors import HeadstartError


class ReceiptError(HeadstartError):
    """A receipt failed ``bench check``; the message lists every problem."""


def _describe(row: R.Row) -> str:
    return (
        f"arm {row['arm']!r} order {row['order']} prompt {row['prompt_id']!r} "
        f"{row['phase']}@{row['streams']} rep {row['rep']} stream {row['stream']}"
    )


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
        times = [r[k] for k in R.STAMPS if r[k] is not None]
        if times != sorted(times):
            order.append(f"{_describe(r)}: timestamps out of order {times}")
        if r["error"] or r["status"] != 200:
            failed.append(f"{_describe(r)}: status {r['status']}: {r['error']}")
    report.problems += capped("derived field does not match", derived)
    report.problems += capped("timestamps", order)
    report.problems += capped("request failed", failed)


def check_receipt(folder: str | Path, agree: str | None = None) -> CheckReport:
    """Run every check (see the module docstring); never raises for a bad receipt. ``agree``:
    judge the outputs' agreement as ``bench --agree`` would have (all, single or none) instead
    of as the run recorded; the recorded summary is still checked as recorded."""
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
    mode = agree or config["agree"]
    judged = fresh if mode == config["agree"] else summarize(rows, {**config, "agree": mode})
    mismatches = judged["agreement"]["mismatches"]
    report.problems += capped(f"outputs disagree (--agree {mode})", mismatches)
    if mismatches and mode == "all" and not any("@1:" in m for m in mismatches):
        report.notes.append(
            "only concurrent requests disagree: if the server's batched kernels are not "
            "batch-invariant, check with --agree single (or run with it)"
        )
    client_note(folder, report)
    return report


def _kind(folder: Path) -> str:
    """The receipt's kind from its config ("prompts" when unreadable: check 1 says why)."""
    try:
        return str(load_json(folder / "config.json").get("kind", "prompts"))
    except (OSError, json.JSONDecodeError, AttributeError):
        return "prompts"


def verify(folder: str | Path) -> CheckReport:
    """:func:`check_receipt`, raising :class:`ReceiptError` listing the problems if any."""
    report = check_receipt(folder)
    if not report.ok:
        raise ReceiptError(report.text())
    return report
