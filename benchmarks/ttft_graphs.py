"""Engine TTFT with and without CUDA graphs of fresh prefills, on a random-weight model at a real
shape (GPU only).

    python benchmarks/ttft_graphs.py --shape 2b

For each setting (eager prefill; prefill graphs; and continuation graphs too): engine start
time (warm-up and graph capture), server-side TTFT (submit -> first token, 1 stream) for 14- and
31-token prompts that miss the prompt cache (median of 5 distinct prompts after one unmeasured
one), and for a new turn: a 300-token history already cached, then the history + 24 new tokens
(median of 5 after one unmeasured). Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import _tokenizer, config, distinct_prompts, engine_ttft, random_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="2b")
    ap.add_argument("--format", default="bf16", choices=["bf16", "4bit"])
    ap.add_argument(
        "--settings", default="0,1,2", help="which settings (0 eager, 1 graphs, 2 + continuations)"
    )
    args = ap.parse_args()
    from headstart.engine.config import CacheConfig, EngineConfig, GraphConfig
    from headstart.engine.engine import Engine
    from headstart.models.qwen35.model import Qwen35Model

    quant = args.format == "4bit"
    cfg = config(args.shape, quant)
    gen = torch.Generator(device="cuda").manual_seed(0)
    model = Qwen35Model(cfg, random_weights(cfg, quant, gen), torch.bfloat16, "cuda")
    rows = []
    settings = (
        ("eager prefill", 0, False),
        ("prefill graphs", 64, False),
        ("+ continuation graphs", 64, True),
    )
    picked = [settings[int(i)] for i in args.settings.split(",")]
    for label, tokens, continuations in picked:
        t0 = time.perf_counter()
        engine = Engine(
            model,
            _tokenizer(),
            (),
            EngineConfig(
                16,
                4096,
                cache=CacheConfig(bytes=8 << 30),
                graphs=GraphConfig(prefill_tokens=tokens, continuations=continuations),
            ),
        )
        row = {"setting": label, "start_s": time.perf_counter() - t0}
        engine.start()
        try:
            for length in (14, 31):  # misses: every prompt new
                engine_ttft(engine, distinct_prompts(1, length, 500 + length), repeat=1)
                # One at a time: submitted together, the five would be one batched prefill.
                row[f"ttft{length}_ms"] = 1e3 * statistics.median(
                    engine_ttft(engine, distinct_prompts(1, length, length * 10 + r), repeat=1)
                    for r in range(5)
                )
            # A growing conversation: a 300-token history in the cache, then 24 new tokens.
            hits = []
            for r in range(6):
                history = distinct_prompts(1, 300, 900 + r)[0]
                engine_ttft(engine, [history], repeat=1)
                turn = history + distinct_prompts(1, 24, 700 + r)[0]
                hits.append(engine_ttft(engine, [turn], repeat=1))
            row["ttft_turn_ms"] = 1e3 * statistics.median(hits[1:])
        finally:
            engine.stop()
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engine
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()} {args.shape} {args.format}")
    print(
        f"{'setting':<22} {'start s':>8} {'TTFT 14 ms':>11} {'TTFT 31 ms':>11} {'new turn ms':>12}"
    )
    for r in rows:
        print(
            f"{r['setting']:<22} {r['start_s']:>8.1f} {r['ttft14_ms']:>11.2f} "
            f"{r['ttft31_ms']:>11.2f} {r['ttft_turn_ms']:>12.2f}"
        )


if __name__ == "__main__":
    main()
