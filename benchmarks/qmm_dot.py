"""The 4-bit matmul at 17..64 rows: the MMA kernel (``quant_matmul``, the default) against the
dot kernel (``ops/quant_matmul/triton_dot.py``) over its launch options, at the 27B
projections (GPU only; random weights, cold L2: CUDA-graph replay over weight copies, as
``benchmarks/gpu_ops.py`` times them).

    python benchmarks/qmm_dot.py [--ms 31] [--shapes q_proj,mlp_down] [--bn 128,256]
        [--warps 4,8] [--stages 2,3,4] [--pps 1,2,4] [--deq 1,0] [--json PATH]

Prints one line per (shape, M, option set) whose time is within 25% of the best, then a table:
per shape and M, the MMA kernel, the best dot option and the floor (bytes / copy bandwidth).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_ops import SHAPES_27B, bench_graph, copies_for, copy_bandwidth, random_qt, rel_err

from headstart.ops.quant_matmul.triton import prepare, quant_matmul
from headstart.ops.quant_matmul.triton_dot import quant_matmul_dot

DEV = torch.device("cuda")


def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="31")
    ap.add_argument("--shapes", default=",".join(SHAPES_27B))
    ap.add_argument("--bn", default="128,256")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--pps", default="1,2,4")
    ap.add_argument("--deq", default="1,0")
    ap.add_argument("--json", default="", help="write every timing here")
    args = ap.parse_args()
    timings = []
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s, {torch.cuda.get_device_name()}", flush=True)
    table = []
    for name in args.shapes.split(","):
        n, k = SHAPES_27B[name]
        qts = [random_qt(n, k) for _ in range(copies_for(random_qt(n, k).nbytes()))]
        floor = qts[0].nbytes() / (bw * 1e9) * 1e6
        w_ref = qts[0].dequantize(torch.float32)
        preps = {bn: [prepare(qt, block_n=bn) for qt in qts] for bn in ints(args.bn)}
        ours = preps.get(128) or [prepare(qt) for qt in qts]
        del qts
        for m in ints(args.ms):
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            y_ref = x.float() @ w_ref.T
            t_mma = bench_graph([lambda p=p: quant_matmul(x, p) for p in ours])
            found = []
            opts = itertools.product(
                ints(args.bn), ints(args.warps), ints(args.stages), ints(args.pps), ints(args.deq)
            )
            for bn, w, st, pps, deq in opts:
                kw = dict(deq=bool(deq), programs_per_sm=pps, num_warps=w, num_stages=st)
                ys = [torch.empty(m, n, dtype=x.dtype, device=DEV) for _ in preps[bn]]
                try:
                    quant_matmul_dot(x, preps[bn][0], ys[0], **kw)
                except Exception as e:  # a config that does not compile
                    print(f"  {name} bn{bn} w{w} s{st}: {type(e).__name__} {str(e)[:80]}")
                    continue
                err = rel_err(ys[0], y_ref)
                t = bench_graph(
                    [
                        lambda p=p, y=y, kw=kw: quant_matmul_dot(x, p, y, **kw)
                        for p, y in zip(preps[bn], ys, strict=True)
                    ]
                )
                found.append((t, f"bn{bn} w{w} s{st} pps{pps} deq{deq}", err))
                timings.append({"shape": name, "m": m, "bn": bn, **kw, "us": t, "mma_us": t_mma})
            found.sort()
            best = found[0][0] if found else float("nan")
            for t, label, err in found:
                if t <= 1.25 * best:
                    print(f"  {name:12s} M={m:2d} {label:28s} {t:6.1f} us  err {err:.1e}")
            err_mma = rel_err(quant_matmul(x, ours[0]), y_ref)
            table.append((name, m, t_mma, err_mma, *(found[0] if found else ("-", "-", 0)), floor))
            print(f"  {name:12s} M={m:2d} mma {t_mma:6.1f} us  floor {floor:5.1f}", flush=True)
        del preps, ours, w_ref
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(timings))
    print(f"{'shape':12s} {'M':>3s} {'mma us':>7s} {'dot us':>7s} {'floor':>6s}  best dot option")
    for name, m, t_mma, e1, t_dot, label, e2, floor in table:
        print(
            f"{name:12s} {m:3d} {t_mma:7.1f} {t_dot:7.1f} {floor:6.1f}  {label} "
            f"(err {e1:.1e} / {e2:.1e})"
        )


if __name__ == "__main__":
    main()
