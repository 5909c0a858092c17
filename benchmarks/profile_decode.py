"""Where the time of one graph-replayed decode step goes, kernel by kernel (GPU).

Builds a random-weight model at a real shape (``gpu_engine.py``'s configs, optionally with fewer
layers), captures the decode step as the engine does (``DecodeGraphs``), replays it under
``torch.profiler`` and prints, per step: wall time, the sum of kernel times (the rest is gaps
between kernels), the number of kernels, and the kernels grouped by category and by name.

    python benchmarks/profile_decode.py --shape 27b --format bf16 4bit --streams 1 16

``--variants pdl=0 pdl=1``: the same model under each setting in turn (programmatic dependent
launch off/on), graphs captured anew.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import config, copy_bandwidth, cuda_time, decode_floor_bytes, random_weights

from headstart.batch import ForwardBatch, SeqChunk

CATEGORIES = (  # first match wins
    ("qmm", ("_qmm_kernel", "_mma_kernel")),
    ("gemm", ("gemv", "gemm", "nvjet", "cutlass", "sm90", "splitk")),
    ("gdn", ("_gdn",)),
    ("attention", ("attention", "_attn", "flash")),
    ("fused", ("_fused", "_norm", "_conv", "_silu")),
)


TOP = 22


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def apply_variant(model, variant: str) -> None:
    """``pdl=0|1``: set HEADSTART_PDL."""
    for item in filter(None, variant.split(",")):
        key, value = item.split("=")
        if key == "pdl":
            os.environ["HEADSTART_PDL"] = value
        else:
            raise ValueError(f"unknown variant key {key!r}")


def profile(
    shape: str,
    fmt: str,
    layers: int | None,
    streams: list[int],
    bandwidth: float,
    variants: list[str],
) -> list[str]:
    from dataclasses import replace

    from headstart.engine.cuda_graph import DecodeGraphs
    from headstart.models.qwen35.model import Qwen35Model

    quant = fmt == "4bit"
    cfg = config(shape, quant)
    if layers:
        cfg = replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers])
    gen = torch.Generator(device="cuda").manual_seed(0)
    model = Qwen35Model(cfg, random_weights(cfg, quant, gen), torch.bfloat16, "cuda")
    nmax = max(streams)
    pool = model.new_state_pool(nmax + 1, 512)
    for s in range(nmax):
        model.forward(ForwardBatch.build([SeqChunk(s, 0, tuple(range(5, 105)))], "cuda"), pool)
    lines = []
    for variant in variants:
        apply_variant(model, variant)
        graphs = DecodeGraphs(model, pool, nmax, nmax)
        lines += profile_streams(model, cfg, graphs, streams, bandwidth, f"{fmt} {variant}")
        del graphs
    del pool, model
    gc.collect()
    torch.cuda.empty_cache()
    return lines


def kernels_per_call(fn, reps: int = 5) -> dict[str, list[float]]:
    """{kernel name: [us per call, launches per call]} over ``reps`` calls of ``fn`` (copies
    and memsets left out), after one call outside the profile."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.name:
            if ev.name.startswith(("Memcpy", "Memset")):
                continue
            by_name[ev.name][0] += ev.device_time_total / reps
            by_name[ev.name][1] += 1 / reps
    return by_name


def profile_streams(
    model, cfg, graphs, streams: list[int], bandwidth: float, label: str
) -> list[str]:
    lines = []
    for n in streams:

        def step(n=n, graphs=graphs):
            graphs.run([7] * n, [100] * n, list(range(n)))

        wall = cuda_time(step, reps=20)
        floor = decode_floor_bytes(cfg, model.w, n, 101) / bandwidth
        by_name = kernels_per_call(step)
        total = sum(v[0] for v in by_name.values())
        count = sum(v[1] for v in by_name.values())
        cats: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        for name, (t, c) in by_name.items():
            cats[category(name)][0] += t
            cats[category(name)][1] += c
        head = (
            f"## {label} layers={cfg.num_hidden_layers} streams={n}: wall "
            f"{wall * 1e3:.2f} ms, floor {floor * 1e3:.2f} ms ({wall / floor:.2f}x), "
            f"kernels {total / 1e3:.2f} ms in {count:.0f} launches, gaps "
            f"{wall * 1e3 - total / 1e3:.2f} ms"
        )
        lines.append(head)
        for cat, (t, c) in sorted(cats.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"  {cat:10s} {t / 1e3:8.3f} ms {c:6.0f} launches")
        for name, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP]:
            lines.append(f"    {t:9.1f} us {c:5.0f}x  {t / max(c, 1):7.2f} us  {name[:90]}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27b")
    ap.add_argument("--format", nargs="+", default=["bf16"], choices=["bf16", "4bit"])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--variants", nargs="+", default=[""])
    ap.add_argument("--top", type=int, default=22, help="kernels listed per step")
    args = ap.parse_args()
    global TOP
    TOP = args.top
    bw = copy_bandwidth()
    out = [f"copy bandwidth {bw / 1e9:.0f} GB/s"]
    for fmt in args.format:
        out += profile(args.shape, fmt, args.layers, args.streams, bw, args.variants)
        print("\n".join(out), flush=True)
    print("\n".join(out))
    print("\nsummary:\n" + "\n".join(line for line in out if line.startswith("##")))


if __name__ == "__main__":
    main()
