"""Drafter geometries measured on one set of self-distilled continuations: for a target (the
embedded default model by default), its greedy continuations of many prompts once, then per
geometry a drafter trained for a fixed time and its mean accepted length and speed-up through
headstart's Engine (greedy, with and without it, held-out prompts).

    python benchmarks/drafter_sweep.py prep --out .work/sweep.json [--prompts 24576]
    python benchmarks/drafter_sweep.py run --data .work/sweep.json --minutes 2.5 \\
        --geometry 2:8:0,3,6 --geometry 2:8:1,4,7 [--keep DIR] [--init DRAFTER]

``prep`` runs where the corpus is (this machine; the GPU machine's Python has no test suite):
half chat requests made from training files, rendered as serving renders them, half 64-token
prefixes of training rows (``training.run``'s drafter prompts), and 64-token prefixes of
held-out rows to measure on, all as token ids. ``run`` prints one line per geometry
(``layers:block:taps``) and a table last; ``--keep DIR`` keeps each drafter as DIR/<geometry>;
``--init DRAFTER`` goes on training a drafter of that geometry instead of starting afresh.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prep(a: argparse.Namespace) -> None:
    from headstart.tokenizer import Tokenizer
    from training.chat import corpus_examples, prompt_encoding
    from training.data import evaluation_rows, spread, token_rows

    tok = Tokenizer.from_dir(a.model)
    rnd = random.Random(0)
    examples = corpus_examples("train")
    rnd.shuffle(examples)
    n_chat = min(len(examples), a.prompts // 2)
    prompts = [list(prompt_encoding(tok, e.request).ids) for e in examples[:n_chat]]
    rows = spread(token_rows(tok, "train", 256, 10**12), a.prompts - n_chat)
    prompts += [r[:64].tolist() for r in rows]
    held = evaluation_rows(tok, 256, a.eval_prompts)
    data = {
        "prompts": prompts,
        "chat_prompts": n_chat,
        "eval_prompts": [r[:64].tolist() for r in held],
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(data))
    print(f"{len(prompts)} prompts ({n_chat} chat), {len(held)} held-out -> {a.out}")


def run(a: argparse.Namespace) -> None:
    import tempfile

    from headstart.loading import load, resolve_device
    from training.drafter import evaluate_acceptance
    from training.selfdistill import DrafterRecipe, batched_continuations, fit_drafter

    data = json.loads(Path(a.data).read_text())
    prompts = data["prompts"][: a.prompts] if a.prompts else data["prompts"]
    loaded = load(a.model, resolve_device(a.device))
    model = loaded.model
    t0 = time.perf_counter()
    conts = batched_continuations(
        model,
        prompts,
        a.new_tokens,
        loaded.eos_token_ids,
        rows=a.rows,
        timeout_s=a.generation_s,
    )
    gen_s = time.perf_counter() - t0
    n_tok = sum(len(c) for c in conts if c is not None)
    print(f"continuations: {n_tok} tokens in {gen_s:.1f}s ({n_tok / gen_s:.0f} tok/s)", flush=True)
    results = []
    keep = Path(a.keep) if a.keep else Path(tempfile.mkdtemp())
    for geometry in a.geometry:
        layers, block, taps = geometry.split(":")
        out = keep / geometry.replace(":", "_").replace(",", "-")
        recipe = DrafterRecipe(
            block=int(block),
            layers=int(layers),
            taps=tuple(int(t) for t in taps.split(",")),
            intermediate=3 * model.cfg.hidden_size,
            minutes=a.minutes,
            batch=a.batch,
            lr=a.lr,
        )
        fit = fit_drafter(
            model,
            prompts,
            conts,
            out,
            recipe,
            tokenizer_size=loaded.tokenizer.vocab_size,
            eos_token_ids=loaded.eos_token_ids,
            generation_s=gen_s,
            init=a.init,
        )
        (out / "train_report.json").write_text(json.dumps(fit, indent=1) + "\n")
        acc = evaluate_acceptance(
            a.model,
            out,
            data["eval_prompts"],
            max_tokens=64,
            device=str(model.device),
            dtype=model.dtype,
            strict=model.device.type == "cpu",
        )
        row = (geometry, fit["steps"], fit["loss_last"], acc["mean_accepted_length"])
        results.append(row + (acc["speedup"], acc["mismatches"]))
        print(f"{geometry}: {json.dumps(acc)}", flush=True)
    print(f"\ncontinuations {n_tok} tokens, {gen_s:.1f}s; training {a.minutes} min each")
    print("| layers:block:taps | steps | last loss | mean accepted | chain speed-up | mismatches |")
    print("|---|---:|---:|---:|---:|---:|")
    for g, steps, loss, acc, sp, mm in results:
        print(f"| {g} | {steps} | {loss:.3f} | {acc:.2f} | {sp:.2f}x | {mm} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prep")
    p.add_argument("--model", default=str(ROOT / "src/headstart/default_model"))
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=24576)
    p.add_argument("--eval-prompts", type=int, default=16)
    r = sub.add_parser("run")
    r.add_argument("--model", default=str(ROOT / "src/headstart/default_model"))
    r.add_argument("--data", required=True)
    r.add_argument("--device", default="auto")
    r.add_argument("--prompts", type=int, default=0, help="use the first N (0: all)")
    r.add_argument("--new-tokens", type=int, default=192)
    r.add_argument("--rows", type=int, default=2048)
    r.add_argument("--generation-s", type=float, default=120)
    r.add_argument("--geometry", action="append", required=True)
    r.add_argument("--minutes", type=float, default=2.0)
    r.add_argument("--batch", type=int, default=128)
    r.add_argument("--lr", type=float, default=6e-4)
    r.add_argument("--keep", default=None)
    r.add_argument("--init", default=None, help="a drafter checkpoint to go on training")
    a = ap.parse_args()
    torch.manual_seed(0)
    prep(a) if a.command == "prep" else run(a)


if __name__ == "__main__":
    main()
