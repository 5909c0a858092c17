"""One command: train the default model and its drafter, export both, evaluate, report.

    python -m training.run --out src/headstart/default_model --device cuda \\
        --target-minutes 5 --drafter-minutes 3

Steps: tokenize the standard library (the default tokenizer was trained on it), train the
target (``training.target``), export it in the MLX 4-bit layout with tokenizer and chat template
(``training.export``), train a DFlash drafter against it (``training.drafter``) on the target's
own greedy continuations (``training.continuations``), save it under
``OUT/drafter``, then measure with headstart itself: held-out perplexity of the exported 4-bit
model, mean accepted length and decode speed-up with the drafter, and a few sample completions.
Everything lands in ``OUT/training_report.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from headstart.loading import default_model_dir
from headstart.tokenizer import Tokenizer
from training.data import token_rows
from training.export import export_default, model_files_bytes
from training.target import target_config, train_target

SAMPLE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
]


def headstart_perplexity(model_dir: Path, rows: torch.Tensor, device: str) -> float:
    """Held-out perplexity of the exported checkpoint, computed by headstart's own forward."""
    from headstart.batch import ForwardBatch, SeqChunk
    from headstart.models.qwen35.model import Qwen35Model

    model = Qwen35Model.load(
        model_dir, device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16
    )
    total, count = 0.0, 0
    for row in rows:
        ids = row.tolist()
        pool = model.new_state_pool(1, len(ids))
        logits = (
            model.forward(
                ForwardBatch.build([SeqChunk(0, 0, ids[:-1], len(ids) - 1)], model.device), pool
            )
            .float()
            .cpu()
        )
        total += float(
            torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
        )
        count += len(ids) - 1
    return math.exp(total / count)


def samples(model_dir: Path, device: str, max_tokens: int = 48) -> dict[str, str]:
    from headstart.generate import Finish, Piece, generate
    from headstart.loading import load
    from headstart.sampling import SamplingParams

    loaded = load(str(model_dir), device)
    out = {}
    for prompt in SAMPLE_PROMPTS:
        ids = loaded.tokenizer.encode(prompt)
        text = ""
        for ev in generate(
            loaded.model,
            loaded.tokenizer,
            ids,
            SamplingParams(temperature=0, max_tokens=max_tokens),
            loaded.eos_token_ids,
        ):
            if isinstance(ev, (Piece, Finish)):
                text += ev.text
        out[prompt] = text
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--target-minutes", type=float, default=5.0)
    ap.add_argument("--drafter-minutes", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=None, help="target steps (default: time budget)")
    ap.add_argument("--drafter-steps", type=int, default=None)
    ap.add_argument("--max-chars", type=int, default=40_000_000)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument(
        "--drafter-data",
        choices=("continuations", "corpus"),
        default="continuations",
        help="the target's greedy continuations of training prompts (DFlash's "
        "recipe), or the corpus itself",
    )
    ap.add_argument(
        "--continuations",
        type=int,
        default=4096,
        help="how many greedy continuations to generate for the drafter",
    )
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument(
        "--eval-every",
        type=int,
        default=100,
        help="target steps between validation perplexities (early stopping)",
    )
    ap.add_argument(
        "--save-target",
        default=None,
        help="also keep the trained target (transformers format, fp32) here",
    )
    ap.add_argument(
        "--load-target",
        default=None,
        help="skip target training: load a target saved with --save-target",
    )
    ap.add_argument("--no-drafter", action="store_true", help="stop after the target")
    ap.add_argument(
        "--stdlib",
        default=None,
        help="train on this copy of the standard library (default: this Python's)",
    )
    args = ap.parse_args(argv)
    if args.stdlib:
        os.environ["HEADSTART_STDLIB"] = args.stdlib
    out = Path(args.out)
    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    started = time.perf_counter()

    # The tokenizer the package already ships (trained on the same standard library).
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = Path(tmp) / "tokenizer"
        tok_dir.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(default_model_dir() / name, tok_dir / name)
        tokenizer = Tokenizer.from_dir(tok_dir)
        eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
        train = token_rows(tokenizer, "train", args.seq_len, args.max_chars)
        held = token_rows(tokenizer, "held_out", args.seq_len, max(args.max_chars // 20, 1))
        held = held[: max(4, min(64, held.shape[0]))]
        print(f"data: {train.shape[0]} train rows, {held.shape[0]} held-out rows of {args.seq_len}")

        from transformers import Qwen3_5ForCausalLM

        vocab = -(-tokenizer.vocab_size // 64) * 64
        if args.load_target:
            model = Qwen3_5ForCausalLM.from_pretrained(args.load_target, dtype=torch.float32)
            report = json.loads((Path(args.load_target) / "target_report.json").read_text())
            report["device"] = device
        else:
            torch.manual_seed(0)
            model = Qwen3_5ForCausalLM(target_config(vocab, eos, args.layers, args.hidden))
            report = {
                "params": sum(p.numel() for p in model.parameters()),
                "device": device,
                "train_tokens": train.numel(),
            }
            # Validation rows for early stopping: the end of the training stream, held back.
            n_val = min(64, max(2, train.shape[0] // 20))
            train, val = train[:-n_val], train[-n_val:]
            report["train_tokens"] = train.numel()
            report["target"] = train_target(
                model,
                train,
                held,
                steps=args.steps,
                time_budget_s=args.target_minutes * 60,
                batch=args.batch,
                device=device,
                dtype=dtype,
                val=val,
                eval_every=args.eval_every,
            )
            if args.save_target:
                model.float().save_pretrained(args.save_target)
                (Path(args.save_target) / "target_report.json").write_text(
                    json.dumps(report, default=str)
                )
        model.eval()
        # Written to OUT straight away, the drafter too as soon as it is trained: the
        # evaluations come last, so running out of time there loses no weights.
        if out.exists():
            shutil.rmtree(out)
        export_default(model.float().cpu(), tok_dir, out, eos)
        _write_report(out, report)
        report["exported_held_out_ppl"] = _attempt(lambda: headstart_perplexity(out, held, device))
        report["samples"] = _attempt(lambda: samples(out, device))
        if not args.no_drafter:
            _drafter_stage(args, model, train, out, held, vocab, device, dtype, report)
        report["model_bytes"] = model_files_bytes(out)
        report["total_seconds"] = time.perf_counter() - started
    _write_report(out, report)
    summary = {k: v for k, v in report.items() if k != "samples"}
    summary["target"] = {k: v for k, v in report["target"].items() if k != "loss_history"}
    print(json.dumps(summary, default=str))
    return report


def _drafter_stage(
    args,
    model,
    train,
    staging: Path,
    held,
    vocab: int,
    device: str,
    dtype: torch.dtype,
    report: dict,
) -> None:
    from headstart.engine.spec.drafter import DrafterConfig
    from training.drafter import evaluate_acceptance, save_drafter_checkpoint, train_drafter

    dcfg = DrafterConfig(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1e7,
        block_size=args.block,
        mask_token_id=vocab - 1,
        # Three evenly spaced taps, never the last layer (HF returns it normed).
        target_layer_ids=tuple(sorted({round(i * (args.layers - 2) / 2) for i in range(3)})),
        causal=(False, False),
        sliding_window=(0, 0),
    )
    model.to(device)
    t0 = time.perf_counter()
    if args.drafter_data == "continuations":
        from training.continuations import continuation_batches, greedy_continuations

        prompt_len = min(64, args.seq_len // 4)
        gen = torch.Generator().manual_seed(2)
        pick = torch.randint(0, train.shape[0], (args.continuations,), generator=gen)
        seqs = greedy_continuations(
            model, train[pick, :prompt_len], args.seq_len - prompt_len, dtype=dtype
        )
        report["continuations"] = {
            "count": seqs.shape[0],
            "prompt_len": prompt_len,
            "seconds": time.perf_counter() - t0,
        }
        print(f"drafter data: {seqs.shape[0]} continuations in {time.perf_counter() - t0:.0f}s")
        batches = continuation_batches(seqs, prompt_len, args.batch)
    else:
        batches = _batches(train, args.batch)
    t1 = time.perf_counter()
    drafter = train_drafter(
        model,
        batches,
        dcfg,
        steps=args.drafter_steps,
        time_budget_s=args.drafter_minutes * 60,
        device=device,
        dtype=dtype,
        log=print,
    )
    report["drafter_seconds"] = time.perf_counter() - t1
    save_drafter_checkpoint(drafter, dcfg, staging / "drafter")
    _write_report(staging, report)
    prompts = [row[:64].tolist() for row in held[: args.eval_prompts]]
    # Not strict: on a GPU the drafter is evaluated in bf16, where near-tie argmaxes of
    # chunked and stepped kernels may differ; mismatches are reported instead.
    report["acceptance"] = _attempt(
        lambda: evaluate_acceptance(
            staging,
            staging / "drafter",
            prompts,
            max_tokens=64,
            block=args.block,
            device=device,
            dtype=dtype,
            strict=False,
        )
    )


def _write_report(out: Path, report: dict) -> None:
    (out / "training_report.json").write_text(json.dumps(report, indent=1, default=str))


def _attempt(fn):
    """Evaluations run after the weights are safe; a failure is reported, not fatal."""
    try:
        return fn()
    except Exception as exc:
        import traceback

        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def _batches(rows: torch.Tensor, batch: int):
    gen = torch.Generator().manual_seed(1)
    while True:
        yield rows[torch.randint(0, rows.shape[0], (batch,), generator=gen)]


if __name__ == "__main__":
    main()
