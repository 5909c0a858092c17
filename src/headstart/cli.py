"""The ``headstart`` command line: ``headstart run``, ``serve``, ``bench`` and ``train-drafter``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from headstart.errors import HeadstartError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint folder or hub name (default: the embedded small model)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when available, else the CPU), cpu, cuda, cuda:1, ... (default: auto)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="activation dtype (default: bfloat16 on GPU; float32 on CPU, but bfloat16 for 4-bit "
        "checkpoints too big to unpack, which run through the int4 CPU kernel)",
    )


def _run(args: argparse.Namespace) -> int:
    from headstart.generate import Finish, generate
    from headstart.loading import load
    from headstart.sampling import SamplingParams

    loaded = load(args.model, args.device, args.dtype)
    tok = loaded.tokenizer
    if args.raw:
        text = args.prompt
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        kwargs = loaded.template_defaults  # the model folder's (headstart.json)
        if args.think is not None:
            kwargs["enable_thinking"] = args.think
        text = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    defaults = dict(loaded.model.cfg.generation_defaults)
    params = SamplingParams(
        temperature=args.temperature
        if args.temperature is not None
        else defaults.get("temperature", 1.0),
        top_p=args.top_p if args.top_p is not None else defaults.get("top_p", 1.0),
        top_k=args.top_k if args.top_k is not None else int(defaults.get("top_k", 0)),
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty
        if args.repetition_penalty is not None
        else defaults.get("repetition_penalty", 1.0),
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=tuple(args.stop),
    )
    for event in generate(loaded.model, tok, tok.encode(text), params, loaded.eos_token_ids):
        sys.stdout.write(event.text)
        sys.stdout.flush()
        if isinstance(event, Finish):
            sys.stdout.write("\n")
            print(f"[finish: {event.reason}]", file=sys.stderr)
    return 0


def add_train_drafter_args(p: argparse.ArgumentParser) -> None:
    """The options of ``headstart train-drafter`` (``training/selfdistill.py`` does the work)."""
    p.add_argument("--target", required=True, help="the target checkpoint folder")
    p.add_argument(
        "--prompts",
        required=True,
        help="a text file of user messages, one per line, or a .jsonl file of "
        '{"prompt": text} (raw completion) or {"messages": [...]} (chat) objects',
    )
    p.add_argument("--out", required=True, help="the drafter folder to write (serve --drafter)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default: auto)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="the target's dtype (default: as serve's --dtype)",
    )
    p.add_argument("--block", type=int, default=16, help="block size, anchor included (16)")
    p.add_argument("--layers", type=int, default=2, help="drafter layers (2)")
    p.add_argument(
        "--taps",
        default=None,
        help="comma-separated target layers the drafter reads (default: DFlash's rule, "
        "--layers of them evenly spaced from layer 1 to L-3)",
    )
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (the target's)")
    p.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="the block filler id (default: the embedding's last row, when past the tokenizer)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="per continuation (256)")
    p.add_argument("--streams", type=int, default=64, help="prompts generated in one batch (64)")
    p.add_argument("--steps", type=int, default=None, help="training steps")
    p.add_argument(
        "--minutes", type=float, default=None, help="training time (10 when --steps is not given)"
    )
    p.add_argument("--batch", type=int, default=16, help="sequences per step (16)")
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence per step (32)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0)
    _add_think_args(p, "render chat prompts with ", " (default: the folder's headstart.json)")


def _add_think_args(p: argparse.ArgumentParser, before: str, after: str) -> None:
    """``--think`` / ``--no-think`` into ``args.think`` (None when neither is given)."""
    think = p.add_mutually_exclusive_group()
    think.add_argument(
        "--think",
        dest="think",
        action="store_true",
        default=None,
        help=f"{before}enable_thinking=true{after}",
    )
    think.add_argument(
        "--no-think", dest="think", action="store_false", help=f"{before}enable_thinking=false"
    )


def _train_drafter(args: argparse.Namespace) -> int:
    """Run ``training.selfdistill``: the training code lives in the source checkout's
    ``training/`` folder (not in the wheel), found beside ``src/`` when not importable."""
    try:
        from training import selfdistill
    except ImportError:
        root = Path(__file__).resolve().parents[2]
        if not (root / "training" / "selfdistill.py").is_file():
            raise HeadstartError(
                "train-drafter needs the repository's training/ folder: run it from a source "
                "checkout installed with pip install -e ."
            ) from None
        sys.path.insert(0, str(root))
        from training import selfdistill
    return selfdistill.run(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headstart", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="stream a reply to one prompt to the terminal")
    _add_model_args(run)
    run.add_argument("prompt")
    run.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    run.add_argument("--system", default=None, help="system prompt")
    _add_think_args(run, "", " in the chat template")
    run.add_argument("--max-tokens", type=int, default=256)
    run.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy (default: the checkpoint's generation_config)",
    )
    run.add_argument("--top-p", type=float, default=None)
    run.add_argument("--top-k", type=int, default=None)
    run.add_argument("--min-p", type=float, default=0.0)
    run.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="divide the logits of tokens seen already (default: the model's generation_config)",
    )
    run.add_argument("--frequency-penalty", type=float, default=0.0)
    run.add_argument("--presence-penalty", type=float, default=0.0)
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    srv = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    _add_model_args(srv)
    from headstart.server.serve import add_serve_args

    srv.add_argument(
        "model_path",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="checkpoint folder or hub name, as --model",
    )
    add_serve_args(srv)
    bench = sub.add_parser(
        "bench",
        help="benchmark servers (TTFT, decode, bursts) into a "
        "checkable receipt; 'bench check RECEIPT' verifies one",
    )
    from headstart.bench.command import add_bench_args

    add_bench_args(bench)
    distill = sub.add_parser(
        "train-drafter",
        help="train a DFlash drafter for a Qwen3.5 checkpoint on its own greedy "
        "continuations of a prompt file (for serve --drafter)",
    )
    add_train_drafter_args(distill)
    args = parser.parse_args(argv)
    try:
        if args.command in ("run", "serve"):
            from headstart.loading import resolve_device

            args.device_asked, args.device = args.device, resolve_device(args.device)
            if args.command == "serve" and args.model_path is not None:
                if args.model is not None:
                    raise HeadstartError("give the model once: as MODEL or as --model")
                args.model = args.model_path
        if args.command == "serve":
            from headstart.server.serve import serve

            return serve(args)
        if args.command == "bench":
            from headstart.bench.command import main as bench_main

            return bench_main(args, None if argv is None else ["headstart", *argv])
        if args.command == "train-drafter":
            return _train_drafter(args)
        return _run(args)
    except (HeadstartError, ValueError) as e:
        print(f"headstart: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
