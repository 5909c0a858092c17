"""Drafting against plain decode on a CPU, as ``serve`` runs it, several times back to back:
greedy, the default model and its drafter, the 16 prompts of ``python -m training.evaluate``
(first 64 tokens of held-out rows), 64 new tokens each, one stream, through
``training.drafter.evaluate_acceptance``.

    PYTHONPATH=. python benchmarks/auto_planner.py [--modes auto,chain] [--runs 3] [--pairs 1]
        [--eager]

As served: compiled CPU programs (decode steps, prompt windows and verify windows, from
inductor's cache after the first run) and serve's thread counts (decode steps on every core
but one, prompt chunks on all). ``--eager`` instead: eager forwards on ``--threads`` threads
(how the figures before session 24 were taken). Prints each run's times and speed-up per mode,
then per mode the best plain time over its best drafting time. ``--pairs N``: each run keeps
both engines and times them in turn N times (plain, drafting, ...), reporting medians.
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
    ap.add_argument("--modes", default="auto", help="comma-separated: auto, chain, tree")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="eager forwards, torch's threads")
    ap.add_argument("--threads", type=int, default=2, help="with --eager")
    ap.add_argument("--rows", type=int, default=256, help="evaluation_rows' count to pick from")
    ap.add_argument(
        "--pairs", type=int, default=1, help="plain and drafting in turn this many times a run"
    )
    a = ap.parse_args()

    from headstart.engine.config import ThreadConfig
    from headstart.server.serve import cpu_threads, usable_cores
    from headstart.tokenizer import Tokenizer
    from training.data import evaluation_rows
    from training.drafter import evaluate_acceptance

    if a.eager:
        torch.set_num_threads(a.threads)
        served = {}
    else:
        cores = usable_cores()
        torch.set_num_threads(cpu_threads(cores))
        threads = ThreadConfig(decode=cpu_threads(cores), prefill=cores)
        served = {"cpu_programs": True, "threads": threads}
        print(f"as served: compiled programs, {threads}", flush=True)
    tok = Tokenizer.from_dir(a.model)
    prompts = [r[:64].tolist() for r in evaluation_rows(tok, 256, a.rows)[:16]]
    runs: dict[str, list[dict]] = {}
    keys = ("plain_s", "spec_s", "speedup", "rounds", "mean_accepted_length")
    for _ in range(a.runs):
        for mode in a.modes.split(","):
            r = evaluate_acceptance(
                a.model,
                Path(a.model) / "drafter",
                prompts,
                64,
                device=a.device,
                spec_mode=mode,
                pairs=a.pairs,
                **served,
            )
            runs.setdefault(mode, []).append(r)
            print(json.dumps({"mode": mode, **{k: r[k] for k in keys}}), flush=True)
    for mode, rs in runs.items():
        best = min(r["plain_s"] for r in rs) / min(r["spec_s"] for r in rs)
        print(f"{mode}: best of {a.runs}: {best:.2f}x")


if __name__ == "__main__":
    main()
