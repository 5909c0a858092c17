"""The "auto" planner against plain decode, three times back to back: greedy, the default model
and its drafter, the 16 prompts of ``python -m training.evaluate`` (first 64 tokens of held-out
rows), 64 new tokens each, one stream, through ``training.drafter.evaluate_acceptance``.

    PYTHONPATH=. python benchmarks/auto_planner.py [--device cpu] [--runs 3]

Prints each run's times and speed-up, then the best plain time over the best drafting time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(ROOT / "src/headstart/default_model"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from headstart.tokenizer import Tokenizer
    from training.data import evaluation_rows
    from training.drafter import evaluate_acceptance

    tok = Tokenizer.from_dir(a.model)
    prompts = [r[:64].tolist() for r in evaluation_rows(tok, 256, 256)[:16]]
    runs = []
    for _ in range(a.runs):
        r = evaluate_acceptance(
            a.model, Path(a.model) / "drafter", prompts, 64, device=a.device, spec_mode="auto"
        )
        runs.append(r)
        keys = ("plain_s", "spec_s", "speedup", "rounds", "mean_accepted_length")
        print(json.dumps({k: r[k] for k in keys}), flush=True)
    best = min(r["plain_s"] for r in runs) / min(r["spec_s"] for r in runs)
    print(f"best of {a.runs}: {best:.2f}x")


if __name__ == "__main__":
    main()
