"""Where a speculative round's time goes on the engine thread: greedy decode of held-out prompts
through headstart's Engine, plain and with a drafter (chain mode), one stream; wall time per
plain step and per round, then the engine thread's profile of the drafting run (cProfile
inside ``Engine._step``: host time, including waits for the GPU where the host reads a result).

    python benchmarks/spec_round.py --data .work/sweep.json --drafter DIR [--model DIR]

``--data``: a ``benchmarks/drafter_sweep.py prep`` file (its held-out prompts).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(ROOT / "src/headstart/default_model"))
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()

    from headstart.engine.config import EngineConfig, SpecConfig
    from headstart.engine.engine import Engine
    from headstart.engine.spec.drafter import DFlashDrafter
    from headstart.loading import load, resolve_device
    from headstart.sampling import SamplingParams
    from training.drafter import _run_engine

    prompts = json.loads(Path(a.data).read_text())["eval_prompts"]
    loaded = load(a.model, resolve_device("auto"))
    target, tok = loaded.model, loaded.tokenizer
    drafter = DFlashDrafter.load(a.drafter, target)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    context = max(map(len, prompts)) + a.max_tokens + drafter.cfg.block_size + 1
    profile = cProfile.Profile()
    rows = []
    for name, d in (("plain", None), ("chain", drafter)):
        spec = SpecConfig(draft_block=drafter.cfg.block_size, mode="chain")
        engine = Engine(target, tok, (), EngineConfig(1, context, spec=spec), drafter=d)
        engine.start()
        try:
            _run_engine(engine, prompts[:2], params)  # first use
            steps0 = engine.steps
            if d is not None:
                step = engine._step

                def profiled(work, step=step):
                    profile.enable()
                    try:
                        return step(work)
                    finally:
                        profile.disable()

                engine._step = profiled
            outputs, seconds = _run_engine(engine, prompts, params)
            stats = engine.stats()
            steps = engine.steps - steps0
        finally:
            engine.stop()
        tokens = sum(map(len, outputs))
        rows.append((name, tokens, seconds, steps, stats["spec_rounds"], stats["spec_accepted"]))
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(a.top)
    print(out.getvalue())
    print(f"device {target.device}, {len(prompts)} prompts x {a.max_tokens} tokens, 1 stream")
    print("| run | tokens | s | steps | ms a step | rounds | accepted a round | tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, tokens, s, steps, rounds, acc in rows:
        per = acc / rounds + 1 if rounds else 1.0
        print(
            f"| {name} | {tokens} | {s:.2f} | {steps} | {1e3 * s / steps:.2f} | {rounds} "
            f"| {per:.2f} | {tokens / s:.0f} |"
        )


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
