"""Measure a trained default model where it will run: held-out perplexity (headstart's forward
on the exported 4-bit checkpoint), how many of the fixed chat requests get code that parses, and
mean accepted length and decode speed-up with its drafter (greedy, through headstart's Engine,
with and without the drafter): drafting every step ("acceptance"), and as serving runs it,
drafting only while it pays ("auto").

    python -m training.evaluate --model src/headstart/default_model --device cpu

The held-out rows are those ``training.run`` measures on (``training.data.evaluation_rows``:
rows spread evenly over the held-out files of this machine's corpus; ``--corpus DIR`` for an
unpacked ``training.data --tar`` copy, the one a GPU run trained on). Prompts for the drafter
are the first 64 tokens of the first ``--prompts`` of them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from headstart.tokenizer import Tokenizer
from training.data import evaluation_rows
from training.drafter import evaluate_acceptance
from training.run import headstart_perplexity


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--corpus", default=None, help="an unpacked `training.data --tar` corpus")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--ppl-rows", type=int, default=256)
    ap.add_argument("--code-max-tokens", type=int, default=256)
    ap.add_argument("--no-code", action="store_true", help="skip the chat-code evaluation")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--cpu-programs", action="store_true", help="decode from compiled CPU programs, as serve"
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.corpus:
        os.environ["HEADSTART_CORPUS"] = args.corpus
    model = Path(args.model)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    tok = Tokenizer.from_dir(model)
    held = evaluation_rows(tok, args.seq_len, args.ppl_rows)
    t0 = time.perf_counter()
    report: dict = {
        "device": args.device,
        "dtype": str(dtype),
        "held_out_ppl": headstart_perplexity(model, held[: args.ppl_rows], args.device),
    }
    if not args.no_code:
        from training.chat import evaluate_code

        code = evaluate_code(model, args.device, args.code_max_tokens)
        report["code"] = {k: v for k, v in code.items() if k != "answers"}
    if (model / "drafter" / "config.json").exists():
        prompts = [row[:64].tolist() for row in held[: args.prompts]]
        for key, mode in (("acceptance", "chain"), ("auto", "auto")):
            # "auto" is how `headstart serve --drafter` runs it: drafting only while it pays.
            report[key] = evaluate_acceptance(
                model,
                model / "drafter",
                prompts,
                max_tokens=args.max_tokens,
                device=args.device,
                dtype=dtype,
                strict=args.device == "cpu",
                spec_mode=mode,
                cpu_programs=args.cpu_programs,
            )
    report["seconds"] = time.perf_counter() - t0
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
