"""Operations the model dispatches for one forward over a burst of new prompts (any machine).

A burst of N new prompts in one step runs eagerly (graphs cover up to 4 prefill chunks), where
each dispatched operation costs host time: tens of microseconds a kernel launch on the GPU
machine. This counts the top-level ``aten::`` operations of one forward of N fresh prompts with
the embedded default model (or ``--model``), the GDN recurrence stood in by one operation (on
the GPU it is one varlen FLA call; the CPU reference loops over spans).

    python benchmarks/burst_dispatch.py --prompts 16 --length 31
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import replace

import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.loading import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--length", type=int, default=31)
    args = ap.parse_args()
    model = load(args.model).model
    model.kernels = replace(model.kernels, gdn_spans=lambda q, k, v, *rest: v.clone())
    pool = model.new_state_pool(args.prompts + 1, args.length + 1)
    gen = torch.Generator().manual_seed(0)
    chunks = [
        SeqChunk(s, 0, tuple(torch.randint(3, 4000, (args.length,), generator=gen).tolist()))
        for s in range(args.prompts)
    ]
    model.forward(ForwardBatch.build(chunks), pool)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model.forward(ForwardBatch.build(chunks), pool)
    ops = [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    top = ", ".join(f"{name} {n}" for name, n in collections.Counter(ops).most_common(5))
    print(
        f"{args.prompts} prompts x {args.length} tokens, {model.cfg.num_hidden_layers} layers: "
        f"{len(ops)} top-level aten ops per forward ({top})"
    )


if __name__ == "__main__":
    main()
