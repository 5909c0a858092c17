"""Greedy decode with the default model's drafter on the GPU: rounds judged on the host against
whole device rounds (engine/spec/round.py), beside plain decode; then what one replay of each
graph costs (a plain decode step, a whole round), the device's own time per call.

    python benchmarks/whole_rounds.py [--model DIR] [--corpus DIR] [--prompts 16]

Prompts: the first 64 tokens of the held-out rows ``training.evaluate --ppl-rows 64`` takes
(``--corpus``: an unpacked ``training.data --tar`` copy). One stream, ``--max-tokens`` each,
EOS ignored; the engine as ``training.drafter.evaluate_acceptance`` builds it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def replay_costs(model_dir: str, block: int) -> dict[str, float]:
    """Milliseconds per call, averaged over 200 after a warm-up: a 1-stream decode graph
    replay, a 1-stream whole round (host input copy, replay, read-back), host included."""
    from headstart.engine.config import EngineConfig, SpecConfig
    from headstart.engine.engine import Engine
    from headstart.engine.spec.drafter import DFlashDrafter
    from headstart.models.qwen35.model import Qwen35Model
    from headstart.tokenizer import Tokenizer

    target = Qwen35Model.load(model_dir, dtype=torch.bfloat16, device="cuda")
    drafter = DFlashDrafter.load(Path(model_dir) / "drafter", target)
    tok = Tokenizer.from_dir(model_dir)
    e = Engine(target, tok, (), EngineConfig(1, 512, spec=SpecConfig(mode="chain")), drafter)
    r, s = e.runner, e.runner.scratch
    out = {}
    calls = {
        "decode graph, 1 stream": lambda: r.decode_graphs.run([0], [1], [s]),
        "window graph, 1 stream": lambda: r.window_graphs.run([[0] * block], [1], [s]),
        "draft graph, 1 stream": lambda: e.spec.graphs.run([s], [0], [1]),
        "whole round, 1 stream": lambda: r.round_graphs.run([s], [0], [1], [1]),
    }
    for name, fn in calls.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t0) / 200 * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(ROOT / "src/headstart/default_model"))
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    if a.corpus:
        os.environ["HEADSTART_CORPUS"] = a.corpus

    from headstart.tokenizer import Tokenizer
    from training.data import evaluation_rows
    from training.drafter import evaluate_acceptance

    tok = Tokenizer.from_dir(a.model)
    prompts = [row[:64].tolist() for row in evaluation_rows(tok, 256, 64)[: a.prompts]]
    rows = []
    for mode, whole in (("chain", False), ("chain", True), ("auto", False), ("auto", True)):
        r = evaluate_acceptance(
            a.model,
            Path(a.model) / "drafter",
            prompts,
            a.max_tokens,
            device="cuda",
            dtype=torch.bfloat16,
            strict=False,
            spec_mode=mode,
            whole_rounds=whole,
        )
        rows.append((mode, whole, r))
    block = rows[0][2]["block"]
    costs = replay_costs(a.model, block)
    print(f"{len(prompts)} prompts x {a.max_tokens} tokens, 1 stream, greedy, block {block}")
    print(
        "| mode | whole rounds | tokens/round | rounds | plain s | drafting s | speed-up "
        "| mismatches |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for mode, whole, r in rows:
        print(
            f"| {mode} | {'yes' if whole else 'no'} | {r['mean_accepted_length']:.2f} "
            f"| {r['rounds']} | {r['plain_s']:.3f} | {r['spec_s']:.3f} | {r['speedup']:.2f}x "
            f"| {r['mismatches']} |"
        )
    print("| call | ms |")
    print("|---|---:|")
    for name, ms in costs.items():
        print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()
