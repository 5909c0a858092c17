"""New prompts' GDN at the model shapes (GPU): FLA's chunked form against the decode step's
kernel over the rows (``ops.gated_delta.triton.gdn_padded``), per layer, from CUDA-graph
replays of 48 layers' worth of calls (each layer its own pool and inputs, as in a forward).

    python benchmarks/gdn_padded.py [--launches 4x16,1x16,2x32] [--chunks 16,32] [--cases 1x32]

``--launches``: also the step kernel at each (warps x Dv slice), at every row count;
``--chunks``: also FLA at those chunk sizes; ``--cases``: only these (streams x rows);
``--fused``: also ``gdn_fresh_chunk`` (one fused chunk) at up to 32 rows; ``--solve``: also
``fla.gdn_fresh_padded`` (FLA's intra-chunk solve, then our outputs and final states) at up to
``--max-rows`` rows (default: the path's limit, ``FRESH_PADDED_MAX_ROWS``); ``--once``: only
``--solve``'s check, each case run once with no graphs or timing (for ``compute-sanitizer``):

    compute-sanitizer --tool memcheck python benchmarks/gdn_padded.py --shapes 27b \
        --cases 2x64,2x48 --solve --max-rows 64 --once
"""

from __future__ import annotations

import argparse
import functools

import torch
from triton.testing import do_bench

from headstart.ops.gated_delta import fla
from headstart.ops.gated_delta import triton as gpu_gdn

DEV = torch.device("cuda")
SHAPES = {"27b": (16, 48, 128), "2b": (16, 16, 128)}  # Hk, Hv, D
CASES = [(1, 16), (1, 32), (4, 32), (16, 16), (16, 32), (1, 64)]
LAYERS = 48


def inputs(n: int, L: int, Hk: int, Hv: int, D: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(n, L, Hk, D, generator=g, device=DEV).to(torch.bfloat16)
    k = torch.randn(n, L, Hk, D, generator=g, device=DEV).to(torch.bfloat16)
    v = torch.randn(n, L, Hv, D, generator=g, device=DEV).to(torch.bfloat16)
    decay = torch.nn.functional.logsigmoid(torch.randn(n, L, Hv, generator=g, device=DEV))
    beta = torch.rand(n, L, Hv, generator=g, device=DEV).to(torch.bfloat16)
    pool = torch.zeros(n + 1, Hv, D, D, device=DEV)
    slots = torch.arange(n, device=DEV) + 1
    return q, k, v, decay, beta, slots, pool


def per_layer_us(fn, layers: list) -> float:
    for a in layers:
        fn(*a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for a in layers:
            fn(*a)
    return do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e3 / len(layers)


def steps_at(launch, q, k, v, g, beta, slots, pool):
    """gpu_gdn.gdn_padded's steps at any row count, with a given launch."""
    N, L = q.shape[:2]
    o = gpu_gdn.gdn_decode(
        *(t.flatten(0, 1) for t in (q, k, v, g, beta)),
        slots,
        None,
        pool,
        out_dtype=torch.float32,
        width=L,
        launch=launch,
    )
    return o.view(N, L, *o.shape[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", default="", help="warps x Dv slice, comma-separated")
    ap.add_argument("--chunks", default="", help="FLA chunk sizes, comma-separated")
    ap.add_argument("--cases", default="", help="streams x rows, comma-separated")
    ap.add_argument("--shapes", default="27b,2b")
    ap.add_argument("--fused", action="store_true", help="also gdn_fresh_chunk (<= 32 rows)")
    ap.add_argument("--solve", action="store_true", help="also gdn_fresh_padded (<= 32 rows)")
    ap.add_argument("--max-rows", type=int, default=0, help="gdn_fresh_padded's row limit")
    ap.add_argument("--once", action="store_true", help="--solve's check only, once a case")
    args = ap.parse_args()
    if args.max_rows:  # to try the path past its limit (module doc)
        gpu_gdn.FRESH_PADDED_MAX_ROWS = args.max_rows
    chunks = [int(c) for c in args.chunks.split(",") if c]
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",") if c] or CASES
    launches = [tuple(int(x) for x in s.split("x")) for s in args.launches.split(",") if s]
    fla.use_shipped_configs(DEV)
    print(f"{'shape':5s} {'n x L':>8s} {'FLA us':>8s} {'steps us':>9s}  max |diff| of o")
    for name in args.shapes.split(","):
        Hk, Hv, D = SHAPES[name]
        for n, L in cases:
            if args.once:
                if L > gpu_gdn.FRESH_PADDED_MAX_ROWS:
                    print(f"{name:5s} {n:3d} x {L:3d} past the path's limit (--max-rows)")
                    continue
                a = inputs(n, L, Hk, Hv, D, seed=0)
                ref = fla.gdn_padded(*a).float()
                d = (fla.gdn_fresh_padded(*a).float() - ref).abs().max().item()
                torch.cuda.synchronize()
                print(f"{name:5s} {n:3d} x {L:3d} solve + our outputs, once: {d:.2e}", flush=True)
                continue
            layers = [inputs(n, L, Hk, Hv, D, seed=i) for i in range(LAYERS)]
            t_fla = per_layer_us(fla.gdn_padded, layers)
            steps = "-"
            diff = ""
            if L <= gpu_gdn.RECURRENT_MAX_ROWS:
                t = per_layer_us(gpu_gdn.gdn_padded, layers)
                steps = f"{t:9.1f}"
                a = layers[0]
                o1 = fla.gdn_padded(*a).float()
                o2 = gpu_gdn.gdn_padded(*a)
                diff = f"{(o1 - o2).abs().max().item():.2e}"
            print(f"{name:5s} {n:3d} x {L:3d} {t_fla:8.1f} {steps:>9s}  {diff}", flush=True)
            if args.fused and L <= 32:
                fn = gpu_gdn.gdn_fresh_chunk
                t = per_layer_us(fn, layers)
                d = (fla.gdn_padded(*layers[0]).float() - fn(*layers[0])).abs().max().item()
                print(f"      fused chunk: {t:8.1f} us  {d:.2e}")
            if args.solve and L <= gpu_gdn.FRESH_PADDED_MAX_ROWS:
                fn = fla.gdn_fresh_padded
                t = per_layer_us(fn, layers)
                d = (fla.gdn_padded(*layers[0]).float() - fn(*layers[0]).float()).abs().max()
                print(f"      FLA solve + our outputs: {t:8.1f} us  {d.item():.2e}")
            for c in chunks:
                fn = functools.partial(fla.gdn_padded, chunk_size=c)
                t = per_layer_us(fn, layers)
                d = (fla.gdn_padded(*layers[0]).float() - fn(*layers[0]).float()).abs().max().item()
                print(f"      FLA chunk {c:3d}: {t:8.1f} us  {d:.2e}")
            for launch in launches:
                fn = functools.partial(steps_at, launch)
                t = per_layer_us(fn, layers)
                a = layers[0]
                d = (fla.gdn_padded(*a).float() - fn(*a)).abs().max().item()
                print(f"      steps {launch[0]} warps x {launch[1]:3d}: {t:8.1f} us  {d:.2e}")
            del layers
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
