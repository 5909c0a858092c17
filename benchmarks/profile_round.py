"""Where a speculative round's device time goes, kernel by kernel (GPU): the default model (or
``--model``) and its drafter, one stream, the engine's graphs replayed under ``torch.profiler``.

    python benchmarks/profile_round.py [--model DIR] [--top 25]

For each graph (a plain decode step, a verify window of the drafter's block, a drafter
proposal, a whole greedy round): wall time per replay (host included, mean of 200), the sum of
its kernels' times, how many kernels it launches, and its kernels by name. On a model this
small every kernel is a few microseconds, so launches are what a round costs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def wall_ms(fn, reps: int = 200) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(ROOT / "src/headstart/default_model"))
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()

    from profile_decode import kernels_per_call

    from headstart.engine.config import EngineConfig, SpecConfig
    from headstart.engine.engine import Engine
    from headstart.engine.spec.drafter import DFlashDrafter
    from headstart.models.qwen35.model import Qwen35Model
    from headstart.tokenizer import Tokenizer

    target = Qwen35Model.load(a.model, dtype=torch.bfloat16, device="cuda")
    drafter = DFlashDrafter.load(Path(a.model) / "drafter", target)
    block = drafter.cfg.block_size
    tok = Tokenizer.from_dir(a.model)
    e = Engine(target, tok, (), EngineConfig(1, 512, spec=SpecConfig(mode="chain")), drafter)
    r, s = e.runner, e.runner.scratch
    calls = {
        "decode step": lambda: r.decode_graphs.run([0], [1], [s]),
        f"verify window ({block} rows)": lambda: r.window_graphs.run([[0] * block], [1], [s]),
        "drafter proposal": lambda: e.spec.graphs.run([s], [0], [1]),
        "whole round": lambda: r.round_graphs.run([s], [0], [1], [1]),
    }
    summary = []
    for name, fn in calls.items():
        ms = wall_ms(fn)
        by_name = kernels_per_call(fn)
        total = sum(v[0] for v in by_name.values())
        count = sum(v[1] for v in by_name.values())
        summary.append((name, ms, total / 1e3, count))
        print(f"## {name}: wall {ms:.3f} ms, kernels {total / 1e3:.3f} ms in {count:.0f}")
        for kname, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: a.top]:
            print(f"    {c:5.0f}x {t:8.1f} us  {kname[:100]}")
    print("| graph, 1 stream | wall ms | kernel ms | kernels |")
    print("|---|---:|---:|---:|")
    for name, ms, kms, count in summary:
        print(f"| {name} | {ms:.3f} | {kms:.3f} | {count:.0f} |")


if __name__ == "__main__":
    main()
