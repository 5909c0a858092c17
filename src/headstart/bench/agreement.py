"""Do the arms produce the same outputs where they should?

Requests with the same body (``request_sha``: same prompt, seed, temperature, length; the
model name aside) must give the same output fingerprint. The reference for each body is the
first arm's first request for it (its cold request in order 0), so a disagreement reads as
"arm B, steady at 16 streams: 3 of 16 differ from arm A's cold output".

Modes (``--agree``): ``all`` (every request, concurrent ones too), ``single`` (only requests
run one at a time; for servers whose batched kernels are not batch-invariant), ``none``.
Match fractions are reported in every mode; only the mode's requests count as mismatches.

Non-goals: explaining *why* outputs differ (the receipt's ``outputs.json`` holds the texts).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from headstart.bench.rows import Row

MODES = ("all", "single", "none")
_PHASE_RANK = {"cold": 0, "primed": 1, "steady": 2}


def _must_agree(row: Row, mode: str) -> bool:
    return mode == "all" or (mode == "single" and row["streams"] == 1)


def agreement(rows: list[Row], arms: list[str], mode: str) -> dict[str, Any]:
    """Match counts per (arm, phase, streams) and the list of disagreements under ``mode``."""
    if mode not in MODES:
        raise ValueError(f"agreement mode {mode!r}; expected one of {MODES}")
    by_request: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_request[r["request_sha"]].append(r)
    counts: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    bad: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for sha, members in by_request.items():
        ref = min(
            members,
            key=lambda r: (
                arms.index(r["arm"]),
                r["order"],
                _PHASE_RANK[r["phase"]],
                r["streams"],
                r["rep"],
                r["stream"],
            ),
        )
        for r in members:
            cell = (r["arm"], r["phase"], r["streams"])
            same = r["fingerprint"] == ref["fingerprint"] and not r["error"]
            counts[cell][0] += same
            counts[cell][1] += 1
            if _must_agree(r, mode):
                k = (
                    r["prompt_id"],
                    sha,
                    r["arm"],
                    r["phase"],
                    r["streams"],
                    ref["arm"],
                    ref["phase"],
                    ref["order"],
                )
                bad[k][0] += not same
                bad[k][1] += 1
    mismatches = [
        f"prompt {p!r} (request {sha}): arm {arm!r} {phase}@{streams}: {n} of {total} outputs "
        f"differ from arm {ref_arm!r}'s {ref_phase} output in order {ref_order}"
        for (p, sha, arm, phase, streams, ref_arm, ref_phase, ref_order), (n, total) in sorted(
            bad.items()
        )
        if n
    ]
    match = [
        {"arm": a, "phase": ph, "streams": s, "matched": m, "total": t}
        for (a, ph, s), (m, t) in sorted(
            counts.items(), key=lambda kv: (arms.index(kv[0][0]), _PHASE_RANK[kv[0][1]], kv[0][2])
        )
    ]
    return {"mode": mode, "requests": len(by_request), "match": match, "mismatches": mismatches}
