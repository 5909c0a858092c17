"""Engine TTFT with and without CUDA graphs of fresh prefills, on a random-weight model at a real
shape (GPU only).

    python benchmarks/ttft_graphs.py --shape 2b

For each setting: engine start time (warm-up and graph capture), then server-side TTFT (submit
-> first token, 1 stream, prompt-cache misses) for 14- and 31-token prompts, median of 5 after
one unmeasured miss per length. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import _tokenizer, config, distinct_prompts, engine_ttft, random_weights  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="2b")
    ap.add_argument("--format", default="bf16", choices=["bf16", "4bit"])
    args = ap.parse_args()
    from headstart.engine.engine import Engine
    from headstart.model import Qwen35Model

    quant = args.format == "4bit"
    cfg = config(args.shape, quant)
    gen = torch.Generator(device="cuda").manual_seed(0)
    model = Qwen35Model(cfg, random_weights(cfg, quant, gen), torch.bfloat16, "cuda")
    rows = []
    for label, tokens in (("eager prefill", 0), ("prefill graphs", 64)):
        t0 = time.perf_counter()
        engine = Engine(model, _tokenizer(), (), num_slots=16, context=4096,
                        prefill_graph_tokens=tokens)
        row = {"setting": label, "start_s": time.perf_counter() - t0}
        engine.start()
        try:
            for length in (14, 31):
                engine_ttft(engine, distinct_prompts(1, length, 500 + length), repeat=1)
                row[f"ttft{length}_ms"] = 1e3 * engine_ttft(
                    engine, distinct_prompts(1, length, length), repeat=5)
        finally:
            engine.stop()
        rows.append(row)
        print(json.dumps(row), flush=True)
        del engine
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()} {args.shape} {args.format}")
    print(f"{'setting':<16} {'start s':>8} {'TTFT 14 ms':>11} {'TTFT 31 ms':>11}")
    for r in rows:
        print(f"{r['setting']:<16} {r['start_s']:>8.1f} {r['ttft14_ms']:>11.2f} "
              f"{r['ttft31_ms']:>11.2f}")


if __name__ == "__main__":
    main()
