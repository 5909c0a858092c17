"""Greedy continuations for self-distillation, tokens/s: the batched generator against the
engine (training/selfdistill.py), on the embedded default model or ``--model``.

    python benchmarks/continuations.py [--model DIR] [--device cuda] [--prompts 2048]
        [--rows 512] [--new-tokens 192] [--engine-prompts 256] [--budget-s 60]

Random 64-token prompts. The batched generator runs groups of ``--rows`` prompts and prints
each group's tokens/s as it ends (so a run cut short still reports); then the engine, with
``--rows`` streams (at most 128, as training used it before), on ``--engine-prompts`` prompts, and
whether the two agree on those prompts. Each phase stops at ``--budget-s``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from headstart.loading import load
from training.selfdistill import batched_continuations, generate_continuations


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=192)
    ap.add_argument("--engine-prompts", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=60)
    a = ap.parse_args()
    loaded = load(a.model, a.device)
    model, tok, eos = loaded.model, loaded.tokenizer, loaded.eos_token_ids
    gen = torch.Generator().manual_seed(0)
    vocab = min(tok.vocab_size, model.cfg.vocab_size)
    prompts = [torch.randint(5, vocab, (64,), generator=gen).tolist() for _ in range(a.prompts)]
    print(f"device {model.device}, {a.prompts} prompts, rows {a.rows}", flush=True)
    batched_continuations(model, prompts[:8], 4, eos, rows=8)  # first-use compilation
    start, done, tokens = time.perf_counter(), 0, 0
    for g in range(0, a.prompts, a.rows):
        t0 = time.perf_counter()
        got = batched_continuations(model, prompts[g : g + a.rows], a.new_tokens, eos, rows=a.rows)
        n = sum(len(c) for c in got if c is not None)
        done, tokens = done + len(got), tokens + n
        dt = time.perf_counter() - t0
        print(
            f"batched group {g // a.rows}: {n} tokens in {dt:.2f}s, {n / dt:,.0f} tok/s", flush=True
        )
        if time.perf_counter() - start > a.budget_s:
            break
    total = time.perf_counter() - start
    rows = [
        f"batched: {tokens:,} tokens of {done} prompts in {total:.1f}s, {tokens / total:,.0f} tok/s"
    ]
    few = prompts[: a.engine_prompts]
    if not few:  # --engine-prompts 0: the batched figure alone
        print("\n".join(rows))
        return
    t0 = time.perf_counter()
    ref = generate_continuations(
        model, tok, few, a.new_tokens, eos, streams=min(a.rows, 128), timeout_s=a.budget_s
    )
    dt = time.perf_counter() - t0
    n = sum(len(c) for c in ref if c is not None)
    rows.append(
        f"engine: {n:,} tokens of {len(few)} prompts in {dt:.1f}s (start included), "
        f"{n / dt:,.0f} tok/s"
    )
    mine = batched_continuations(model, few, a.new_tokens, eos, rows=a.rows)
    same = sum(x == y for x, y in zip(mine, ref, strict=True) if y is not None)
    rows.append(f"agree on {same} of {sum(y is not None for y in ref)} finished prompts")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
