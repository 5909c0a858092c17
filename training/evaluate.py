"""Measure a trained default model where it will run: held-out perplexity (headstart's forward
on the exported 4-bit checkpoint), and mean accepted length and decode speed-up with its drafter
(greedy, through headstart's Engine, with and without the drafter): drafting every step
("acceptance"), and as serving runs it, drafting only while it pays ("auto").

    python -m training.evaluate --model src/headstart/default_model --device cpu

Prompts are the first 64 tokens of held-out standard-library rows, the same ones
``training.run`` evaluates on.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from headstart.tokenizer import Tokenizer
from training.data import token_rows
from training.drafter import evaluate_acceptance
from training.run import headstart_perplexity


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--ppl-rows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = Path(args.model)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    tok = Tokenizer.from_dir(model)
    held = token_rows(tok, "held_out", args.seq_len, 2_000_000)[:64]
    t0 = time.perf_counter()
    report: dict = {
        "device": args.device,
        "dtype": str(dtype),
        "held_out_ppl": headstart_perplexity(model, held[: args.ppl_rows], args.device),
    }
    prompts = [row[:64].tolist() for row in held[: args.prompts]]
    report["acceptance"] = evaluate_acceptance(
        model,
        model / "drafter",
        prompts,
        max_tokens=args.max_tokens,
        device=args.device,
        dtype=dtype,
        strict=args.device == "cpu",
    )
    # As `headstart serve --drafter` runs it: the planner drafts only while rounds pay.
    report["auto"] = evaluate_acceptance(
        model,
        model / "drafter",
        prompts,
        max_tokens=args.max_tokens,
        device=args.device,
        dtype=dtype,
        strict=args.device == "cpu",
        spec_mode="auto",
    )
    report["seconds"] = time.perf_counter() - t0
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
