"""Where a CPU decode step of the embedded default model (or ``--model``) goes, in process.

Times ``model.forward`` of one decode row per stream (1 and 16 streams by default, each after a
30-token prompt) at each ``--threads`` count, counts the top-level ``aten::`` operations of a
step, and lists the operations that take the most time under ``torch.profiler`` (by input shape
with ``--shapes``). ``--pool-tokens``: tokens per slot of the state pool (default: just enough;
``serve`` allocates 16 slots of its ``--context``, 32,768).

    python benchmarks/cpu_decode.py --streams 1 16 --threads 1 2
    python benchmarks/cpu_decode.py --streams 1 --threads 1 --pool-tokens 32768 --shapes
    python benchmarks/cpu_decode.py --streams 1 4 16 --threads 1 --compiled

``--compiled``: the same steps from the compiled decode programs serve runs on a CPU
(engine/cpu_programs.py: one bucket per stream count, compiled first, its state written back),
beside the eager forward; the profile is then the compiled step's.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.loading import load


def _decode_batch(streams: int, position: int) -> ForwardBatch:
    return ForwardBatch.build([SeqChunk(s, position, (100 + s,)) for s in range(streams)])


def _step_ms(model, pool, streams: int, steps: int) -> float:
    """Median wall time of ``steps`` decode steps (positions advance, as in serving)."""
    times = []
    for t in range(steps):
        batch = _decode_batch(streams, 30 + t)
        start = time.perf_counter()
        model.forward(batch, pool)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def _compiled_ms(programs, streams: int, steps: int) -> float:
    times = []
    for t in range(steps):
        start = time.perf_counter()
        programs.run([100 + s for s in range(streams)], [30 + t] * streams, list(range(streams)))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def _profile(model, pool, streams: int, top: int, shapes: bool, programs=None) -> None:
    batch = _decode_batch(streams, 30)
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, record_shapes=shapes) as prof:
        if programs is None:
            model.forward(batch, pool)
        else:
            programs.run([100 + s for s in range(streams)], [30] * streams, list(range(streams)))
    ops = [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    counts = ", ".join(f"{n} {c}" for n, c in collections.Counter(ops).most_common(6))
    print(f"  {len(ops)} top-level aten ops per step ({counts})")
    table = prof.key_averages(group_by_input_shape=shapes)
    print(table.table(sort_by="self_cpu_time_total", row_limit=top, max_shapes_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--pool-tokens", type=int, default=None)
    ap.add_argument("--shapes", action="store_true")
    ap.add_argument("--compiled", action="store_true")
    args = ap.parse_args()
    model = load(args.model).model
    for streams in args.streams:
        # + a scratch slot for the compiled buckets' padding rows
        pool = model.new_state_pool(streams + 1, args.pool_tokens or 30 + args.steps + 1)
        prompts = [SeqChunk(s, 0, tuple(range(3 + s, 33 + s))) for s in range(streams)]
        model.forward(ForwardBatch.build(prompts), pool)
        programs = None
        if args.compiled:
            from headstart.engine.cpu_programs import DecodePrograms

            programs = DecodePrograms(model, pool, streams, scratch_slot=streams)
        for threads in args.threads:
            torch.set_num_threads(threads)
            _step_ms(model, pool, streams, 20)  # warm-up
            ms = _step_ms(model, pool, streams, args.steps)
            line = f"streams={streams} threads={threads}: {ms:.3f} ms/step median"
            if programs is not None:
                _compiled_ms(programs, streams, 20)
                line += f", compiled {_compiled_ms(programs, streams, args.steps):.3f} ms"
            print(line, flush=True)
        _profile(model, pool, streams, args.top, args.shapes, programs)


if __name__ == "__main__":
    main()
