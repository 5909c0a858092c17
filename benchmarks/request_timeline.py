"""`headstart serve` with a host-clock timeline of each request's way to its first token.

    python benchmarks/request_timeline.py --timeline FILE serve MODEL [serve options]

Runs the server as `headstart serve` would, with timing marks around the request path (parsing,
admission, prefix lookup, restore, the step, delivery to the event loop); every 2 s and at exit
it appends the new marks to FILE (JSON lines). Diagnostics only: the marks cost a few
microseconds each. ``python benchmarks/request_timeline.py --show FILE [FIRST]`` prints one line
per request from the FIRST-th on, in milliseconds, for attributing TTFT between the HTTP side,
the engine's bookkeeping and the forward (sequential requests); ``--bursts FILE [N]`` one line
per burst of N (16) requests sent together: when their bodies were read, the last submitted,
the engine's gather ended, the burst admitted, its first tokens reached the event loop, its
step's snapshots were taken, and the next step's first token came;
with ``--receipt DIR`` (the ``headstart bench --scenario burst`` receipt of the same bursts,
sent from the same host) counted from the client's first send, with the client's last first
token beside them.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import pathlib
import sys
import threading
import time

_EVENTS: list[tuple[str, float]] = []
_COLUMNS = (
    ("read", "http0", "body1"),  # the app called (head parsed) to the body read
    ("to parse", "body1", "prep0"),  # the hand-over to a worker thread
    ("parse", "prep0", "prep1"),  # body parsed and checked (worker thread), before the clock
    ("to submit", "gen0", "submit1"),  # the server's TTFT clock starts at gen0
    ("to admit", "submit1", "admit0"),  # the engine wakes (and gathers a burst)
    ("lookup", "match0", "match1"),
    ("restore", "restore0", "restore1"),
    ("to step", "admit1", "step0"),  # planning, drafts, the batch
    ("forward", "run0", "run1"),  # the first step's runner: host enqueue (GPU: not waited for)
    ("to draw", "run1", "draw0"),  # snapshots due (and later steps of a long prompt)
    ("draw", "draw0", "draw1"),  # on a GPU this waits for the forward, then samples
    ("send", "deliver0", "deliver1"),  # detokenize, stop checks, hand to the loop
    ("to loop", "deliver1", "take0"),  # the event loop picks the token up
    ("ttft", "gen0", "take1"),  # what the request log's ttft_s measures
    ("from head", "http0", "take1"),  # the server's whole part of what a client sees
    ("held", "held0", "held1"),  # the GIL or the event loop held past 2 ms meanwhile (summed)
)
#: Stalls of 2 ms or more: (kind, start, seconds, what the other threads were doing). "gil": a
#: thread that sleeps 1 ms woke late (another thread held the interpreter); "loop": a task on
#: the event loop that sleeps 1 ms woke late (the loop was busy or blocked).
_STALLS: list[tuple[str, float, float, dict[str, str]]] = []
STALL_S = 0.002


def _mark(name: str) -> None:
    _EVENTS.append((name, time.perf_counter()))


def _around(owner: object, name: str, tag: str) -> None:
    """Mark ``tag0`` and ``tag1`` around each call of ``owner.name`` (awaited, if async)."""
    fn = getattr(owner, name)

    async def awaited(coro):
        try:
            return await coro
        finally:
            _mark(tag + "1")

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        _mark(tag + "0")
        if inspect.iscoroutinefunction(fn):
            return awaited(fn(*args, **kwargs))
        try:
            return fn(*args, **kwargs)
        finally:
            _mark(tag + "1")

    setattr(owner, name, timed)


def _on_call(owner: object, name: str, tag: str) -> None:
    """Mark when ``owner.name`` is called (an ASGI app: the call returns a coroutine)."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def marked(*args, **kwargs):
        _mark(tag)
        return fn(*args, **kwargs)

    setattr(owner, name, marked)


def _threads_now() -> dict[str, str]:
    """Each other thread's innermost frames, as ``file:line func`` (3 deep)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    out = {}
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        where, f = [], frame
        while f is not None and len(where) < 3:
            file = f.f_code.co_filename.rsplit("/", 1)[-1]
            where.append(f"{file}:{f.f_lineno} {f.f_code.co_name}")
            f = f.f_back
        out[names.get(ident, str(ident))] = " < ".join(where)
    return out


def _watch_gil() -> None:
    while True:
        t = time.perf_counter()
        time.sleep(0.001)
        late = time.perf_counter() - t - 0.001
        if late >= STALL_S:
            _STALLS.append(("gil", t, late, _threads_now()))


async def _watch_loop() -> None:
    import asyncio

    while True:
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        late = time.perf_counter() - t - 0.001
        if late >= STALL_S:
            _STALLS.append(("loop", t, late, {}))


def _held(stalls: list[tuple[str, float, float, dict[str, str]]], a: float, b: float) -> float:
    return sum(min(t + d, b) - max(t, a) for _, t, d, _ in stalls if t < b and t + d > a)


def _rows(events: list[tuple[str, float]], stalls: list = ()) -> list[dict[str, float]]:
    """One row per request: from each ``gen0`` to the first ``take1`` after it (requests one
    at a time; overlapping requests mix their marks, so use it on sequential scenarios)."""
    rows, i, parsed = [], 0, None
    while i < len(events):
        name, t = events[i]
        if name == "http0":
            parsed = {"http0": t}
        elif name in ("body1", "prep0", "prep1"):
            parsed = parsed if parsed is not None else {}
            parsed[name] = t
        if name != "gen0":
            i += 1
            continue
        seen = dict(parsed or {})
        k = i
        while k < len(events) and events[k][0] != "take1":
            mark, when = events[k]
            # the delivery that reached this request is the last before its first token
            if mark.startswith(("draw", "deliver")) or mark not in seen:
                seen[mark] = when
            k += 1
        if k < len(events):
            seen["take1"] = events[k][1]
        row = {
            col: 1e3 * (seen[b] - seen[a]) if a in seen and b in seen else float("nan")
            for col, a, b in _COLUMNS
            if a != "held0"
        }
        row["_a"], row["_b"] = seen.get("http0", seen.get("gen0")), seen.get("take1")
        row["held"] = (
            1e3 * _held(stalls, row["_a"], row["_b"])
            if row["_a"] is not None and row["_b"] is not None
            else float("nan")
        )
        rows.append(row)
        parsed, i = None, k + 1
    return rows


def _lines(path: str) -> list[tuple]:
    """The records of a JSON-lines file this tool wrote (the timeline, its stalls)."""
    with open(path) as f:
        return [tuple(json.loads(line)) for line in f]


def show(path: str, first: int = 1) -> None:
    """Print the table of FILE's requests from the ``first``-th on; then, for each request
    that some stall overlapped, the stalls (FILE.stalls, written beside FILE)."""
    try:
        stalls = _lines(path + ".stalls")
    except OSError:
        stalls = []
    rows = _rows(_lines(path), stalls)
    print("req " + " ".join(f"{c:>10s}" for c, _, _ in _COLUMNS))
    for j, row in enumerate(rows, 1):
        if j >= first:
            print(f"{j:3d} " + " ".join(f"{row[c]:10.2f}" for c, _, _ in _COLUMNS))
    for j, row in enumerate(rows, 1):
        a, b = row.get("_a"), row.get("_b")
        if j < first or a is None or b is None:
            continue
        for kind, t, d, threads in stalls:
            if t < b and t + d > a:
                print(f"  req {j}: {kind} stall {1e3 * d:.1f} ms at +{1e3 * (t - a):.1f} ms")
                for name, where in threads.items():
                    if not any(w in where for w in ("wait", "select", "_worker", " every")):
                        print(f"    {name}: {where}")


def client_bursts(receipt: str) -> list[tuple[float, float]]:
    """(first send, last first token) of each burst in a ``headstart bench --scenario burst``
    receipt folder, in seconds on the client's ``time.perf_counter`` clock (the receipt's
    ``perf_counter_t0`` plus the rows' times), in send order. A failed request's missing first
    token makes the burst's last one nan."""
    from headstart.bench.receipt import load_records

    folder = pathlib.Path(receipt)
    t0 = json.loads((folder / "config.json").read_text())["perf_counter_t0"]
    rows = load_records((folder / "requests.json").read_text(), "burst")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("role") == "burst":
            groups.setdefault((r["arm"], r["order"], r["rep"]), []).append(r)
    out = []
    for recs in groups.values():
        firsts = [r["t_first"] for r in recs]
        last = float("nan") if None in firsts else t0 + max(firsts)
        out.append((t0 + min(r["t_send"] for r in recs), last))
    return sorted(out)


def bursts(
    events: list[tuple[str, float]],
    size: int,
    gap: float = 0.03,
    client: list[tuple[float, float]] | None = None,
) -> list[dict]:
    """One row per burst of at least ``size`` requests (bodies read less than ``gap`` seconds
    apart), in milliseconds from its first body read: when the ``size``-th body was read, the
    last request submitted, the engine's gather ended and the admission began after it, and
    when the first and the ``size``-th first token reached the loop, how long the snapshots
    taken after them took (the prompt cache's, on the engine thread), when that step ended,
    and when the next step's first token reached the loop. With ``client`` (from
    :func:`client_bursts`, same host), each burst sent at most 100 ms before its first body
    read is matched to it, and the row counts from the client's first send instead, with the
    first body read and the client's last first token beside the server's marks."""
    reads = [t for name, t in events if name == "body1"]
    groups: list[list[float]] = []
    for t in reads:
        if groups and t - groups[-1][-1] < gap:
            groups[-1].append(t)
        else:
            groups.append([t])
    rows = []
    for group in groups:
        if len(group) < size:
            continue
        # From the first body read: the app-call marks cannot tell a burst's requests from
        # others arriving beside them (the client's other calls).
        start = group[0]

        def first(name: str, after: float, n: int = 1) -> list[float]:
            return [t for mark, t in events if mark == name and t >= after][:n]

        submits = first("submit1", start, size)
        if len(submits) < size:
            continue
        admit = first("admit0", submits[-1])
        quiet = [t for mark, t in events if mark == "quiet1" and admit and start <= t <= admit[0]]
        # Take marks carry no request id: the first ``size`` after the admission are the
        # burst's first tokens (each request's first, as its later ones come a step later).
        takes = first("take1", admit[0], size) if admit else []
        # Once the first tokens are handed to the loop, the step that made them takes its
        # snapshots and ends; the next step's delivery brings the burst's second tokens.
        delivered = first("deliver1", admit[0], 2) if admit else []
        snap = first("snap0", delivered[0]) if delivered else []
        snap += first("snap1", snap[0]) if snap else []
        ended = first("step1", delivered[0]) if delivered else []
        second = first("take1", delivered[1]) if len(delivered) == 2 else []
        sent = [c for c in client or () if start - 0.1 <= c[0] <= start]
        match = sent[-1] if sent else None  # (first send, last first token)
        origin = match[0] if match else start
        ms = lambda t: 1e3 * (t - origin)  # noqa: E731
        nan = float("nan")
        row = {}
        if client is not None:  # nan where no client burst matched
            row["first body read"] = ms(start) if match else nan
        row |= {
            f"{size}th body read": ms(group[size - 1]),
            "last submitted": ms(submits[-1]),
            "gather ended": ms(quiet[-1]) if quiet else nan,
            "admitted": ms(admit[0]) if admit else nan,
            "first token": ms(takes[0]) if takes else nan,
            f"{size}th first token": ms(takes[-1]) if len(takes) == size else nan,
            "snapshots took": 1e3 * (snap[1] - snap[0]) if len(snap) == 2 else nan,
            "step ended": ms(ended[0]) if ended else nan,
            "next token": ms(second[0]) if second else nan,
        }
        if client is not None:
            row["client's last"] = ms(match[1]) if match else nan
        rows.append(row)
    return rows


def show_bursts(path: str, size: int, receipt: str | None = None) -> None:
    """Print :func:`bursts` of FILE's events, one line a burst; with ``receipt`` (a bench
    burst receipt folder), counted from the client's sends."""
    rows = bursts(_lines(path), size, client=client_bursts(receipt) if receipt else None)
    if not rows:
        print(f"no burst of {size} requests in {path}")
        return
    print("burst " + " ".join(f"{c:>16s}" for c in rows[0]))
    for j, row in enumerate(rows, 1):
        print(f"{j:5d} " + " ".join(f"{v:16.2f}" for v in row.values()))


def main() -> int:
    if sys.argv[1:2] == ["--show"]:
        show(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
        return 0
    if sys.argv[1:2] == ["--bursts"]:
        args = sys.argv[2:]
        receipt = None
        if "--receipt" in args:
            at = args.index("--receipt")
            receipt = args[at + 1]
            del args[at : at + 2]
        show_bursts(args[0], int(args[1]) if len(args) > 1 else 16, receipt)
        return 0
    if sys.argv[1:2] != ["--timeline"]:
        print(__doc__)
        return 2
    path, argv = sys.argv[2], sys.argv[3:]
    open(path, "w").close()
    from headstart.engine import engine, host_copies, inbox, prompt_cache_tiers, runner
    from headstart.server import api, guard

    for owner, name, tag in (
        (api, "_prepare_completion", "prep"),
        (api, "_prepare_chat", "prep"),
        (api._Generation, "__init__", "gen"),
        (api._Generation, "submit", "submit"),
        (api._Generation, "take", "take"),
        (engine.Engine, "_admit", "admit"),
        (engine.Engine, "_run_step", "step"),
        (engine.Engine, "_draw_for", "draw"),
        (engine.Engine, "_deliver_drawn", "deliver"),
        (prompt_cache_tiers.PromptCache, "match_prefix", "match"),
        (prompt_cache_tiers.PromptCache, "restore", "restore"),
        (prompt_cache_tiers.PromptCache, "take_snapshots", "snap"),
        (runner.ModelRunner, "run", "run"),
        (inbox.Inbox, "wait_quiet", "quiet"),
        (host_copies.HostCopies, "_copy", "copy"),
        (engine.Engine, "_end", "end"),
    ):
        _around(owner, name, tag)
    _around(api, "read_body", "body")
    _on_call(guard.Guard, "__call__", "http0")
    watching = []

    def watch() -> None:  # from the first request on: start-up would flood the stall list
        if not watching:
            import asyncio

            watching.append(asyncio.get_running_loop().create_task(_watch_loop()))
            threading.Thread(target=_watch_gil, name="gil-watch", daemon=True).start()

    generation_init = api._Generation.__init__

    @functools.wraps(generation_init)
    def init(*args, **kwargs):
        watch()
        generation_init(*args, **kwargs)

    api._Generation.__init__ = init

    written = stalls_written = 0
    open(path + ".stalls", "w").close()

    def write() -> None:  # appends what is new: rewriting it all held the GIL for milliseconds
        nonlocal written, stalls_written
        new = _EVENTS[written : len(_EVENTS)]
        written += len(new)
        with open(path, "a") as f:
            f.writelines(f"{json.dumps(e)}\n" for e in new)
        new = _STALLS[stalls_written : len(_STALLS)]
        stalls_written += len(new)
        with open(path + ".stalls", "a") as f:
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
