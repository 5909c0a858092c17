"""Summaries of a scenario run, computed only from its raw request records and config.

Job: the record schema of a scenario receipt (:func:`record_schema`); per repeat, the
scenario's measurements (:func:`repeat_metrics`: TTFTs, cached tokens, for ``beside`` the
decoders' inter-token gaps, for ``agent`` the reuse shortfall, for ``return`` the return's
TTFT over the cold one's and the server's host-tier bandwidths); per (row, arm), the median,
maximum and each repeat's value; for ``agent`` the same per turn; ratios to the baseline arm
balanced over orders; and the text table. Deterministic: ``bench check`` recomputes
:func:`summarize_scenario` from the stored records.

An inter-token gap is the time between two consecutive deltas (each carrying a token) of one
stream as the client received them (a delta that carries several tokens counts once); a
stream's TTFT is not a gap.

An ``agent`` turn after the first can find cached at most the previous turn's prompt and all
but the last of its answer's tokens (the last one was sampled, never fed through the model).
Its *reuse shortfall* is what it found cached minus that; the repeat's is the minimum over
its turns (:func:`reuse_shortfall`): 0 or more means every turn restored all of it.

A ``return`` record carries the differences of the server's prompt-cache transfer counters
across its request (:data:`RETURN_FIELDS`). The repeat's *host restore* bandwidth is the
return's restored bytes over its restore seconds (the restore of the returning conversation
from host memory, when it was one); its *demote* bandwidth is the repeat's demoted bytes over
its demote seconds (device to host copies as the others pushed snapshots out). A server that
exposes no such counters has None there, and the table leaves those rows out.

Non-goals: reading or writing files; deciding pass/fail (``scenario_check.py``).
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from headstart.bench.summary import balanced_ratio

Record = dict[str, Any]

#: Field -> type of one request record of a scenario receipt (``requests.json``). Times are
#: seconds since the run's start on the client's ``time.perf_counter()`` clock; None: did not
#: happen. ``t_send`` ... ``error`` mean what they mean in ``rows.SCHEMA``.
RECORD_SCHEMA: dict[str, type] = {
    "arm": str,
    "order": int,
    "slot": int,
    "scenario": str,
    "rep": int,  # repeat; in ``burst`` rep 0 is the first burst
    "role": str,  # long | burst | history | turn | cold | decoder | agent | other | return
    "stream": int,  # index of the request within its step; agent: the turn, 0-based
    "prompt_len": int,  # token ids sent as the prompt
    "max_tokens": int,
    "request_sha": str,  # sha256 of the body without "model" (``workload.request_sha``)
    "t_send": float,
    "t_head": float,
    "t_first": float,
    "t_last": float,
    "t_done": float,
    "ttft_s": float,
    "decode_tok_s": float,
    "e2e_s": float,
    "prompt_tokens": int,
    "completion_tokens": int,
    "cached_tokens": int,
    "n_deltas": int,
    "finish_reason": str,
    "fingerprint": str,
    "status": int,
    "error": str,
    # arrival time of every delta that carries a token: times[0] = t_first, [-1] = t_last
    "times": list,
}
#: The fields an ``agent`` record has after :data:`RECORD_SCHEMA`: the token ids the server
#: generated (which the next turn's prompt appends); None: it returned none (failed).
AGENT_FIELDS: dict[str, Any] = {"output_ids": list[int]}
#: The fields a ``return`` record has after :data:`RECORD_SCHEMA`: how much the server's
#: counters (headstart's ``/metrics``: ``headstart_prompt_cache_host_restored_bytes_total``,
#: ``..._host_restore_seconds_total``, ``..._demoted_bytes_total``,
#: ``..._demote_seconds_total``) grew from just before the request was sent to right after it
#: ended: bytes copied from the host tier to the device and the seconds those restores took,
#: the same for device-to-host demotions. None: the server exposes none, or a scrape failed.
RETURN_FIELDS: dict[str, Any] = {
    "host_restored_bytes": int,
    "host_restore_s": float,
    "demoted_bytes": int,
    "demote_s": float,
}
#: The fields that name a record; a receipt holds each key exactly once.
RECORD_KEY = ("arm", "order", "rep", "role", "stream")

#: Rows of each scenario's table, in table order.
LABELS: dict[str, tuple[str, ...]] = {
    "long": ("long",),
    "burst": ("first", "later"),
    "turn": ("turn", "cold"),
    "beside": ("beside",),
    "agent": ("turns", "first", "cold"),  # turns: turns 2..N; first: turn 1
    "return": ("return", "cold"),
}
#: Metric -> (table name, unit, scale, digits). Metrics ending in ``_s`` are times.
METRICS: dict[str, tuple[str, str, float, int]] = {
    "ttft_s": ("ttft", "ms", 1e3, 1),
    "ttft_max_s": ("ttft max", "ms", 1e3, 1),
    "ttft_median_s": ("ttft median", "ms", 1e3, 1),
    "cached_tokens": ("cached", "tokens", 1, 0),
    "long_ttft_s": ("long ttft", "ms", 1e3, 1),
    "prefill_gap_max_s": ("gap max in prefill", "ms", 1e3, 1),
    "gap_max_s": ("gap max", "ms", 1e3, 1),
    "gap_median_s": ("gap median", "ms", 1e3, 2),
    "decoders_through": ("decoding through", "streams", 1, 0),
    "reuse_shortfall": ("reuse shortfall", "tokens", 1, 0),
    "prompt_len": ("prompt", "tokens", 1, 0),
    "cached_fraction": ("cached", "%", 100, 1),
    "ttft_vs_cold": ("ttft / cold ttft", "x", 1, 3),
    "host_restored_bytes": ("host restored", "MB", 1e-6, 1),
    "host_restore_bandwidth": ("host restore", "GB/s", 1e-9, 2),
    "demote_bandwidth": ("demote", "GB/s", 1e-9, 2),
}
#: Metrics only a server that exposes its transfer counters has: a table row for one is
#: printed only where some repeat has a value.
SERVER_COUNTERS = ("host_restored_bytes", "host_restore_bandwidth", "demote_bandwidth")


def record_schema(scenario: str) -> dict[str, Any]:
    """Field -> type of the records of ``scenario``: :data:`RECORD_SCHEMA`, and after it
    :data:`AGENT_FIELDS` for ``agent``, :data:`RETURN_FIELDS` for ``return`` (the other
    scenarios' receipts stay as they were)."""
    extra = {"agent": AGENT_FIELDS, "return": RETURN_FIELDS}.get(scenario, {})
    return {**RECORD_SCHEMA, **extra}


def gaps(times: Sequence[float]) -> list[float]:
    """The gaps between consecutive delta arrival times of one stream."""
    return [b - a for a, b in itertools.pairwise(times)]


def gaps_during(times: Sequence[float], start: float, end: float) -> list[float]:
    """The gaps of one stream whose interval overlaps the window ``(start, end)``: a stall
    that spans the contiguous window counts, as do ones that begin before it or end after it."""
    return [b - a for a, b in itertools.pairwise(times) if b > start and a < end]


def _median(values: Sequence[float | None]) -> float | None:
    """Median of the values, or None if one is missing (a failed request has no time; the
    check reports it, the summary does not paper over it)."""
    return None if not values or any(v is None for v in values) else statistics.median(values)


def _max(values: Sequence[float | None]) -> float | None:
    return None if not values or any(v is None for v in values) else max(values)


def _beside(recs: list[Record]) -> dict[str, Any]:
    (long,) = [r for r in recs if r["role"] == "long"]
    decoders = [r for r in recs if r["role"] == "decoder"]
    every = [g for d in decoders for g in gaps(d["times"])]
    first = long["t_first"]
    during = through = None
    if first is not None:
        # The window is the long prompt's prefill as the client sees it: send to first token.
        during = [g for d in decoders for g in gaps_during(d["times"], long["t_send"], first)]
        # A decoder that ended before the long prompt's first token cannot show a stall after
        # its end: the table says how many decoded through the contiguous window.
        through = sum(1 for d in decoders if d["times"] and d["times"][-1] > first)
    return {
        "long_ttft_s": long["ttft_s"],
        "prefill_gap_max_s": max(during) if during else None,
        "gap_max_s": max(every) if every else None,
        "gap_median_s": statistics.median(every) if every else None,
        "decoders_through": through,
    }


def reuse_shortfall(turns: Sequence[tuple[int, int | None, int | None]]) -> int | None:
    """The minimum over turns 2.. of ``cached - (previous prompt + previous answer - 1)``,
    from ``(prompt tokens, answer tokens, cached tokens)`` of consecutive turns in order;
    None with fewer than two turns or where a count is missing (a server that reports no
    cached tokens, a failed turn)."""
    shortfalls = []
    for (prompt, answer, _), (_, _, cached) in itertools.pairwise(turns):
        if answer is None or cached is None:
            return None
        shortfalls.append(cached - (prompt + answer - 1))
    return min(shortfalls) if shortfalls else None


def turn_metrics(r: Record) -> dict[str, Any]:
    """One agent turn's (or the cold reference's) numbers: TTFT, the prompt tokens sent, the
    cached tokens the server reported and their fraction of the prompt (None: not reported)."""
    cached = r["cached_tokens"]
    return {
        "ttft_s": r["ttft_s"],
        "prompt_len": r["prompt_len"],
        "cached_tokens": cached,
        "cached_fraction": None if cached is None else cached / r["prompt_len"],
    }


def _agent(by_role: dict[str, list[Record]]) -> list[tuple[str, dict]]:
    turns = by_role["agent"]  # by turn
    # A repeat the run ended early (a failed turn) lacks turns or the cold reference: its
    # numbers are None, not a crash, so the receipt is still written (and fails the check).
    contiguous = [r["stream"] for r in turns] == list(range(len(turns)))
    later = [r["ttft_s"] for r in turns[1:]] if contiguous else []
    counts = [
        (
            r["prompt_len"],
            None if r["output_ids"] is None else len(r["output_ids"]),
            r["cached_tokens"],
        )
        for r in turns
    ]
    first = turns[0] if contiguous and turns else None
    cold = by_role["cold"][0] if len(by_role["cold"]) == 1 else None
    return [
        (
            "turns",
            {
                "ttft_median_s": _median(later),
                "ttft_max_s": _max(later),
                "reuse_shortfall": reuse_shortfall(counts) if contiguous else None,
            },
        ),
        ("first", {m: None if first is None else first[m] for m in ("ttft_s", "cached_tokens")}),
        ("cold", {m: None if cold is None else cold[m] for m in ("ttft_s", "cached_tokens")}),
    ]


def bandwidth(nbytes: float | None, seconds: float | None) -> float | None:
    """Bytes per second, or None where either is unknown or no time was spent (nothing was
    copied: the return was no host restore)."""
    return None if nbytes is None or not seconds else nbytes / seconds


def _return(by_role: dict[str, list[Record]], recs: list[Record]) -> list[tuple[str, dict]]:
    """``return``'s rows: the return (TTFT, cached tokens, TTFT over the cold one's, the
    host-tier figures of the module docstring) and the cold reference."""
    (back,), (cold,) = by_role["return"], by_role["cold"]
    ratio = None
    if back["ttft_s"] is not None and cold["ttft_s"]:
        ratio = back["ttft_s"] / cold["ttft_s"]
    demoted = [r["demoted_bytes"] for r in recs]
    seconds = [r["demote_s"] for r in recs]
    demote = None
    if None not in demoted and None not in seconds:
        demote = bandwidth(sum(demoted), sum(seconds))
    restored = back["host_restored_bytes"]
    measured = {
        "ttft_s": back["ttft_s"],
        "cached_tokens": back["cached_tokens"],
        "ttft_vs_cold": ratio,
        "host_restored_bytes": restored,
        "host_restore_bandwidth": bandwidth(restored, back["host_restore_s"]),
        "demote_bandwidth": demote,
    }
    return [("return", measured), ("cold", {m: cold[m] for m in ("ttft_s", "cached_tokens")})]


def repeat_metrics(scenario: str, rep: int, recs: list[Record]) -> list[tuple[str, dict]]:
    """The measurements of one repeat of one arm in one order, as (row label, metrics)."""
    by_role: dict[str, list[Record]] = defaultdict(list)
    for r in sorted(recs, key=lambda r: r["stream"]):
        by_role[r["role"]].append(r)

    def one(role: str) -> dict[str, Any]:
        (r,) = by_role[role]
        return {"ttft_s": r["ttft_s"], "cached_tokens": r["cached_tokens"]}

    if scenario == "long":
        return [("long", one("long"))]
    if scenario == "burst":
        ttfts = [r["ttft_s"] for r in by_role["burst"]]
        metrics = {"ttft_max_s": _max(ttfts), "ttft_median_s": _median(ttfts)}
        return [("first" if rep == 0 else "later", metrics)]
    if scenario == "turn":
        return [("turn", one("turn")), ("cold", one("cold"))]
    if scenario == "beside":
        return [("beside", _beside(recs))]
    if scenario == "agent":
        return _agent(by_role)
    if scenario == "return":
        return _return(by_role, recs)
    raise ValueError(f"unknown scenario {scenario!r}")


def _stats(values: list[Any], orders: list[int], n_orders: int) -> dict[str, Any]:
    """``values[i]`` was measured in order ``orders[i]``; None values are left out."""
    present = [v for v in values if v is not None]
    per_order = [
        [v for v, k in zip(values, orders, strict=True) if k == o] for o in range(n_orders)
    ]
    return {
        "n": len(present),
        "median": statistics.median(present) if present else None,
        "max": max(present) if present else None,
        "each": values,
        "order_medians": [_median(vs) for vs in per_order],
    }


def summarize_scenario(records: list[Record], config: dict[str, Any]) -> dict[str, Any]:
    """The summary document of a scenario run (see the module docstring)."""
    arms = [a["name"] for a in config["arms"]]
    n_orders = int(config["orders"])
    scenario = config["scenario"]["name"]
    grouped: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        grouped[(r["arm"], r["order"], r["rep"])].append(r)
    repeats = [
        {"arm": arm, "order": order, "rep": rep, "label": label, "metrics": metrics}
        for (arm, order, rep) in sorted(grouped, key=lambda k: (arms.index(k[0]), k[1], k[2]))
        for label, metrics in repeat_metrics(scenario, rep, grouped[(arm, order, rep)])
    ]
    groups = []
    for label in LABELS[scenario]:
        for arm in arms:
            mine = [r for r in repeats if r["arm"] == arm and r["label"] == label]
            if not mine:
                continue
            orders = [r["order"] for r in mine]
            metrics = {
                m: _stats([r["metrics"][m] for r in mine], orders, n_orders)
                for m in mine[0]["metrics"]
            }
            groups.append({"label": label, "arm": arm, "metrics": metrics})
    base = {g["label"]: g["metrics"] for g in groups if g["arm"] == arms[0]}
    ratios = [
        {
            "label": g["label"],
            "arm": g["arm"],
            "baseline": arms[0],
            "metric": m,
            **balanced_ratio(stats["order_medians"], base[g["label"]][m]["order_medians"]),
        }
        for g in groups
        if g["arm"] != arms[0] and g["label"] in base
        for m, stats in g["metrics"].items()
        if m.endswith("_s")
    ]
    out = {
        "scenario": scenario,
        "arms": arms,
        "baseline": arms[0],
        "orders": n_orders,
        "repeats": repeats,
        "groups": groups,
        "ratios": ratios,
    }
    if scenario == "agent":
        out["turns"] = _per_turn(records, arms, n_orders, int(config["scenario"]["turns"]))
    return out


def _per_turn(
    records: list[Record], arms: list[str], n_orders: int, turns: int
) -> list[dict[str, Any]]:
    """Per arm and turn (1-based), :func:`turn_metrics` over the repeats, in run order."""
    out = []
    for arm in arms:
        mine = sorted(
            (r for r in records if r["arm"] == arm and r["role"] == "agent"),
            key=lambda r: (r["order"], r["rep"]),
        )
        for turn in range(turns):
            at = [r for r in mine if r["stream"] == turn]
            if not at:
                continue
            values = [turn_metrics(r) for r in at]
            orders = [r["order"] for r in at]
            metrics = {m: _stats([v[m] for v in values], orders, n_orders) for m in values[0]}
            out.append({"arm": arm, "turn": turn + 1, "metrics": metrics})
    return out


def scenario_title(config: dict[str, Any]) -> str:
    """The line above the table, from the config alone (so check can rebuild the table)."""
    sc, s = config["scenario"], config["sampling"]
    what = {
        "long": f"one new prompt of {sc['prompt_tokens']} tokens",
        "burst": f"{sc['streams']} new prompts of {sc['prompt_tokens']} tokens at once, "
        "the first burst apart",
        "turn": f"{sc['turn_tokens']} new tokens on a cached {sc['history_tokens']}-token "
        "history, and the same prompt cold",
        "beside": f"a new {sc['prompt_tokens']}-token prompt beside {sc['streams']} streams "
        f"decoding {sc['decode_tokens']} tokens",
        "agent": f"an agent loop of {sc['turns']} turns, the first {sc['prompt_tokens']} "
        f"tokens, each later one the last prompt, its answer and {sc['turn_tokens']} new "
        "tokens; the last prompt again cold",
        # .get: every entry is built, and receipts from before ``return`` have no others.
        "return": f"a {sc['history_tokens']}-token conversation comes back with "
        f"{sc['turn_tokens']} new tokens after {sc.get('others')} others of as many "
        "tokens, and the same prompt cold",
    }[sc["name"]]
    arms = ", ".join(a["name"] for a in config["arms"])
    return (
        f"headstart bench {config['run_id']}: scenario {sc['name']}: {what}; arms {arms}; "
        f"{config['orders']} orders x {sc['repeats']} repeats; {s['max_tokens']} tokens out; "
        f"token ids {sc['token_lo']}..{sc['token_hi'] - 1}; temperature {s['temperature']}; "
        f"seed {s['seed']}"
    )


def _fmt(v: float | None, scale: float, digits: int) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


#: Table columns: (header, width); "each" (every repeat, in run order) comes last, unpadded.
_COLUMNS = (("row", 8), ("metric", 20), ("unit", 8), ("arm", 12), ("n", 4))
_NUMBERS = (("median", 10), ("max", 10), ("vs base", 9))


def format_scenario_table(summary: dict[str, Any], title: str = "") -> str:
    """The human table: per row label, metric and arm, the median and maximum over every
    repeat, the arm's balanced ratio to the baseline (times only), and each repeat's value
    in run order (order 0's repeats first)."""
    ratio = {(r["label"], r["arm"], r["metric"]): r["balanced"] for r in summary["ratios"]}
    arm_w = max(12, *(len(a) + 2 for a in summary["arms"]))
    widths = [w if h != "arm" else arm_w for h, w in _COLUMNS]

    def line(left: list[str], right: list[str], each: str) -> str:
        cells = [c.ljust(w) for c, w in zip(left, widths, strict=True)]
        cells += [c.rjust(w) for c, (_, w) in zip(right, _NUMBERS, strict=True)]
        return ("".join(cells) + "  " + each).rstrip()

    head = line([h for h, _ in _COLUMNS], [h for h, _ in _NUMBERS], "each")
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    for g in summary["groups"]:
        for m, st in g["metrics"].items():
            if m in SERVER_COUNTERS and not st["n"]:
                continue  # a server without the counters: nothing to print for them
            name, unit, scale, digits = METRICS[m]
            if not m.endswith("_s"):
                vs = ""
            elif g["arm"] == summary["baseline"]:
                vs = "base"
            else:
                vs = _fmt(ratio.get((g["label"], g["arm"], m)), 1, 3)
            each = " ".join(_fmt(v, scale, digits) for v in st["each"])
            lines.append(
                line(
                    [g["label"], name, unit, g["arm"], str(st["n"])],
                    [_fmt(st["median"], scale, digits), _fmt(st["max"], scale, digits), vs],
                    each,
                )
            )
    if summary["scenario"] == "agent":
        lines += ["", *_turn_lines(summary, arm_w)]
    return "\n".join(lines) + "\n"


#: Per-turn table of ``agent``: (header, metric, width); "each" TTFT comes last, unpadded.
_TURN_COLUMNS = (
    ("prompt", "prompt_len", 9),
    ("cached", "cached_tokens", 9),
    ("cached %", "cached_fraction", 10),
    ("ttft ms", "ttft_s", 10),
)


def _turn_lines(summary: dict[str, Any], arm_w: int) -> list[str]:
    """``agent``'s per-turn table (medians over the repeats; each repeat's TTFT in run
    order), then per arm the worst reuse shortfall over every repeat."""
    head = "turn".ljust(6) + "arm".ljust(arm_w) + "n".ljust(4)
    head += "".join(h.rjust(w) for h, _, w in _TURN_COLUMNS) + "  each ttft ms"
    lines = ["per turn, medians over the repeats:", head, "-" * len(head)]
    for t in summary["turns"]:
        st = t["metrics"]
        cells = str(t["turn"]).ljust(6) + t["arm"].ljust(arm_w) + str(st["ttft_s"]["n"]).ljust(4)
        for _, m, w in _TURN_COLUMNS:
            _, _, scale, digits = METRICS[m]
            cells += _fmt(st[m]["median"], scale, digits).rjust(w)
        each = " ".join(_fmt(v, 1e3, 1) for v in st["ttft_s"]["each"])
        lines.append((cells + "  " + each).rstrip())
    worst = []
    for g in summary["groups"]:
        if g["label"] == "turns":
            values = g["metrics"]["reuse_shortfall"]["each"]
            known = [v for v in values if v is not None]
            missing = len(values) - len(known)
            text = str(min(known)) if known else "-"
            worst.append(
                f"{g['arm']} {text}" + (f" ({missing} repeats unknown)" if missing else "")
            )
    lines.append(
        "reuse shortfall, the minimum over every turn of every repeat (0 or more: each turn "
        "found its previous prompt and all but the last answer token cached): " + ", ".join(worst)
    )
    return lines
