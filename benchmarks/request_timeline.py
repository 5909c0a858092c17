"""`headstart serve` with a host-clock timeline of each request's way to its first token.

    python benchmarks/request_timeline.py --timeline FILE serve MODEL [serve options]

Runs the server as `headstart serve` would, with timing marks around the request path (parsing,
admission, prefix lookup, restore, the step, delivery to the event loop); every 2 s and at exit
it appends the new marks to FILE (JSON lines). Diagnostics only: the marks cost a few
microseconds each. ``python benchmarks/request_timeline.py --show FILE [FIRST]`` prints one line
per request from the FIRST-th on, in milliseconds, for attributing TTFT between the HTTP side,
the engine's bookkeeping and the forward.
"""

from __future__ import annotations

import atexit
import functools
import json
import sys
import threading
import time

_EVENTS: list[tuple[str, float]] = []
_COLUMNS = (
    ("parse", "prep0", "prep1"),  # body parsed and checked (worker thread), before the clock
    ("to submit", "gen0", "submit1"),  # the server's TTFT clock starts at gen0
    ("to admit", "submit1", "admit0"),  # the engine wakes (and gathers a burst)
    ("lookup", "match0", "match1"),
    ("restore", "restore0", "restore1"),
    ("to step", "admit1", "step0"),  # planning, drafts, the batch
    ("forward", "run0", "run1"),  # the first step's runner: host enqueue (GPU: not waited for)
    ("to deliver", "run1", "deliver0"),  # snapshots due (and later steps of a long prompt)
    ("sample+send", "deliver0", "deliver1"),  # on a GPU this waits for the forward
    ("to loop", "deliver1", "take0"),  # the event loop picks the token up
    ("ttft", "gen0", "take1"),  # what the request log's ttft_s measures
)


def _mark(name: str) -> None:
    _EVENTS.append((name, time.perf_counter()))


def _around(owner: object, name: str, tag: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        _mark(tag + "0")
        try:
            return fn(*args, **kwargs)
        finally:
            _mark(tag + "1")

    setattr(owner, name, timed)


def _rows(events: list[tuple[str, float]]) -> list[dict[str, float]]:
    """One row per request: from each ``gen0`` to the first ``take1`` after it (requests one
    at a time; overlapping requests mix their marks, so use it on sequential scenarios)."""
    rows, i, parsed = [], 0, None
    while i < len(events):
        name, t = events[i]
        if name == "prep0":
            parsed = {"prep0": t}
        elif name == "prep1" and parsed is not None:
            parsed["prep1"] = t
        if name != "gen0":
            i += 1
            continue
        seen = dict(parsed or {})
        k = i
        while k < len(events) and events[k][0] != "take1":
            mark, when = events[k]
            # the delivery that reached this request is the last before its first token
            if mark.startswith("deliver") or mark not in seen:
                seen[mark] = when
            k += 1
        if k < len(events):
            seen["take1"] = events[k][1]
        rows.append(
            {
                col: 1e3 * (seen[b] - seen[a]) if a in seen and b in seen else float("nan")
                for col, a, b in _COLUMNS
            }
        )
        parsed, i = None, k + 1
    return rows


def show(path: str, first: int = 1) -> None:
    """Print the table of FILE's requests from the ``first``-th on."""
    with open(path) as f:
        events = [tuple(json.loads(line)) for line in f]
    print("req " + " ".join(f"{c:>11s}" for c, _, _ in _COLUMNS))
    for j, row in enumerate(_rows(events), 1):
        if j >= first:
            print(f"{j:3d} " + " ".join(f"{row[c]:11.2f}" for c, _, _ in _COLUMNS))


def main() -> int:
    if sys.argv[1:2] == ["--show"]:
        show(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
        return 0
    if sys.argv[1:2] != ["--timeline"]:
        print(__doc__)
        return 2
    path, argv = sys.argv[2], sys.argv[3:]
    open(path, "w").close()
    from headstart.engine import engine, inbox, prompt_cache_tiers, runner
    from headstart.server import api

    for owner, name, tag in (
        (api, "_prepare_completion", "prep"),
        (api, "_prepare_chat", "prep"),
        (api._Generation, "__init__", "gen"),
        (api._Generation, "submit", "submit"),
        (api._Generation, "take", "take"),
        (engine.Engine, "_admit", "admit"),
        (engine.Engine, "_run_step", "step"),
        (engine.Engine, "_sample_and_deliver", "deliver"),
        (prompt_cache_tiers.PromptCache, "match_prefix", "match"),
        (prompt_cache_tiers.PromptCache, "restore", "restore"),
        (runner.ModelRunner, "run", "run"),
        (inbox.Inbox, "wait_quiet", "quiet"),
    ):
        _around(owner, name, tag)

    written = 0

    def write() -> None:  # appends what is new: rewriting it all held the GIL for milliseconds
        nonlocal written
        new = _EVENTS[written : len(_EVENTS)]
        written += len(new)
        with open(path, "a") as f:
            f.writelines(f"{json.dumps(e)}\n" for e in new)

    def every() -> None:
        while True:
            time.sleep(2)
            write()

    threading.Thread(target=every, daemon=True).start()
    atexit.register(write)
    from headstart.cli import main as cli

    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
