"""Train the default model and its drafter, export both, evaluate, report: one command, in stages.

    python -m training.run --out src/headstart/default_model --device cuda

Stages (``--stage all`` runs them in order in one process; one stage per process, with
``--work DIR`` holding what passes between them, lets a caller give each its own time limit):

1. ``data``: tokenize the corpus (``training.data``: the standard library with its tests and
   permissively licensed installed packages, deduplicated, split by file) into token rows in
   ``--work`` (a later stage that finds none makes them).
2. ``target``: train the target (``training.target``: early stopping on the ``val`` files),
   export it (MLX 4-bit, tokenizer, chat template, ``headstart.json`` with thinking off) to
   ``OUT``.
3. ``chat``: the supervised chat pass (``training.chat``): one-turn conversations made from the
   corpus's documented functions, loss on the assistant tokens only; export again.
4. ``drafter``: a DFlash drafter self-distilled from the exported model as it is served
   (``training.selfdistill``: its greedy continuations of chat requests and code prefixes,
   its own tapped features), saved under ``OUT/drafter``.
5. ``eval``: with headstart itself, on ``OUT``: held-out perplexity of the 4-bit model (all
   held-out files, and the standard library's alone), how many of 20 fixed chat requests get an
   answer whose code ``ast.parse`` accepts, sample completions and answers, the drafter's mean
   accepted length and speed against plain decode; ``headstart.json`` then lists this device
   type if drafting paid here.

Weights are written at the end of each training stage, before any evaluation, so a slow
evaluation never loses them. Everything lands in ``OUT/training_report.json``, with
``how_measured`` saying how each figure was obtained; ``--summary`` prints its table.
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
from training.data import rows_of, split_documents, spread
from training.export import (
    TOKENIZER_FILES,
    export_default,
    model_files_bytes,
    write_policy,
)
from training.target import target_config, train_target

STAGES = ("data", "target", "chat", "drafter", "eval")
SAMPLE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
]
# A device type is listed in headstart.json when drafting ("auto", as serve runs it) drafted
# and was at least this much faster than plain decode there: a margin over timing noise (an
# "auto" run that never drafts times plain decode twice, and differs from 1.0 by noise alone).
PAYS = 1.1

HOW_MEASURED = {
    "target.held_out_ppl": "transformers forward of the trained fp32 target (bf16 autocast on a "
    "GPU) over the evaluation rows: 256-token rows spread evenly over every held-out file "
    "(training.data.evaluation_rows), perplexity = exp(mean next-token cross-entropy)",
    "target.val_history": "the same on 64 rows of the val files, every eval_every steps "
    "(early stopping keeps the best)",
    "exported_held_out_ppl": "headstart's own forward (Qwen35Model, fp32 on a CPU, bf16 on a "
    "GPU) of the exported MLX 4-bit model over the evaluation rows, after the chat pass",
    "exported_held_out_ppl_stdlib": "as exported_held_out_ppl, on rows of the standard "
    "library's held-out files only (comparable with runs whose corpus was the stdlib alone)",
    "code": "20 fixed requests (training.chat.CODE_PROMPTS), each rendered as headstart serve "
    "renders a chat request with the folder's headstart.json (thinking off), greedy through "
    "headstart's Engine up to code.max_tokens tokens, content split from reasoning as the "
    "server does; parsed = answers whose first ``` block (else the whole content) ast.parse "
    "accepts; ended = answers that ended their turn (<|im_end|>) before max_tokens",
    "samples": "greedy: completion = raw prompt (no template) through headstart.generate, "
    "48 tokens; chat = the first answers of the code evaluation",
    "acceptance": "greedy, ignore_eos, one stream, through headstart's Engine with and "
    "without the drafter (spec mode chain: a draft every step): first 64 tokens of held-out "
    "rows as prompts, 64 new tokens each; mean_accepted_length = accepted / rounds + 1; "
    "speedup = plain seconds / drafted seconds, same process, warm",
    "acceptance_chat": "as acceptance, prompts = the code evaluation's 20 chat requests",
    "auto": "as acceptance with spec mode auto (the planner drafts only while it pays, as "
    "headstart serve runs it)",
    "drafter": "training.selfdistill.train_drafter_for on the exported 4-bit model: the "
    "target's greedy continuations (ending at its end-of-sequence token or max_new_tokens) "
    "of chat requests made from training files and of 64-token training-row prefixes",
}


# ----------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------


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
    """Greedy raw completions of :data:`SAMPLE_PROMPTS` (no chat template), with the folder's
    repetition_penalty, as ``headstart run --raw --temperature 0`` decodes them."""
    from headstart.generate import Finish, Piece, generate
    from headstart.loading import load
    from training.chat import served_greedy

    loaded = load(str(model_dir), device)
    params = served_greedy(loaded, max_tokens)
    out = {}
    for prompt in SAMPLE_PROMPTS:
        ids = loaded.tokenizer.encode(prompt)
        text = ""
        for ev in generate(
            loaded.model,
            loaded.tokenizer,
            ids,
            params,
            loaded.eos_token_ids,
        ):
            if isinstance(ev, (Piece, Finish)):
                text += ev.text
        out[prompt] = text
    return out


class Run:
    """What every stage shares: options, folders, device, the tokenizer, the report file."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.out, self.work = args, Path(args.out), work
        self.device = args.device
        self.dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        # The tokenizer the package already ships (trained on the standard library).
        self.tok_dir = work / "tokenizer"
        if not (self.tok_dir / "tokenizer.json").exists():
            self.tok_dir.mkdir(parents=True, exist_ok=True)
            for name in TOKENIZER_FILES:
                shutil.copy(default_model_dir() / name, self.tok_dir / name)
        self.tok = Tokenizer.from_dir(self.tok_dir)
        self.eos = [self.tok.token_to_id("<|im_end|>"), self.tok.token_to_id("<|endoftext|>")]
        self.vocab = -(-self.tok.vocab_size // 64) * 64

    @property
    def report_file(self) -> Path:
        return self.out / "training_report.json"

    def report(self) -> dict:
        return json.loads(self.report_file.read_text()) if self.report_file.exists() else {}

    def save(self, report: dict) -> None:
        report["how_measured"] = HOW_MEASURED
        self.out.mkdir(parents=True, exist_ok=True)
        self.report_file.write_text(json.dumps(report, indent=1, default=str))

    def rows(self) -> dict[str, torch.Tensor]:
        """Token rows of every split, tokenized once per work folder (int16 on disk: the
        vocabulary is small)."""
        cache = self.work / "rows.pt"
        if cache.exists():
            return {k: v.long() for k, v in torch.load(cache).items()}
        a, t0 = self.args, time.perf_counter()
        docs = split_documents(a.max_chars)  # one pass over the corpus for every split
        held = [t for _, t in docs["held_out"]]
        held_stdlib = [t for f, t in docs["held_out"] if f.source == "stdlib"]
        rows = {
            "train": rows_of(self.tok, (t for _, t in docs["train"]), a.seq_len),
            "val": spread(rows_of(self.tok, (t for _, t in docs["val"]), a.seq_len), 64),
            # The same rows as evaluation_rows(...) gives a later training.evaluate.
            "held": spread(rows_of(self.tok, held, a.seq_len), a.ppl_rows),
            "held_stdlib": spread(rows_of(self.tok, held_stdlib, a.seq_len), a.ppl_rows),
        }
        print(
            f"data: {rows['train'].shape[0]} train, {rows['val'].shape[0]} val, "
            f"{rows['held'].shape[0]} held-out rows of {a.seq_len} "
            f"({time.perf_counter() - t0:.0f}s)"
        )
        assert self.vocab <= 32767
        torch.save({k: v.to(torch.int16) for k, v in rows.items()}, cache)
        return rows

    def export(self, model) -> None:
        """Write the model's files to OUT (a drafter there belongs to an older target: gone)."""
        if (self.out / "drafter").exists():
            shutil.rmtree(self.out / "drafter")
        export_default(model.float().cpu(), self.tok_dir, self.out, self.eos)


def _attempt(fn):
    """Evaluations run after the weights are safe; a failure is reported, not fatal."""
    try:
        return fn()
    except Exception as exc:
        import traceback

        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def _corpus_summary() -> dict:
    from training.data import corpus_root, package_sources, stdlib_root

    root = corpus_root()
    if root is not None:
        m = json.loads((root / "manifest.json").read_text())
        return {k: v for k, v in m.items() if k != "files"} | {"files": len(m["files"])}
    return {
        "stdlib": str(stdlib_root()),
        "distributions": [
            {k: d[k] for k in ("name", "version", "license")} for d in package_sources()[1]
        ],
    }


# ----------------------------------------------------------------------------------------------
# Stages
# ----------------------------------------------------------------------------------------------


def stage_data(run: Run) -> None:
    """Tokenize the corpus into the work folder's rows (what the target stage trains on), as a
    stage of its own so that its time never counts against the training's: on the GPU machine
    it took 195 s of a 265 s target stage while other jobs shared the CPU."""
    run.rows()


def stage_target(run: Run) -> None:
    from transformers import Qwen3_5ForCausalLM

    a = run.args
    rows = run.rows()
    earlier = run.report().get("stage_seconds", {})  # the data stage's, kept in the new report
    if run.out.exists():
        shutil.rmtree(run.out)
    if a.load_target:
        model = Qwen3_5ForCausalLM.from_pretrained(a.load_target, dtype=torch.float32)
        report = json.loads((Path(a.load_target) / "target_report.json").read_text())
    else:
        torch.manual_seed(0)
        model = Qwen3_5ForCausalLM(target_config(run.vocab, run.eos, a.layers, a.hidden))
        report = {
            "params": sum(p.numel() for p in model.parameters()),
            "train_tokens": rows["train"].numel(),
            "corpus": _corpus_summary(),
        }
        report["target"] = train_target(
            model,
            rows["train"],
            rows["held"],
            steps=a.steps,
            time_budget_s=a.target_minutes * 60,
            batch=a.batch,
            device=run.device,
            dtype=run.dtype,
            val=rows["val"],
            eval_every=a.eval_every,
        )
    report["device"] = run.device
    report["stage_seconds"] = {k: v for k, v in earlier.items() if k == "data"}
    model.float().save_pretrained(run.work / "target_hf")
    (run.work / "target_hf" / "target_report.json").write_text(json.dumps(report, default=str))
    if a.save_target:
        shutil.copytree(run.work / "target_hf", a.save_target, dirs_exist_ok=True)
    run.export(model.eval())
    run.save(report)


def stage_chat(run: Run) -> None:
    from transformers import Qwen3_5ForCausalLM

    from training.chat import chat_rows, corpus_examples, read_examples, train_chat

    a = run.args
    model = Qwen3_5ForCausalLM.from_pretrained(run.work / "target_hf", dtype=torch.float32)
    t0 = time.perf_counter()
    if a.chat_examples and Path(a.chat_examples).exists():
        examples = read_examples(a.chat_examples)
    else:
        examples = corpus_examples("train", a.chat_max_chars)
    pad = run.tok.token_to_id("<|endoftext|>")
    rows = chat_rows(run.tok, examples, a.seq_len, pad)
    print(
        f"chat data: {len(examples)} conversations, {rows['input_ids'].shape[0]} fit "
        f"{a.seq_len} tokens ({time.perf_counter() - t0:.0f}s)"
    )
    report = run.report()
    # A quarter of each batch is plain corpus rows: the pass adds chat, it must not cost the
    # completions (and the held-out perplexity) the pre-training bought.
    result = train_chat(
        model,
        rows,
        time_budget_s=a.chat_minutes * 60,
        steps=a.chat_steps,
        batch=a.batch,
        lr=a.chat_lr,
        corpus=run.rows()["train"],
        corpus_rows=max(1, a.batch // 4),
        device=run.device,
        dtype=run.dtype,
    )
    result["conversations"] = len(examples)
    result["rows"] = int(rows["input_ids"].shape[0])
    result["assistant_tokens"] = int(rows["loss_mask"].sum())
    report["chat"] = result
    model.float().save_pretrained(run.work / "chat_hf")
    run.export(model.eval())
    run.save(report)


def drafter_prompts(run: Run, count: int) -> list[list[int]]:
    """Half chat requests made from training files (rendered as serving renders them), half
    64-token prefixes of training rows: the two ways the default model is used."""
    from training.chat import corpus_examples, prompt_encoding, read_examples

    a = run.args
    gen = torch.Generator().manual_seed(2)
    if a.chat_examples and Path(a.chat_examples).exists():
        examples = read_examples(a.chat_examples)
    else:
        examples = corpus_examples("train", a.chat_max_chars)
    n_chat = min(len(examples), count // 2)
    pick = torch.randperm(len(examples), generator=gen)[:n_chat].tolist()
    prompts = [list(prompt_encoding(run.tok, examples[i].request).ids) for i in pick]
    train = run.rows()["train"]
    prefix = min(64, a.seq_len // 4)
    rows = torch.randint(0, train.shape[0], (count - n_chat,), generator=gen)
    prompts += [train[i, :prefix].tolist() for i in rows.tolist()]
    return prompts


def stage_drafter(run: Run) -> None:
    from training.selfdistill import DrafterRecipe, train_drafter_for

    a = run.args
    report = run.report()
    prompts = drafter_prompts(run, a.continuations)
    taps = [int(t) for t in a.taps.split(",")] if a.taps else None
    if taps is None:  # three evenly spaced, never the last layer
        taps = sorted({round(i * (a.layers - 2) / 2) for i in range(3)})
    recipe = DrafterRecipe(
        block=a.block,
        layers=a.drafter_layers,
        taps=tuple(taps),
        intermediate=3 * a.hidden,
        steps=a.drafter_steps,
        minutes=a.drafter_minutes,
        batch=a.batch,
    )
    report["drafter"] = train_drafter_for(
        run.out,
        prompts,
        run.out / "drafter",
        recipe,
        device=run.device,
        max_new_tokens=a.seq_len - min(64, a.seq_len // 4),
        streams=512,
        generation_timeout_s=a.generation_timeout,
        report_file=False,
    )
    run.save(report)


def stage_eval(run: Run) -> None:
    from training.chat import CODE_PROMPTS, evaluate_code, prompt_encoding
    from training.drafter import evaluate_acceptance

    a, out, device = run.args, run.out, run.device
    report = run.report()
    t0 = time.perf_counter()
    rows = run.rows()
    held = rows["held"]
    # Cheapest and most wanted first: the report is saved after each, so a stage that runs out
    # of time keeps what it measured.
    report["exported_held_out_ppl"] = _attempt(lambda: headstart_perplexity(out, held, device))
    if rows["held_stdlib"].shape[0]:
        report["exported_held_out_ppl_stdlib"] = _attempt(
            lambda: headstart_perplexity(out, rows["held_stdlib"], device)
        )
    run.save(report)
    code = _attempt(lambda: evaluate_code(out, device, a.code_max_tokens))
    report["code"] = code
    report["samples"] = {
        "completion": _attempt(lambda: samples(out, device)),
        "chat": {x["prompt"]: x["content"] for x in code.get("answers", [])[:6]},
    }
    run.save(report)
    if (out / "drafter" / "config.json").exists():
        raw = [row[:64].tolist() for row in held[: a.eval_prompts]]
        chat = [list(prompt_encoding(run.tok, p).ids) for p in CODE_PROMPTS[: a.eval_prompts]]

        def accept(prompts, mode="chain"):
            # Not strict: on a GPU in bf16 near-tie argmaxes of the verify window's and the
            # decode step's kernels may differ (dflash.md 2.4); mismatches are counted.
            return _attempt(
                lambda: evaluate_acceptance(
                    out,
                    out / "drafter",
                    prompts,
                    max_tokens=64,
                    device=device,
                    dtype=run.dtype,
                    strict=False,
                    spec_mode=mode,
                )
            )

        report["acceptance"] = accept(raw)
        run.save(report)
        report["auto"] = auto = accept(raw, "auto")
        kind = torch.device(device).type
        pays = [kind] if auto.get("rounds", 0) and auto.get("speedup", 0) >= PAYS else []
        write_policy(out, pays)
        report["drafter_devices"] = pays
        run.save(report)
        report["acceptance_chat"] = accept(chat)
    report["eval_seconds"] = time.perf_counter() - t0
    report["model_bytes"] = model_files_bytes(out)
    run.save(report)


# ----------------------------------------------------------------------------------------------
# The report's table
# ----------------------------------------------------------------------------------------------


def summary_table(report: dict) -> str:
    """The figures of a report, one per line (missing ones as '-')."""

    def get(*path, fmt="{:.2f}"):
        v = report
        for p in path:
            v = v.get(p) if isinstance(v, dict) else None
        if v is None or isinstance(v, dict):
            return "-"
        return fmt.format(v) if isinstance(v, float) else str(v)

    code = report.get("code") or {}
    lines = [
        ("parameters", get("params")),
        ("train tokens", get("train_tokens")),
        ("target steps / best", f"{get('target', 'steps')} / {get('target', 'best_step')}"),
        ("target seconds", get("target", "seconds", fmt="{:.0f}")),
        ("held-out ppl (trained, transformers)", get("target", "held_out_ppl")),
        (
            "chat steps / seconds",
            f"{get('chat', 'steps')} / {get('chat', 'seconds', fmt='{:.0f}')}",
        ),
        ("held-out ppl (exported 4-bit, headstart)", get("exported_held_out_ppl")),
        ("held-out ppl, stdlib files", get("exported_held_out_ppl_stdlib")),
        (
            "chat answers that parse / ended",
            f"{code.get('parsed', '-')}/{code.get('prompts', '-')} / {code.get('ended', '-')}",
        ),
        (
            "continuations / tokens",
            f"{get('drafter', 'continuations')} / {get('drafter', 'continuation_tokens')}",
        ),
        ("drafter steps", get("drafter", "steps")),
        ("mean accepted length (code rows)", get("acceptance", "mean_accepted_length")),
        ("mean accepted length (chat)", get("acceptance_chat", "mean_accepted_length")),
        ("speed-up, chain / auto", f"{get('acceptance', 'speedup')} / {get('auto', 'speedup')}"),
        ("mismatching outputs (chain)", get("acceptance", "mismatches")),
        ("drafter_devices", get("drafter_devices")),
        ("package bytes", get("model_bytes")),
    ]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stage", default="all", choices=("all", *STAGES))
    ap.add_argument("--work", default=None, help="what passes between stages (needed per stage)")
    ap.add_argument("--summary", action="store_true", help="print OUT's report table and exit")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--corpus", default=None, help="an unpacked `training.data --tar` corpus")
    ap.add_argument("--stdlib", default=None, help="another copy of the standard library")
    ap.add_argument("--max-chars", type=int, default=10**12, help="read at most this much text")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ppl-rows", type=int, default=256, help="held-out rows measured")
    ap.add_argument("--target-minutes", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=None, help="target steps (default: time budget)")
    ap.add_argument("--eval-every", type=int, default=100, help="target steps between val ppls")
    ap.add_argument("--load-target", default=None, help="skip training: a --save-target copy")
    ap.add_argument("--save-target", default=None, help="also keep the target (fp32 HF) here")
    ap.add_argument("--chat-minutes", type=float, default=1.0)
    ap.add_argument("--chat-steps", type=int, default=None)
    ap.add_argument("--chat-lr", type=float, default=5e-4)
    ap.add_argument("--chat-examples", default=None, help="`training.chat --examples` output")
    ap.add_argument("--chat-max-chars", type=int, default=10**12, help="when building them")
    ap.add_argument("--no-chat", action="store_true")
    ap.add_argument("--drafter-minutes", type=float, default=2.0)
    ap.add_argument("--drafter-steps", type=int, default=None)
    ap.add_argument("--drafter-layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--taps", default=None, help="comma-separated (default: three, spread)")
    ap.add_argument("--continuations", type=int, default=4096, help="prompts continued")
    ap.add_argument("--generation-timeout", type=float, default=600)
    ap.add_argument("--no-drafter", action="store_true")
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--code-max-tokens", type=int, default=256)
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.summary:
        report = json.loads((Path(args.out) / "training_report.json").read_text())
        print(summary_table(report))
        return report
    if args.corpus:
        os.environ["HEADSTART_CORPUS"] = args.corpus
    if args.stdlib:
        os.environ["HEADSTART_STDLIB"] = args.stdlib
    if args.stage != "all" and not args.work:
        raise SystemExit("--stage needs --work (what the stages pass on)")
    stages = list(STAGES) if args.stage == "all" else [args.stage]
    if args.no_chat:
        stages = [s for s in stages if s != "chat"]
    if args.no_drafter:
        stages = [s for s in stages if s != "drafter"]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        run = Run(args, work)
        started = time.perf_counter()
        for stage in stages:
            t0 = time.perf_counter()
            stages_by_name = {
                "data": stage_data,
                "target": stage_target,
                "chat": stage_chat,
                "drafter": stage_drafter,
            }
            stages_by_name.get(stage, stage_eval)(run)
            report = run.report()
            report.setdefault("stage_seconds", {})[stage] = time.perf_counter() - t0
            run.save(report)
            print(f"stage {stage}: {time.perf_counter() - t0:.0f}s")
        report = run.report()
        report["model_bytes"] = model_files_bytes(run.out)
        if args.stage == "all":
            report["total_seconds"] = time.perf_counter() - started
        run.save(report)
    if args.stage == "all":
        print(summary_table(report))
    return report


if __name__ == "__main__":
    main()
