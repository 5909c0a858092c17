"""A CPU decode step at the 2B shape with MLX 4-bit weights (random), through torch's int4 CPU
kernel in bf16, beside the same weights unpacked per call in fp32 (the CPU's default dtype).

    python benchmarks/cpu_int4_decode.py [--shape 2b] [--threads 1 2] [--steps 8]

Random weights at the shape (``load(dummy=True)``'s recipe, on the CPU), too big to unpack at
load (``unpack_bytes=0``). One stream: a 16-token prompt, then ``--steps`` decode steps, the
median step reported with the weights' packed bytes over that time (the bandwidth the step
reaches). Prints one line per (mode, threads).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import config

from headstart.arena import leaves
from headstart.batch import ForwardBatch, SeqChunk
from headstart.models.qwen35.dummy import random_weights
from headstart.models.qwen35.model import Qwen35Model
from headstart.ops.quant_matmul.cpu import CpuInt4


def packed_bytes(model: Qwen35Model) -> int:
    """Bytes of the weights a decode step reads (the embedding table: one row, left out)."""
    weights = [w for k, w in model.w.items() if k != "embed_tokens.weight"] + [model.head]
    return sum(t.numel() * t.element_size() for w in weights for _, t in leaves(w))


def step_ms(model: Qwen35Model, steps: int) -> float:
    pool = model.new_state_pool(1, 64)
    model.forward(ForwardBatch.build([SeqChunk(0, 0, tuple(range(10, 26)))]), pool)
    times = []
    for t in range(steps):
        start = time.perf_counter()
        model.forward(ForwardBatch.build([SeqChunk(0, 16 + t, (100 + t,))]), pool)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2b")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--modes", nargs="+", default=["int4-bf16", "unpack-fp32"])
    args = ap.parse_args()
    cfg = config(args.shape, True)
    for mode in args.modes:
        dtype = torch.float32 if mode.endswith("fp32") else torch.bfloat16
        t0 = time.time()
        model = Qwen35Model(cfg, random_weights(cfg, "cpu", bits=4), dtype, "cpu", unpack_bytes=0)
        kernel = sum(isinstance(w, CpuInt4) for w in model.w.values())
        nbytes = packed_bytes(model)
        print(
            f"{mode}: built in {time.time() - t0:.1f}s, {kernel} weights on the int4 kernel, "
            f"{nbytes / 1e9:.2f} GB read a step",
            flush=True,
        )
        for threads in args.threads:
            torch.set_num_threads(threads)
            ms = step_ms(model, args.steps)
            print(
                f"{args.shape} {mode:12s} threads {threads}: {ms:8.1f} ms a step, "
                f"{1e3 / ms:6.2f} tok/s, {nbytes / ms / 1e6:6.2f} GB/s",
                flush=True,
            )
        del model


if __name__ == "__main__":
    main()
