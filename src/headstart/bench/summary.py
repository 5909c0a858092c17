"""Summaries of a bench run, computed only from the raw rows (and the run's config).

Job: per (arm, phase, stream count): medians, maxima and per-order means of TTFT, per-stream
decode rate, full response time and cached tokens, and of per-burst wall time (earliest send
to latest ``[DONE]``) and burst throughput; ratios of each arm to the baseline (the first
arm) computed *per order* and combined by the geometric mean, so that drift over the run
(warming, throttling) cancels between the alternating orders; output agreement; and the text
table. Deterministic: ``bench check`` re-runs :func:`summarize` on the stored rows and
expects the stored summary back.

Non-goals: reading or writing files; deciding pass/fail (``check.py``).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from headstart.bench.agreement import agreement
from headstart.bench.rows import BURST_KEY, Row, key_of, output_tokens

PHASES = ("cold", "primed", "steady")
REQUEST_METRICS = ("ttft_s", "decode_tok_s", "e2e_s", "cached_tokens")
BURST_METRICS = ("burst_wall_s", "burst_tok_s")
#: Metrics compared between arms (ratio arm / baseline; > 1 is slower for times).
RATIO_METRICS = ("ttft_s", "decode_tok_s", "e2e_s", "burst_wall_s", "burst_tok_s")


def bursts(rows: Iterable[Row]) -> list[Row]:
    """One record per burst: wall = earliest send to latest ``[DONE]``, tokens, tokens/s.
    A burst with a request that never finished has no wall time."""
    groups: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        groups[key_of(r, BURST_KEY)].append(r)
    out = []
    for key, members in groups.items():
        rec: Row = dict(zip(BURST_KEY, key, strict=False))
        done = [m["t_done"] for m in members]
        wall = None
        if all(d is not None for d in done):
            wall = max(done) - min(m["t_send"] for m in members)
        tokens = sum(output_tokens(m) for m in members)
        rec.update(burst_wall_s=wall, tokens=tokens, burst_tok_s=tokens / wall if wall else None)
        out.append(rec)
    return out


def _stats(values_by_order: dict[int, list[float]], n_orders: int) -> dict[str, Any]:
    values = [v for vs in values_by_order.values() for v in vs]
    return {
        "n": len(values),
        "median": statistics.median(values) if values else None,
        "max": max(values) if values else None,
        "order_means": [
            statistics.fmean(values_by_order[k]) if values_by_order.get(k) else None
            for k in range(n_orders)
        ],
    }


def _collect(records: Iterable[Row], metrics: tuple[str, ...]) -> dict[tuple, dict]:
    """(arm, phase, streams) -> metric -> order -> values (None values left out)."""
    out: dict[tuple, dict] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in records:
        for m in metrics:
            if r.get(m) is not None:
                out[(r["arm"], r["phase"], r["streams"])][m][r["order"]].append(r[m])
    return out


def balanced_ratio(arm: list[float | None], base: list[float | None]) -> dict[str, Any]:
    """Per-order ratios ``arm[k] / base[k]`` (None where either is missing) and their
    geometric mean over the orders that have one ("balanced": drift cancels between the
    alternating orders)."""
    per_order = [a / b if a is not None and b else None for a, b in zip(arm, base, strict=False)]
    logs = [math.log(r) for r in per_order if r is not None and r > 0]
    return {"per_order": per_order, "balanced": math.exp(statistics.fmean(logs)) if logs else None}


def summarize(rows: list[Row], config: dict[str, Any]) -> dict[str, Any]:
    """The summary document of a run (see the module docstring)."""
    arms = [a["name"] for a in config["arms"]]
    n_orders = int(config["orders"])
    req = _collect(rows, REQUEST_METRICS)
    bur = _collect(bursts(rows), BURST_METRICS)
    cells = sorted(set(req) | set(bur), key=lambda c: (PHASES.index(c[1]), c[2], arms.index(c[0])))
    groups = []
    for cell in cells:
        metrics = {m: _stats(req[cell][m], n_orders) for m in REQUEST_METRICS}
        metrics.update({m: _stats(bur[cell][m], n_orders) for m in BURST_METRICS})
        groups.append({"arm": cell[0], "phase": cell[1], "streams": cell[2], "metrics": metrics})
    by_cell = {(g["arm"], g["phase"], g["streams"]): g["metrics"] for g in groups}
    ratios = []
    for (arm, phase, streams), metrics in by_cell.items():
        base = by_cell.get((arms[0], phase, streams))
        if arm == arms[0] or base is None:
            continue
        for m in RATIO_METRICS:
            ratios.append(
                {
                    "arm": arm,
                    "baseline": arms[0],
                    "phase": phase,
                    "streams": streams,
                    "metric": m,
                    **balanced_ratio(metrics[m]["order_means"], base[m]["order_means"]),
                }
            )
    return {
        "arms": arms,
        "baseline": arms[0],
        "orders": n_orders,
        "groups": groups,
        "ratios": ratios,
        "agreement": agreement(rows, arms, config["agree"]),
    }


def _fmt(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


#: Table columns: (header, unit line, width).
_COLUMNS = (
    ("phase", "", 7),
    ("streams", "", 8),
    ("arm", "", 14),
    ("reqs", "", 5),
    ("ttft med", "ms", 10),
    ("ttft max", "ms", 10),
    ("decode", "tok/s", 8),
    ("e2e med", "ms", 9),
    ("burst", "wall s", 8),
    ("burst", "tok/s", 8),
    ("cached", "tokens", 8),
    ("agree", "", 7),
    ("ttft", "vs base", 9),
    ("tok/s", "vs base", 9),
)


def _line(cells: list[str], widths: list[int]) -> str:
    # phase and arm left-aligned, numbers right-aligned; a gap after "streams" before the arm
    return "".join(
        c.ljust(w) if i in (0, 2) else c.rjust(w) + ("  " if i == 1 else "")
        for i, (c, w) in enumerate(zip(cells, widths, strict=False))
    ).rstrip()


def format_table(summary: dict[str, Any], title: str = "") -> str:
    """The human table: one line per (phase, streams, arm). Times and rates are medians over
    every request (or burst) of the cell; "vs base" columns are the arm's per-order mean over
    the baseline's, balanced geometrically over orders ("burst tok/s" for the last one)."""
    ratio = {
        (r["arm"], r["phase"], r["streams"], r["metric"]): r["balanced"] for r in summary["ratios"]
    }
    match = {(m["arm"], m["phase"], m["streams"]): m for m in summary["agreement"]["match"]}
    widths = [w for _, _, w in _COLUMNS]
    widths[2] = max(5, *(len(a) + 2 for a in summary["arms"]))
    lines = [title] if title else []
    lines += [_line([c[0] for c in _COLUMNS], widths), _line([c[1] for c in _COLUMNS], widths)]
    lines.append("-" * len(lines[-2]))
    for g in summary["groups"]:
        arm, phase, streams, m = g["arm"], g["phase"], g["streams"], g["metrics"]
        cell = (arm, phase, streams)
        agree = match.get(cell)
        is_base = arm == summary["baseline"]
        lines.append(
            _line(
                [
                    phase,
                    str(streams),
                    arm,
                    str(m["ttft_s"]["n"]),
                    _fmt(m["ttft_s"]["median"], 1e3),
                    _fmt(m["ttft_s"]["max"], 1e3),
                    _fmt(m["decode_tok_s"]["median"]),
                    _fmt(m["e2e_s"]["median"], 1e3),
                    _fmt(m["burst_wall_s"]["median"], 1, 3),
                    _fmt(m["burst_tok_s"]["median"]),
                    _fmt(m["cached_tokens"]["median"], 1, 0),
                    f"{100 * agree['matched'] / agree['total']:.0f}%" if agree else "-",
                    "base" if is_base else _fmt(ratio.get((*cell, "ttft_s")), 1, 3),
                    "base" if is_base else _fmt(ratio.get((*cell, "burst_tok_s")), 1, 3),
                ],
                widths,
            )
        )
    return "\n".join(lines) + "\n"
