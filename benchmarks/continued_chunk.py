"""A continued prefill chunk (an agent's tool result appended to a cached conversation) at
several history lengths, replayed from its continuation graph and run eagerly, in process.

    python benchmarks/continued_chunk.py [--shape 27b] [--format 4bit] [--tokens 501]
        [--starts 2063 7000 12215] [--profile]

Random weights at the shape (made on the GPU); one slot prefilled with the longest history in
chunks of 2048, then ``--tokens`` new tokens at each start position: the continuation graphs'
replay (``ContinuationGraphs``, as the engine runs a new turn) and the eager forward, CUDA-event
medians. ``--profile`` adds the top kernels of one replay at the first and last start (what
grows with the history). Prints one line per start.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import config, cuda_time, random_weights

from headstart.batch import ForwardBatch, SeqChunk
from headstart.engine.cuda_graph import ContinuationGraphs
from headstart.models.qwen35.model import Qwen35Model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="27b")
    ap.add_argument("--format", default="4bit", choices=["bf16", "4bit"])
    ap.add_argument("--tokens", type=int, default=501)
    ap.add_argument("--starts", type=int, nargs="+", default=[2063, 7000, 12215])
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    quant = args.format == "4bit"
    cfg = config(args.shape, quant)
    gen = torch.Generator(device="cuda").manual_seed(0)
    model = Qwen35Model(cfg, random_weights(cfg, quant, gen), torch.bfloat16, "cuda")
    history = max(args.starts) + args.tokens
    pool = model.new_state_pool(3, history + 1024)

    def ids(n: int) -> list[int]:
        return torch.randint(10, 4000, (n,)).tolist()

    t0 = time.time()
    for s in range(0, history, 2048):
        chunk = SeqChunk(0, s, ids(min(2048, history - s)))
        model.forward(ForwardBatch.build([chunk], model.device), pool)
    torch.cuda.synchronize()
    graphs = ContinuationGraphs(model, pool, args.tokens, 2)
    print(f"history of {history} tokens and graphs in {time.time() - t0:.1f}s", flush=True)
    tokens = ids(args.tokens)
    for start in args.starts:
        graph = cuda_time(lambda s=start: graphs.run(tokens, s, 0), reps=10) * 1e3
        batch = ForwardBatch.build([SeqChunk(0, start, tokens)], model.device)
        eager = cuda_time(lambda b=batch: model.forward(b, pool), reps=3) * 1e3
        print(f"{args.tokens} tokens at {start}: graph {graph:.1f} ms, eager {eager:.1f} ms")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for start in (args.starts[0], args.starts[-1]):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graphs.run(tokens, start, 0)
                torch.cuda.synchronize()
            print(f"== top kernels at {start}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))


if __name__ == "__main__":
    main()
