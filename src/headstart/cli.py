"""The ``headstart`` command line: ``headstart run``, ``serve`` and ``bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

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
        help="activation dtype (default: float32 on CPU, bfloat16 on GPU)",
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headstart", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="stream a reply to one prompt to the terminal")
    _add_model_args(run)
    run.add_argument("prompt")
    run.add_argument("--raw", action="store_true", help="no chat template: complete the text")
    run.add_argument("--system", default=None, help="system prompt")
    think = run.add_mutually_exclusive_group()
    think.add_argument(
        "--think",
        dest="think",
        action="store_true",
        default=None,
        help="enable_thinking=true in the chat template",
    )
    think.add_argument(
        "--no-think",
        dest="think",
        action="store_false",
        help="enable_thinking=false in the chat template",
    )
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
        return _run(args)
    except (HeadstartError, ValueError) as e:
        print(f"headstart: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
