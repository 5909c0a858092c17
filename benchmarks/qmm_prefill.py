"""The 4-bit matmul at prefill sizes (GPU): the prefill kernel (``ops/quant_matmul/prefill.py``,
each weight tile dequantized in registers) against dequantize + cuBLAS (what runs without dense
copies) and cuBLAS on a dense bf16 copy (the floor this path can reach), at the 27B projections.

    python benchmarks/qmm_prefill.py [--ms 256 496 2048 8192] [--sweep]

Each timing rotates over four copies of the weight (more bytes than L2 holds), as a forward
reads each weight once. ``--sweep`` times every launch config and prints each config's
geometric mean against dequantize + cuBLAS; without it only the default config runs. The last
table: per shape and M, microseconds and TFLOP/s of each path.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from headstart.ops.quant_matmul.prefill import PrefillConfig, prefill_matmul
from headstart.ops.quant_matmul.triton import dequantize_prepared, prepare, quant_matmul
from headstart.quant import QuantizedTensor

SHAPES = {  # the 27B projections: name -> (N out, K in)
    "q_proj": (12288, 5120),
    "in_proj_qkv": (10240, 5120),
    "gate_up": (34816, 5120),
    "down": (5120, 17408),
    "o_proj": (5120, 6144),
}
COPIES = 4


def weight(n: int, k: int, dense: bool):
    dev = torch.device("cuda")
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev)
    scales = (torch.rand(n, k // 64, device=dev) * 0.01 + 1e-3).to(torch.bfloat16)
    biases = (torch.randn(n, k // 64, device=dev) * 0.01).to(torch.bfloat16)
    qt = QuantizedTensor(packed, scales, biases, 4, 64)
    return prepare(qt, dense=torch.bfloat16 if dense else None)


def timed(fns, reps: int = 12) -> float:
    """Median microseconds of one call, cycling through ``fns`` (one per weight copy)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fns[i % len(fns)]()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def configs(sweep: bool) -> list[PrefillConfig]:
    if not sweep:
        return [PrefillConfig()]
    out = []
    for w_as_a, bm, warps, stages in itertools.product((False, True), (64, 128), (4, 8), (3, 4)):
        out.append(PrefillConfig(block_m=bm, num_warps=warps, num_stages=stages, w_as_a=w_as_a))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", type=int, nargs="+", default=[496, 1024, 2048, 8192])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    cfgs = configs(args.sweep)
    ratios: dict[PrefillConfig, list[float]] = {c: [] for c in cfgs}
    rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws = [weight(n, k, dense=(i == 0)) for i in range(COPIES)]
        dense = [ws[0].dense] + [dequantize_prepared(w) for w in ws[1:]]
        for m in args.ms:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            flops = 2 * m * n * k
            t_dense = timed([lambda d=d: x @ d.T for d in dense])
            t_deq = timed([lambda w=w: quant_matmul(x, w) for w in ws[1:]])
            ref = (x.float() @ dense[1].float().T).to(torch.bfloat16).float()
            best = None
            for c in cfgs:
                try:
                    y = prefill_matmul(x, ws[1], c).float()
                    err = ((y - ref).norm() / ref.norm()).item()
                    t = timed([lambda w=w, c=c: prefill_matmul(x, w, c) for w in ws[1:]])
                except Exception as e:  # a config that does not compile (shared memory)
                    print(f"{name} M={m} {c}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                ratios[c].append(t / t_deq)
                if best is None or t < best[0]:
                    best = (t, c, err)
            if best is None:
                continue
            t, c, err = best
            rows.append((name, m, t_dense, t_deq, t, flops, err, c))
            print(
                f"{name:12s} M={m:5d} dense {t_dense:8.1f} us  deq+cublas {t_deq:8.1f}  "
                f"prefill {t:8.1f} ({flops / t / 1e6:5.0f} TFLOP/s, rel err {err:.1e})  {c}",
                flush=True,
            )
        del ws, dense
        torch.cuda.empty_cache()
    if args.sweep:
        print("\nconfig: geometric mean of prefill / (dequantize + cuBLAS), lower is better")
        for c, r in sorted(ratios.items(), key=lambda kv: _gmean(kv[1])):
            print(f"  {_gmean(r):.3f}  ({len(r)} cases)  {c}")
    print(f"\n{torch.cuda.get_device_name()}: microseconds (TFLOP/s)")
    print("| shape | M | dense cuBLAS | dequantize + cuBLAS | prefill kernel |")
    print("|---|---:|---:|---:|---:|")
    for name, m, td, tq, t, flops, _err, _c in rows:
        f = lambda us: f"{us:.1f} ({flops / us / 1e6:.0f})"  # noqa: E731
        print(f"| {name} | {m} | {f(td)} | {f(tq)} | {f(t)} |")
    tot = [sum(r[i] for r in rows) for i in (2, 3, 4)]
    print(f"| all | | {tot[0]:.1f} | {tot[1]:.1f} | {tot[2]:.1f} |")


def _gmean(r: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in r) / len(r)) if r else float("inf")


if __name__ == "__main__":
    main()
