"""Run the 4-bit matmul at one 27B shape a few times (a target for ``ncu``).

    ncu -k regex:_mma_kernel -c 3 python benchmarks/qmm_one.py --n 12288 --k 5120 --m 31 \
        --cfg mma_rows=32,dequant_a=1
"""

from __future__ import annotations

import argparse

import torch

from headstart.ops.quant_matmul.triton import QmmConfig, prepare, quant_matmul
from headstart.quant import QuantizedTensor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=12288)
    ap.add_argument("--k", type=int, default=5120)
    ap.add_argument("--m", type=int, nargs="+", default=[31])
    ap.add_argument("--cfg", default="", help="QmmConfig fields, e.g. mma_rows=32,dequant_a=1")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n, k = args.n, args.k
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=dev)
    scales = (torch.rand(n, k // 64, device=dev) * 0.01 + 1e-3).to(torch.bfloat16)
    biases = (torch.randn(n, k // 64, device=dev) * 0.05).to(torch.bfloat16)
    p = prepare(QuantizedTensor(packed, scales, biases, 4, 64))
    fields = dict(kv.split("=") for kv in args.cfg.split(",") if kv)
    cfg = QmmConfig(**{k: type(getattr(QmmConfig(), k))(int(v)) for k, v in fields.items()})
    for m in args.m:
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        for _ in range(args.calls):
            quant_matmul(x, p, cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
