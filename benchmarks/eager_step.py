"""Host cost of an eager (not graph-replayed) forward: a decode step and a 512-token prefill,
with the weight arena on/off and programmatic dependent launch on/off (GPU).

Eager forwards are what prefills of more than the captured shapes, and steps without graphs,
pay: their time is mostly Python and kernel-launch cost, not GPU work.

    python benchmarks/eager_step.py --shape 27b --format 4bit --layers 16
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import config, cuda_time, random_weights

from headstart.batch import ForwardBatch, SeqChunk
from headstart.models.qwen35.model import Qwen35Model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27b")
    ap.add_argument("--format", default="4bit", choices=["bf16", "4bit"])
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    quant = args.format == "4bit"
    cfg = config(args.shape, quant)
    cfg = replace(cfg, num_hidden_layers=args.layers, layer_types=cfg.layer_types[: args.layers])
    lines = []
    for arena in (True, False):
        gen = torch.Generator(device="cuda").manual_seed(0)
        model = Qwen35Model(
            cfg, random_weights(cfg, quant, gen), torch.bfloat16, "cuda", arena=arena
        )
        pool = model.new_state_pool(2, 1024)
        model.forward(ForwardBatch.build([SeqChunk(0, 0, tuple(range(5, 105)))], "cuda"), pool)
        step = ForwardBatch.build([SeqChunk(0, 100, (7,))], "cuda")
        prefill = ForwardBatch.build([SeqChunk(1, 0, tuple(range(3, 515)))], "cuda")
        for flag in ("0", "1"):
            os.environ["HEADSTART_PDL"] = flag
            t_step = cuda_time(lambda m=model, b=step, p=pool: m.forward(b, p), reps=10)
            t_pre = cuda_time(lambda m=model, b=prefill, p=pool: m.forward(b, p), reps=5)
            lines.append(
                f"{args.format} layers={args.layers} arena={arena} pdl={flag}: "
                f"eager step {t_step * 1e3:.2f} ms, prefill 512 {t_pre * 1e3:.2f} ms"
            )
            print(lines[-1], flush=True)
        del model, pool
        torch.cuda.empty_cache()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
