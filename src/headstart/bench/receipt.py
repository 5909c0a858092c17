"""The receipt: a folder that holds everything a bench run measured and how.

Layout (every file but the manifest is listed in the manifest with its sha256)::

    manifest.json   schema, row counts, sha256 and size of every other file
    config.json     the run: arms, orders, workload (prompt texts), sampling, launches
    env.json        machine, GPU/driver/CUDA, packages, git commit, model and client hashes
    requests.csv    raw per-request rows (rows.SCHEMA), floats written exactly
    requests.json   the same rows as JSON
    outputs.json    fingerprint -> output text (and token strings), to explain disagreements
    summary.json    summaries recomputed from requests.json (``bench check`` redoes this)
    table.txt       the printed table
    ttft.png        TTFT per arm and stream count (absent without matplotlib)
    logs/ARM-oK.log each command arm's server output, per order

A scenario run (``--scenario``; config.json has ``"kind": "scenario"``, and
``"perf_counter_t0"``: the client's ``time.perf_counter`` at the rows' time 0, which a server on
the same Linux host reads on the same clock) writes the manifest, config.json, env.json and logs
as above, and::

    requests.json   every request's record (scenario_summary.record_schema), the arrival
                    time of each of its deltas included (and in agent the ids it generated)
    summary.json    summaries recomputed from requests.json (``bench check`` redoes this)
    table.txt       the printed table

Job: write that folder, and read its pieces back for ``check``. Non-goals: judging it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from headstart.bench import rows as R
from headstart.bench.env import sha256_file
from headstart.bench.plot import plot_ttft
from headstart.bench.scenario_summary import (
    Record,
    format_scenario_table,
    record_schema,
    scenario_title,
    summarize_scenario,
)
from headstart.bench.summary import format_table, summarize

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
REQUIRED = (
    "config.json",
    "env.json",
    "requests.csv",
    "requests.json",
    "outputs.json",
    "summary.json",
    "table.txt",
)
#: The files a scenario receipt must list.
SCENARIO_REQUIRED = ("config.json", "env.json", "requests.json", "summary.json", "table.txt")


def run_title(config: dict[str, Any]) -> str:
    """The line above the table, from the config alone (so check can rebuild the table)."""
    s = config["sampling"]
    arms = ", ".join(a["name"] for a in config["arms"])
    return (
        f"headstart bench {config['run_id']}: arms {arms}; {config['orders']} orders; "
        f"{len(config['prompts'])} prompts; streams {'/'.join(map(str, config['streams']))}"
        f" x {config['bursts']} bursts; {s['max_tokens']} tokens; "
        f"temperature {s['temperature']}; seed {s['seed']}; thinking {s['thinking']}"
    )


def dump(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False, sort_keys=False) + "\n")


def write_receipt(
    folder: Path,
    config: dict[str, Any],
    env: dict[str, Any],
    rows: list[R.Row],
    outputs: dict[str, Any],
    plot: bool = True,
) -> dict:
    """Write the receipt (see the module docstring); returns the summary."""
    folder.mkdir(parents=True, exist_ok=True)
    dump(folder / "config.json", config)
    dump(folder / "env.json", env)
    (folder / "requests.csv").write_text(R.to_csv(rows))
    (folder / "requests.json").write_text(R.to_json(rows))
    dump(folder / "outputs.json", outputs)
    # Summarise what was written, not what is in memory: exactly what check will recompute.
    stored = R.from_json((folder / "requests.json").read_text())
    summary = summarize(stored, config)
    dump(folder / "summary.json", summary)
    (folder / "table.txt").write_text(format_table(summary, run_title(config)))
    if plot:
        plot_ttft(stored, summary["arms"], folder / "ttft.png")
    write_manifest(folder, {"requests.csv": len(rows), "requests.json": len(rows)})
    return summary


def write_scenario_receipt(
    folder: Path, config: dict[str, Any], env: dict[str, Any], records: list[Record]
) -> dict[str, Any]:
    """Write a scenario receipt (see the module docstring); returns the summary."""
    folder.mkdir(parents=True, exist_ok=True)
    dump(folder / "config.json", config)
    dump(folder / "env.json", env)
    scenario = config["scenario"]["name"]
    dump(folder / "requests.json", {"fields": list(record_schema(scenario)), "requests": records})
    # Summarise what was written, not what is in memory: exactly what check will recompute.
    stored = load_records((folder / "requests.json").read_text(), scenario)
    summary = summarize_scenario(stored, config)
    dump(folder / "summary.json", summary)
    (folder / "table.txt").write_text(format_scenario_table(summary, scenario_title(config)))
    write_manifest(folder, {"requests.json": len(records)})
    return summary


def write_manifest(folder: Path, rows: dict[str, int]) -> None:
    """The manifest of everything in ``folder``; ``rows``: row count of each row file."""
    files = {
        str(p.relative_to(folder)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    dump(
        folder / MANIFEST,
        {
            "schema": SCHEMA_VERSION,
            "tool": "headstart bench",
            "rows": rows,
            "files": files,
        },
    )


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def load_records(text: str, scenario: str) -> list[Record]:
    """The records of a receipt's ``requests.json`` of ``scenario``. Raises ValueError naming
    the first record whose fields or types differ from ``record_schema(scenario)``."""
    schema = record_schema(scenario)
    doc = json.loads(text)
    if doc.get("fields") != list(schema):
        raise ValueError(f"'fields' differ from the record schema of scenario {scenario}")
    for i, rec in enumerate(doc["requests"]):
        if set(rec) != set(schema):
            raise ValueError(f"record {i}: fields {sorted(set(rec) ^ set(schema))} differ")
        for f, kind in schema.items():
            if not _typed(rec[f], kind, f in ("arm", "order", "slot", "rep", "role", "stream")):
                raise ValueError(f"record {i}: field {f!r} has {rec[f]!r}")
    return doc["requests"]


def _typed(v: Any, kind: Any, required: bool) -> bool:
    if kind is list:
        return isinstance(v, list) and all(_typed(t, float, True) for t in v)
    if kind == list[int]:  # token ids; None where the request failed
        return v is None or (isinstance(v, list) and all(_typed(t, int, True) for t in v))
    if kind is str:
        return isinstance(v, str)
    if v is None:
        return not required
    number = (int,) if kind is int else (int, float)
    return isinstance(v, number) and not isinstance(v, bool)
