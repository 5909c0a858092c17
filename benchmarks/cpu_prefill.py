"""Where a first-use CPU prefill of the embedded default model (or ``--model``) goes, in process.

Times ``model.forward`` of one new prompt (one stream from position 0, logits of its last row,
as the engine's first chunk) at each ``--tokens`` length and ``--threads`` count, medians of
``--reps``; ``--profile`` lists the operations that take the most time under torch.profiler.

    python benchmarks/cpu_prefill.py --tokens 1000 4000 --threads 1 2
    python benchmarks/cpu_prefill.py --tokens 1000 --threads 1 --profile
"""

from __future__ import annotations

import argparse
import time

import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.loading import load


def _batch(tokens: int) -> ForwardBatch:
    ids = tuple((7 + 31 * j) % 4000 + 5 for j in range(tokens))
    return ForwardBatch.build([SeqChunk(0, 0, ids)])


def _forward_ms(model, pool, tokens: int, reps: int) -> list[float]:
    batch = _batch(tokens)
    model.forward(batch, pool)  # warm-up (allocator, first calls)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        model.forward(batch, pool)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    model = load(args.model, "cpu").model
    pool = model.new_state_pool(2, max(args.tokens) + 8)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for tokens in args.tokens:
            t = _forward_ms(model, pool, tokens, args.reps)
            print(
                f"threads {threads} tokens {tokens:5d}: median {sorted(t)[len(t) // 2]:8.1f} ms"
                f"  min {min(t):8.1f}  all {' '.join(f'{x:.0f}' for x in t)}",
                flush=True,
            )
            if args.profile:
                cpu = [torch.profiler.ProfilerActivity.CPU]
                batch = _batch(tokens)
                with torch.profiler.profile(activities=cpu) as prof:
                    model.forward(batch, pool)
                print(
                    prof.key_averages().table(
                        sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=50
                    )
                )


if __name__ == "__main__":
    main()
