"""Greedy decode with the default model's drafter on the GPU: rounds judged on the host against
whole device rounds (engine/spec/round.py), beside plain decode; then what one call of each
graph costs (a plain decode step, a window, a proposal, a whole round), host and device time.

    python benchmarks/whole_rounds.py [--model DIR] [--corpus DIR] [--prompts 16]

Each row runs in a process of its own. Prompts: the first 64 tokens of the held-out rows that
``training.evaluate --ppl-rows 64`` takes (``--corpus``: an unpacked ``training.data --tar``
copy). One stream, ``--max-tokens`` each, EOS ignored; the engines as
``training.drafter.evaluate_acceptance`` builds them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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


ROWS = ("chain:host", "chain:whole", "auto:host", "auto:whole", "costs")


def measure(row: str, a: argparse.Namespace) -> dict:
    """One row of the tables, in this process."""
    from headstart.tokenizer import Tokenizer
    from training.data import evaluation_rows
    from training.drafter import evaluate_acceptance

    if row == "costs":
        return replay_costs(a.model, a.block)
    mode, where = row.split(":")
    tok = Tokenizer.from_dir(a.model)
    prompts = [r[:64].tolist() for r in evaluation_rows(tok, 256, 64)[: a.prompts]]
    return evaluate_acceptance(
        a.model,
        Path(a.model) / "drafter",
        prompts,
        a.max_tokens,
        device="cuda",
        dtype=torch.bfloat16,
        strict=False,
        spec_mode=mode,
        whole_rounds=where == "whole",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(ROOT / "src/headstart/default_model"))
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--only", choices=ROWS, help="one row, printed as JSON (a subprocess)")
    ap.add_argument("--rows", default=",".join(ROWS), help="which rows, comma-separated")
    a = ap.parse_args()
    if a.corpus:
        os.environ["HEADSTART_CORPUS"] = a.corpus
    if a.only:
        print("ROW " + json.dumps(measure(a.only, a)))
        return
    results = {}
    for row in a.rows.split(","):  # each in its own process: one engine's failure leaves the others
        args = [sys.executable, __file__, "--only", row, "--model", a.model]
        args += ["--prompts", str(a.prompts), "--max-tokens", str(a.max_tokens)]
        args += ["--block", str(a.block)] + (["--corpus", a.corpus] if a.corpus else [])
        done = subprocess.run(args, capture_output=True, text=True)
        lines = [x for x in done.stdout.splitlines() if x.startswith("ROW ")]
        if lines:
            results[row] = json.loads(lines[-1][4:])
        else:
            print(f"{row} failed:\n" + "\n".join(done.stderr.splitlines()[-25:]))
    print(f"{a.prompts} prompts x {a.max_tokens} tokens, 1 stream, greedy, block {a.block}:")
    print("| mode | rounds on | tokens/round | rounds | plain s | drafting s | speed-up | differ |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row, r in results.items():
        if row == "costs":
            continue
        mode, where = row.split(":")
        print(
            f"| {mode} | {where} | {r['mean_accepted_length']:.2f} | {r['rounds']} "
            f"| {r['plain_s']:.3f} | {r['spec_s']:.3f} | {r['speedup']:.2f}x "
            f"| {r['mismatches']} |"
        )
    print("| call | ms |")
    print("|---|---:|")
    for name, ms in results.get("costs", {}).items():
        print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()
