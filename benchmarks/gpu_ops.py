"""Microbenchmarks of the GPU kernels (H200-sized shapes of Qwen3.5-27B), against their floors.

Prints the measured device-to-device copy bandwidth (bytes read + bytes written over time, the
convention of the device notes), then:

* 4-bit quant_matmul for the 27B projections at M = 1, 4, 16: our kernel, torch's dequantize +
  matmul, torch's int4 tinygemm (``_weight_int4pack_mm``, if this torch has it), bf16 cuBLAS on the
  unquantized weight, and the floor = (packed words + scales + biases) / copy bandwidth.
  A small config sweep runs first; the table uses the best config per M class.
* decode_attention at n = 16 streams, lengths 512 and 8192 (floor = K+V bytes / bandwidth), with
  the reference path (gather the slots' rows + attend_decode) for comparison.
* gdn_decode for 48 layers of 27B state at n = 1 and 16 (floor = state read + write / bandwidth):
  one layer alone, and all 48 layers replayed from a CUDA graph.

Times are medians of ``triton.testing.do_bench`` (which flushes the L2 before every run, so the
weights come from HBM as in a real decode step). The last lines are a short aligned table.

    PYTHONPATH=src python benchmarks/gpu_ops.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from headstart.ops.attention import attend_decode  # noqa: E402
from headstart.ops.decode_attention import decode_attention  # noqa: E402
from headstart.ops.gpu_gdn import gdn_decode  # noqa: E402
from headstart.ops.quant_matmul import QmmConfig, prepare, quant_matmul  # noqa: E402
from headstart.quant import QuantizedTensor, dequantize  # noqa: E402

DEV = torch.device("cuda")
SHAPES_27B = {  # name: (N out, K in)
    "q_proj": (12288, 5120),
    "in_proj_qkv": (10240, 5120),
    "mlp_gate_up": (17408, 5120),
    "mlp_down": (5120, 17408),
    "o_proj": (5120, 6144),
}
MS = (1, 4, 16)


def bench(fn, rep: int = 60) -> float:
    """Median microseconds."""
    return do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


def copy_bandwidth() -> float:
    n = 1 << 30  # 2 GiB of bf16 each way
    a = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    us = bench(lambda: b.copy_(a), rep=200)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / (us * 1e-6) / 1e9  # GB/s, read + write


def random_qt(n: int, k: int, group: int = 64) -> QuantizedTensor:
    """Random codes and bf16 scales/biases (values are irrelevant to speed; never zeros)."""
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=DEV)
    scales = (torch.rand(n, k // group, device=DEV) * 0.01 + 1e-3).to(torch.bfloat16)
    biases = (torch.randn(n, k // group, device=DEV) * 0.05).to(torch.bfloat16)
    return QuantizedTensor(packed, scales, biases, 4, group)


class Rotating:
    """Call ``fn(item)`` on the next of several copies, so repeated runs cannot live in L2."""

    def __init__(self, items, fn):
        self.items, self.fn, self.i = items, fn, 0

    def __call__(self):
        self.i = (self.i + 1) % len(self.items)
        return self.fn(self.items[self.i])


def torch_int4_fn(n: int, k: int, group: int, x: torch.Tensor):
    if not hasattr(torch, "_weight_int4pack_mm"):
        return None
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=DEV)
    w_u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    for tiles in (8, 4, 2):
        try:
            packed = torch._convert_weight_to_int4pack(w_u8, tiles)
            sz = torch.randn(k // group, n, 2, device=DEV).to(torch.bfloat16)
            torch._weight_int4pack_mm(x, packed, group, sz)
            return lambda: torch._weight_int4pack_mm(x, packed, group, sz)
        except (RuntimeError, TypeError) as e:  # API or shape not supported here
            err = e
    print(f"  torch int4 unavailable: {str(err).splitlines()[0][:100]}")
    return None


SWEEP = {
    "bn64w8": QmmConfig(block_n=64, num_warps=8, prefetch=False, ctas_per_sm=4),
    "bn64w8pf": QmmConfig(block_n=64, num_warps=8, prefetch=True, ctas_per_sm=4),
    "bn64w8c8": QmmConfig(block_n=64, num_warps=8, prefetch=False, ctas_per_sm=8),
    "bn64w8c2": QmmConfig(block_n=64, num_warps=8, prefetch=False, ctas_per_sm=2),
    "bn64w4": QmmConfig(block_n=64, num_warps=4, prefetch=False, ctas_per_sm=4),
    "bn32w4pf": QmmConfig(block_n=32, num_warps=4, prefetch=True, ctas_per_sm=4),
    "bn128w8": QmmConfig(block_n=128, num_warps=8, prefetch=False, ctas_per_sm=4),
    "fma64w8": QmmConfig(block_n=64, num_warps=8, prefetch=False, use_dot=False),
    "fma64w8pf": QmmConfig(block_n=64, num_warps=8, prefetch=True, use_dot=False),
}


def bench_matmul(bw: float, quick: bool) -> list[dict]:
    rows = []
    sweep = {} if quick else SWEEP
    sweep_times: dict[tuple[str, int], list[float]] = {}
    for name, (n, k) in SHAPES_27B.items():
        qts = [random_qt(n, k) for _ in range(2)]  # do_bench flushes L2; 2 copies anyway
        nbytes = qts[0].nbytes()
        floor = nbytes / (bw * 1e9) * 1e6
        preps = [prepare(qt) for qt in qts]
        w16 = qts[0].dequantize(torch.bfloat16)
        for m in MS:
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            res = {"shape": name, "N": n, "K": k, "M": m, "bytes": nbytes, "floor_us": floor}
            for cname, cfg in sweep.items():
                if not cfg.use_dot and m > 1:
                    continue
                t = bench(Rotating(preps, lambda p, cfg=cfg: quant_matmul(x, p, cfg)))
                sweep_times.setdefault((cname, 1 if m == 1 else 16), []).append(t / floor)
                res[f"cfg_{cname}"] = t
            res["ours_us"] = bench(Rotating(preps, lambda p: quant_matmul(x, p)))
            res["torch_deq_mm_us"] = bench(
                lambda: x @ dequantize(qts[0].packed, qts[0].scales, qts[0].biases, 4, 64,
                                       torch.bfloat16).T, rep=30)
            f4 = torch_int4_fn(n, k, 64, x)
            res["torch_int4_us"] = bench(f4) if f4 else float("nan")
            res["bf16_cublas_us"] = bench(lambda: x @ w16.T)
            res["ratio"] = res["ours_us"] / floor
            rows.append(res)
            print(f"  {name:12s} M={m:2d} ours {res['ours_us']:7.1f} us  floor {floor:6.1f}"
                  f"  ratio {res['ratio']:.2f}  int4 {res['torch_int4_us']:7.1f}"
                  f"  deq+mm {res['torch_deq_mm_us']:7.1f}  bf16 {res['bf16_cublas_us']:7.1f}"
                  + "".join(f"  {c}={res[f'cfg_{c}']:.1f}" for c in sweep
                            if f"cfg_{c}" in res), flush=True)
        del qts, preps, w16
        torch.cuda.empty_cache()
    if sweep_times:
        print("config sweep: geometric-mean ratio to floor (M=1 | M=4,16)")
        for cname in sweep:
            r1 = sweep_times.get((cname, 1), [])
            r16 = sweep_times.get((cname, 16), [])
            gm = lambda v: math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")  # noqa
            print(f"  {cname:10s} {gm(r1):5.2f} | {gm(r16):5.2f}")
    return rows


def bench_attention(bw: float) -> list[dict]:
    rows = []
    n, nh, nkv, hd, max_tokens = 16, 24, 4, 256, 32768
    keys = torch.randn(n, nkv, max_tokens, hd, device=DEV).to(torch.bfloat16)
    values = torch.randn(n, nkv, max_tokens, hd, device=DEV).to(torch.bfloat16)
    q = torch.randn(n, nh, hd, device=DEV).to(torch.bfloat16)
    slots = torch.arange(n, device=DEV)
    for length in (512, 8192):
        lengths = torch.full((n,), length, device=DEV, dtype=torch.int32)
        nbytes = 2 * n * nkv * length * hd * 2
        floor = nbytes / (bw * 1e9) * 1e6
        ours = bench(lambda: decode_attention(q, keys, values, slots, lengths))
        ref = bench(lambda: attend_decode(q, keys[slots, :, :length], values[slots, :, :length],
                                          lengths), rep=30)
        rows.append({"n": n, "length": length, "ours_us": ours, "floor_us": floor,
                     "ratio": ours / floor, "torch_ref_us": ref})
        print(f"  attention n={n} len={length}: ours {ours:.1f} us floor {floor:.1f} "
              f"ratio {ours / floor:.2f}  torch gather+attend {ref:.1f} us", flush=True)
    del keys, values
    torch.cuda.empty_cache()
    return rows


def bench_gdn(bw: float) -> list[dict]:
    rows = []
    layers, Hk, Hv, D = 48, 16, 48, 128
    for n in (1, 16):
        pool = torch.randn(layers, n, Hv, D, D, device=DEV) * 0.1
        q = torch.randn(n, Hk, D, device=DEV).to(torch.bfloat16)
        k = torch.randn(n, Hk, D, device=DEV).to(torch.bfloat16)
        v = torch.randn(n, Hv, D, device=DEV).to(torch.bfloat16)
        g = -torch.rand(n, Hv, device=DEV)
        beta = torch.rand(n, Hv, device=DEV).to(torch.bfloat16)
        slots = torch.arange(n, device=DEV)
        fresh = torch.zeros(n, dtype=torch.bool, device=DEV)
        per_layer_bytes = 2 * n * Hv * D * D * 4
        floor1 = per_layer_bytes / (bw * 1e9) * 1e6
        one = bench(Rotating(list(range(layers)),
                             lambda i: gdn_decode(q, k, v, g, beta, slots, fresh, pool[i])))

        def all_layers():
            for i in range(layers):
                gdn_decode(q, k, v, g, beta, slots, fresh, pool[i])

        all_layers()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            all_layers()
        total = bench(graph.replay)
        eager = bench(all_layers)
        rows.append({"n": n, "layer_us": one, "floor_layer_us": floor1, "graph48_us": total,
                     "eager48_us": eager, "floor48_us": floor1 * layers,
                     "ratio": total / (floor1 * layers)})
        print(f"  gdn decode n={n}: one layer {one:.1f} us (floor {floor1:.1f}); 48 layers graph "
              f"{total:.1f} us, eager {eager:.1f} us (floor {floor1 * layers:.1f})", flush=True)
        del pool
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the config sweep")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "gpu_ops.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    bw = copy_bandwidth()
    print(f"copy bandwidth (read + write): {bw:.0f} GB/s", flush=True)
    mm = bench_matmul(bw, args.quick)
    att = bench_attention(bw)
    gdn = bench_gdn(bw)
    try:
        Path(args.json).write_text(json.dumps({"copy_GBps": bw, "matmul": mm, "attention": att,
                                               "gdn": gdn}, indent=1))
    except OSError:
        pass

    print(f"\ncopy bandwidth {bw:.0f} GB/s; times in us (median, cold L2); ratio = ours / floor")
    print(f"{'matmul 4-bit g64':17s} {'M':>2s} {'ours':>7s} {'floor':>6s} {'ratio':>5s} "
          f"{'int4':>7s} {'deq+mm':>7s} {'bf16':>7s}")
    for r in mm:
        print(f"{r['shape'] + ' ' + str(r['N']) + 'x' + str(r['K']):17.17s} {r['M']:2d} "
              f"{r['ours_us']:7.1f} {r['floor_us']:6.1f} {r['ratio']:5.2f} "
              f"{r['torch_int4_us']:7.1f} {r['torch_deq_mm_us']:7.1f} {r['bf16_cublas_us']:7.1f}")
    for r in att:
        print(f"attention n={r['n']} len={r['length']:<5d}   {r['ours_us']:7.1f} "
              f"{r['floor_us']:6.1f} {r['ratio']:5.2f}  torch ref {r['torch_ref_us']:.1f}")
    for r in gdn:
        print(f"gdn decode n={r['n']:<2d} x48 (graph) {r['graph48_us']:7.1f} "
              f"{r['floor48_us']:6.1f} {r['ratio']:5.2f}  eager {r['eager48_us']:.1f}, "
              f"one layer {r['layer_us']:.1f}")


if __name__ == "__main__":
    main()
