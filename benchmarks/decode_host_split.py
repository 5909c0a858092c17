"""Where a plain decode step goes, on the engine thread: the step's wall time (from one step's
start to the next's) beside the parts the host spends on it (summed over the step's streams),
and on CUDA beside the decode graph's own GPU time (CUDA events around each replay).

    python benchmarks/decode_host_split.py                      # the default model, this device
    python benchmarks/decode_host_split.py --shape 27b --format 4bit   # random weights, GPU
    python benchmarks/decode_host_split.py --shape 27b --format 4bit --streams 16

A step's wall time minus its graph's GPU time is what the GPU waits for the host in a plain
decode step (read-back, sampling, delivery, planning, the next replay's inputs and launch).
Medians over the decode steps of a few rounds of --streams requests of --tokens tokens each
(the first two steps of each round left out), and the time between a stream's tokens as its
request's sink receives them. On
CUDA the same engine runs the requests twice: with every step planned after the last one's
tokens are delivered, then with steps launched ahead of that delivery (``Engine.decode_ahead``,
the default there), one column each. Prints a table last.
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


Calls = dict[str, list[tuple[float, float]]]


def _timed(acc: Calls, obj: object, name: str, key: str | None = None) -> None:
    """Wrap ``obj.name`` so that each call's (start, host time) is appended to
    ``acc[key or name]``."""
    f = getattr(obj, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key or name].append((t, time.perf_counter() - t))

    setattr(obj, name, timed)


def _per_step(calls: list[tuple[float, float]], begun: list[float]) -> list[float]:
    """The host time of ``calls`` summed over each step (``begun``: the steps' starts; the last
    step ends with the last call); steps without a call count 0."""
    bounds = [*begun, float("inf")]
    return [sum(d for t, d in calls if a <= t < b) for a, b in itertools.pairwise(bounds)]


def _gpu_timed(events: list[tuple[torch.cuda.Event, torch.cuda.Event]], graphs: object) -> None:
    """Record CUDA events around each decode-graph replay (read after the request ends)."""
    f = graphs.run

    def timed(*a, **k):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = f(*a, **k)
        end.record()
        events.append((start, end))
        return out

    graphs.run = timed


def _engine(args):
    from headstart.engine.config import EngineConfig
    from headstart.engine.engine import Engine

    if args.shape is None:
        from headstart.loading import load

        loaded = load()
        slots = max(4, args.streams)
        return Engine(
            loaded.model, loaded.tokenizer, loaded.eos_token_ids, EngineConfig(slots, 1024)
        )
    from gpu_engine import _tokenizer, config, random_weights

    from headstart.models.qwen35.model import Qwen35Model

    quant = args.format == "4bit"
    cfg = config(args.shape, quant)
    gen = torch.Generator(device="cuda").manual_seed(0)
    model = Qwen35Model(cfg, random_weights(cfg, quant, gen), torch.bfloat16, "cuda")
    return Engine(model, _tokenizer(), (), EngineConfig(max(4, args.streams), 1024))


def _measure(engine, args, acc: Calls, begun, events) -> dict[str, list[float]]:
    """Run the requests (--streams at a time); each part's host time per decode step
    (seconds, summed over the step's streams), and the time between a stream's tokens."""
    from headstart.engine.engine import Failed, Finish, Piece
    from headstart.engine.request import EngineRequest
    from headstart.sampling import SamplingParams

    walls: list[float] = []
    gpu: list[float] = []
    tokens: list[float] = []
    kept: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(args.requests + 1):  # the first round warms up and is not counted
        left = threading.Semaphore(0)
        arrived: list[list[float]] = [[] for _ in range(args.streams)]

        def sink(ev, mine, left=left):
            if isinstance(ev, Piece):
                mine.append(time.perf_counter())
            if isinstance(ev, (Finish, Failed)):
                left.release()

        acc.clear()
        begun.clear()
        events.clear()
        params = SamplingParams(temperature=0.0, ignore_eos=True)
        for i in range(args.streams):
            prompt = [1000 + 7 * r + 131 * i + j for j in range(31)]
            done = functools.partial(sink, mine=arrived[i])
            engine.submit(EngineRequest(f"r{r}.{i}", prompt, params, args.tokens, done))
        for _ in range(args.streams):
            if not left.acquire(timeout=300):
                raise SystemExit("a request did not finish")
        if r == 0:
            continue
        # Step 0 holds the prompts; the decode steps follow, the first two left out.
        walls += [b - a for a, b in itertools.pairwise(begun[3:])]
        for mine in arrived:
            tokens += [b - a for a, b in itertools.pairwise(mine[3:])]
        for key, calls in acc.items():
            kept[key] += _per_step(calls, begun)[3:]
        if events:
            torch.cuda.synchronize()
            gpu += [s.elapsed_time(e) / 1e3 for s, e in events[2:]]
    rows = {"step, start to next start (wall)": walls, "token to token, at a sink": tokens}
    if gpu:
        rows["decode graph on the GPU (CUDA events)"] = gpu
    return rows | dict(sorted(kept.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default=None, help="a random-weight shape (gpu_engine.py's)")
    ap.add_argument("--format", default="bf16", choices=["bf16", "4bit"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=3, help="rounds of --streams requests")
    ap.add_argument("--streams", type=int, default=1, help="requests decoding together")
    args = ap.parse_args()

    engine = _engine(args)
    acc: Calls = collections.defaultdict(list)
    begun: list[float] = []
    for name, key in (
        ("_draw", "sampling (on CUDA: waits for the forward)"),
        ("_per_request", "delivery"),
    ):
        _timed(acc, engine, name, key)
    _timed(acc, engine.runner, "run", "runner: inputs and launch (on CPU: the forward)")
    _timed(acc, engine.scheduler, "plan", "planning")

    def marked(f):
        def run(*a, **k):
            begun.append(time.perf_counter())
            return f(*a, **k)

        return run

    for name in ("_run_step", "_step_ahead"):  # a step planned, or one launched ahead
        setattr(engine, name, marked(getattr(engine, name)))
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    graphs = getattr(engine.runner, "decode_graphs", None)
    if graphs is not None:
        _gpu_timed(events, graphs)
    engine.start()
    # Steps planned one by one, then (where the engine launches them ahead: CUDA) ahead.
    modes = [False, True] if engine.decode_ahead else [False]
    columns = {}
    for ahead in modes:
        engine.decode_ahead = ahead
        columns[ahead] = _measure(engine, args, acc, begun, events)
    engine.stop()

    def ms(v: list[float]) -> str:
        return f"{1e3 * statistics.median(v):9.3f}" if v else "        -"

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    what = f"{args.streams} streams'" if args.streams > 1 else "one stream's"
    print(f"{what} plain decode steps, {args.shape or 'default model'}, {device}")
    names = {False: "planned", True: "ahead"}
    print(f"{'part, median ms':48s}" + "".join(f" {names[a]:>9s}" for a in modes) + "  n")
    for key in columns[False]:
        cells = "".join(f" {ms(columns[a].get(key, []))}" for a in modes)
        print(f"{key:48s}{cells}  {len(columns[False][key])}")


if __name__ == "__main__":
    main()
