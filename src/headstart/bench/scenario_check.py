"""``headstart bench check`` for a scenario receipt: trust nothing that can be recomputed.

Checks, in order, each failure named precisely:

1. the manifest lists every required file; each file's sha256 and the record count match;
2. ``requests.json`` holds records of the schema (``scenario_summary.record_schema``);
3. every request the scenario calls for (arm x order x repeat x request) is there exactly
   once, in the right order slot, with the body (token ids, sizes, sampling) the config
   implies; in ``agent``, each turn's prompt is rebuilt from the previous turn's prompt and
   the answer ids its record holds, so an edited answer fails the next turn;
4. each record's derived fields follow from its timestamps, its timestamps and delta times
   are in order and agree with each other, no request failed, and an ``agent`` record holds
   as many answer ids as the server counted tokens;
5. the steps went out in order: every request of a step was sent after the previous step
   ended, and in ``beside`` the long prompt after each decoder was decoding;
6. ``summary.json`` and ``table.txt`` equal a fresh summary of the records.

Notes, not failures: a server that counted other prompt lengths than were sent, ``beside``
repeats whose decoders ended before the long prompt's first token, ``agent`` runs where
the server reported no cached tokens, or some on a first turn or cold reference (whose salt
should make them new to it), and ``return`` runs where a salted prompt found cached tokens,
a return found less than its whole history cached, or the server exposed no transfer
counters (no bandwidth figures).

Non-goals: judging whether the numbers are good; re-running anything.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from headstart.bench import rows as R
from headstart.bench.arms import arm_orders
from headstart.bench.checks import CheckReport, capped, client_note, diff, files_check, same
from headstart.bench.receipt import SCENARIO_REQUIRED, load_json, load_records
from headstart.bench.scenario_summary import (
    RECORD_KEY,
    Record,
    format_scenario_table,
    scenario_title,
    summarize_scenario,
)
from headstart.bench.scenarios import (
    DECODING_DELTAS,
    Request,
    Scenario,
    agent_steps,
    all_steps,
    salt_base,
    token_body,
)
from headstart.bench.workload import Sampling, request_sha


def _describe(r: Record) -> str:
    return f"arm {r['arm']!r} order {r['order']} rep {r['rep']} {r['role']} {r['stream']}"


def _steps(
    config: dict[str, Any], records: list[Record]
) -> dict[tuple[str, int], tuple[int, list[list[Request]]]]:
    """(arm, order) -> (slot, the steps it was sent), rebuilt from the config (and in
    ``agent`` from the answer ids of the records, as the run built them)."""
    sc = Scenario(**config["scenario"])
    sampling = Sampling(**config["sampling"])
    orders = arm_orders([a["name"] for a in config["arms"]], int(config["orders"]))
    by_key = {R.key_of(r, RECORD_KEY): r for r in records}

    def steps(arm: str, k: int) -> list[list[Request]]:
        base = salt_base(config["run_id"], arm, k, sc.name)
        if sc.name != "agent":
            return all_steps(sc, sampling.max_tokens, base)

        def answer_of(q: Request) -> tuple[int, ...] | None:
            # The run went on past a turn only if it succeeded and returned its ids.
            r = by_key.get((arm, k, q.rep, q.role, q.stream))
            if r is None or r["error"] or r["status"] != 200 or r["output_ids"] is None:
                return None
            return tuple(r["output_ids"])

        return agent_steps(sc, sampling.max_tokens, base, answer_of)

    return {
        (arm, k): (slot, steps(arm, k))
        for k, order in enumerate(orders)
        for slot, arm in enumerate(order)
    }


def _design(records: list[Record], config: dict[str, Any], report: CheckReport) -> None:
    """Every designed request present once, in its slot, with the body it should have."""
    sampling = Sampling(**config["sampling"])
    expected: dict[tuple, tuple] = {}
    for (arm, k), (slot, steps) in _steps(config, records).items():
        for step in steps:
            for q in step:
                sha = request_sha(token_body(q, sampling))
                key = (arm, k, q.rep, q.role, q.stream)
                expected[key] = (slot, config["scenario"]["name"], len(q.ids), q.max_tokens, sha)
    seen = Counter(R.key_of(r, RECORD_KEY) for r in records)
    report.problems += capped(
        "missing request",
        [f"arm {k[0]!r} order {k[1]} rep {k[2]} {k[3]} {k[4]}" for k in expected if k not in seen],
    )
    report.problems += capped(
        "unexpected request",
        [_describe(r) for r in records if R.key_of(r, RECORD_KEY) not in expected],
    )
    report.problems += capped(
        "duplicate request", [f"{k} appears {n} times" for k, n in seen.items() if n > 1]
    )
    fields = ("slot", "scenario", "prompt_len", "max_tokens", "request_sha")
    wrong = []
    for r in records:
        want = expected.get(R.key_of(r, RECORD_KEY))
        got = tuple(r[f] for f in fields)
        if want is not None and got != want:
            wrong.append(
                f"{_describe(r)}: {dict(zip(fields, got, strict=True))}, the config "
                f"implies {dict(zip(fields, want, strict=True))}"
            )
    report.problems += capped("request does not match the design", wrong)


def _values(records: list[Record], report: CheckReport) -> None:
    derived, order, failed, lengths, answers = [], [], [], [], []
    for r in records:
        for f, v in R.derive(r).items():
            if not (v is None and r[f] is None) and (
                v is None or r[f] is None or not same(r[f], v)
            ):
                derived.append(f"{_describe(r)}: {f} is {r[f]!r}, its timestamps give {v!r}")
        stamps = [r[k] for k in R.STAMPS if r[k] is not None]
        times = r["times"]
        if stamps != sorted(stamps) or times != sorted(times):
            order.append(f"{_describe(r)}: timestamps out of order")
        elif len(times) != r["n_deltas"] or (
            times and (times[0] != r["t_first"] or times[-1] != r["t_last"])
        ):
            order.append(
                f"{_describe(r)}: {len(times)} delta times for {r['n_deltas']} deltas, or "
                "the first and last differ from t_first and t_last"
            )
        if r["error"] or r["status"] != 200:
            failed.append(f"{_describe(r)}: status {r['status']}: {r['error']}")
        if r["prompt_tokens"] is not None and r["prompt_tokens"] != r["prompt_len"]:
            lengths.append(f"{_describe(r)}: {r['prompt_tokens']} for {r['prompt_len']} ids")
        ids = r.get("output_ids")  # agent only
        n = r["completion_tokens"]
        if ids is not None and n is not None and len(ids) != n:
            answers.append(f"{_describe(r)}: {len(ids)} for {r['completion_tokens']} tokens")
    report.problems += capped("derived field does not match", derived)
    report.problems += capped("timestamps", order)
    report.problems += capped("request failed", failed)
    report.problems += capped("answer ids do not match the tokens counted", answers)
    if lengths:
        report.notes += capped("the server counted other prompt lengths than were sent", lengths)


def _sequence(records: list[Record], config: dict[str, Any], report: CheckReport) -> None:
    """Steps in order, and beside's long prompt sent only once its decoders decoded."""
    by_key = {R.key_of(r, RECORD_KEY): r for r in records}
    late = []
    for (arm, k), (_, steps) in _steps(config, records).items():
        ended = None  # when the previous step's last request ended
        for step in steps:
            keys = [(arm, k, q.rep, q.role, q.stream) for q in step]
            if any(key not in by_key for key in keys):
                ended = None  # missing requests are reported by _design
                continue
            recs = [by_key[key] for key in keys]
            first_send = min(r["t_send"] for r in recs)
            if ended is not None and first_send < ended:
                late.append(f"{_describe(recs[0])}: sent before the previous step ended")
            if config["scenario"]["name"] == "beside":
                *decoders, long = recs
                for d in decoders:
                    ready = (
                        d["times"][DECODING_DELTAS - 1]
                        if len(d["times"]) >= DECODING_DELTAS
                        else d["t_done"]
                    )
                    if ready is not None and long["t_send"] < ready:
                        late.append(f"{_describe(long)}: sent before {_describe(d)} was decoding")
            done = [r["t_done"] for r in recs]
            ended = max(done) if all(d is not None for d in done) else None
    report.problems += capped("steps out of order", late)


def _beside_notes(summary: dict[str, Any], config: dict[str, Any], report: CheckReport) -> None:
    streams = config["scenario"]["streams"]
    short = [
        f"arm {r['arm']!r} order {r['order']} rep {r['rep']}: {r['metrics']['decoders_through']}"
        f" of {streams}"
        for r in summary["repeats"]
        if r["label"] == "beside" and (r["metrics"]["decoders_through"] or 0) < streams
    ]
    if short:
        report.notes += capped(
            "decoders ended before the long prompt's first token (raise --decode-tokens)", short
        )


def _agent_notes(records: list[Record], report: CheckReport) -> None:
    fresh = [r for r in records if r["role"] == "cold" or r["stream"] == 0]
    hits = [f"{_describe(r)}: {r['cached_tokens']} cached" for r in fresh if r["cached_tokens"]]
    if hits:
        report.notes += capped("salted prompts found cached tokens (a salt matched?)", hits)
    if any(r["cached_tokens"] is None for r in records if r["status"] == 200):
        report.notes.append(
            "the server reported no cached tokens (usage.prompt_tokens_details.cached_tokens)"
            " for some requests: their reuse shortfall is unknown"
        )


def _return_notes(records: list[Record], config: dict[str, Any], report: CheckReport) -> None:
    history = config["scenario"]["history_tokens"]
    fresh = [r for r in records if r["role"] != "return"]
    hits = [f"{_describe(r)}: {r['cached_tokens']} cached" for r in fresh if r["cached_tokens"]]
    if hits:
        report.notes += capped("salted prompts found cached tokens (a salt matched?)", hits)
    returns = [r for r in records if r["role"] == "return" and r["status"] == 200]
    short = [
        f"{_describe(r)}: {r['cached_tokens']} of {history}"
        for r in returns
        if r["cached_tokens"] is not None and r["cached_tokens"] < history
    ]
    if short:
        report.notes += capped(
            "returns found less than their history cached (the server dropped it)", short
        )
    if any(r["host_restored_bytes"] is None for r in returns):
        report.notes.append(
            "the server exposed no prompt-cache transfer counters on /metrics for some "
            "returns: no host restore or demote bandwidth for them"
        )


def check_scenario_receipt(folder: Path, report: CheckReport) -> CheckReport:
    """Run every check on the scenario receipt in ``folder`` (see the module docstring),
    adding to ``report``; never raises for a bad receipt."""
    manifest = files_check(folder, report, SCENARIO_REQUIRED)
    if manifest is None:
        return report
    try:
        config = load_json(folder / "config.json")
        stored = load_json(folder / "summary.json")
        table = (folder / "table.txt").read_text()
        records = load_records((folder / "requests.json").read_text(), config["scenario"]["name"])
    except (OSError, json.JSONDecodeError) as e:
        report.problems.append(f"cannot read the receipt: {e}")
        return report
    except (ValueError, KeyError, TypeError) as e:
        report.problems.append(f"requests.json: cannot be read as scenario records: {e}")
        return report
    report.rows = len(records)
    want = manifest.get("rows", {}).get("requests.json")
    if want != len(records):
        report.problems.append(f"requests.json: {len(records)} records, manifest.json says {want}")
    try:
        _design(records, config, report)
        _values(records, report)
        _sequence(records, config, report)
        fresh = summarize_scenario(records, config)
    except (KeyError, TypeError, ValueError) as e:
        # A hand-edited config or a record naming an unknown arm: say so, don't crash.
        report.problems.append(
            f"config.json and the records do not fit together ({type(e).__name__}: {e})"
        )
        return report
    diffs: list[str] = []
    diff(stored, fresh, "summary", diffs)
    report.problems += capped("summary.json does not match the records", diffs)
    if table != format_scenario_table(fresh, scenario_title(config)):
        report.problems.append("table.txt does not match the summary recomputed from the records")
    if config["scenario"]["name"] == "beside":
        _beside_notes(fresh, config, report)
    if config["scenario"]["name"] == "agent":
        _agent_notes(records, report)
    if config["scenario"]["name"] == "return":
        _return_notes(records, config, report)
    client_note(folder, report)
    return report
