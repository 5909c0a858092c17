"""The ``headstart bench`` command line: options, validation, and dispatch.

Job: declare ``headstart bench [options]`` and ``headstart bench check RECEIPT`` on a parser
handed over by ``headstart.cli`` (importing nothing heavy, so ``headstart --help`` stays
fast), turn the options into a :class:`~headstart.bench.runner.Plan`, and run it.

Non-goals: everything the plan does once it runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

from headstart.errors import HeadstartError

EPILOG = """\
arms:
  --arm NAME=URL                      an already running OpenAI-compatible server
  --arm 'NAME=cmd:COMMAND --port {port}'
                                      a command started fresh per arm per order on a free
                                      port ({port}); {python} is this Python. Readiness is
                                      awaited on /health or /v1/models.
  without --arm: one arm 'headstart=cmd:{python} -m headstart serve --port {port}'
  (the embedded default model).

workload, per arm per order, for each prompt: one cold (first-use) request, then --bursts
rounds of one burst per --streams count; round 0 is reported as "primed".

examples:
  headstart bench --arm base=http://127.0.0.1:8000 --arm new=http://127.0.0.1:8001
  headstart bench --arm 'a=cmd:headstart serve --port {port} --model ./ckpt --device cuda' \\
                  --arm 'b=cmd:vllm serve ./ckpt --port {port}' --streams 1 16 --bursts 3
  headstart bench check bench-receipts/20260101T000000
"""


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Declare the ``bench`` options and its ``check`` subcommand on ``p``."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    g = p.add_argument_group("arms")
    g.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="SPEC",
        help="NAME=URL or 'NAME=cmd:COMMAND' (repeatable; see below)",
    )
    g.add_argument(
        "--orders",
        type=int,
        default=2,
        metavar="K",
        help="alternating arm orders: as given, reversed, ... (default: 2)",
    )
    g.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds a server gets to become ready (default: 600)",
    )
    g.add_argument(
        "--model-name",
        default=None,
        metavar="NAME",
        help="'model' sent in requests (default: the server's first /v1/models id)",
    )
    g.add_argument(
        "--api-key-env",
        default=None,
        metavar="VAR",
        help="send the key in environment variable VAR as a Bearer token",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--prompts",
        action="append",
        default=[],
        metavar="FILE",
        help="JSON/JSONL prompts or conversations (repeatable)",
    )
    w.add_argument(
        "--builtin",
        choices=["all", "code", "chat", "none"],
        default=None,
        help="built-in prompts (default: all, or none when --prompts is given)",
    )
    w.add_argument(
        "--prompt-id",
        action="append",
        default=[],
        metavar="ID",
        help="only these prompts (repeatable)",
    )
    w.add_argument("--max-prompts", type=int, default=None, metavar="K")
    w.add_argument(
        "--thinking",
        choices=["on", "off", "omit"],
        default="off",
        help="chat_template_kwargs.enable_thinking (omit: send none; default off)",
    )
    w.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        metavar="N",
        help="fixed output length, with ignore_eos (default: 128)",
    )
    w.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="(default: 0, greedy)"
    )
    w.add_argument(
        "--seed", type=int, default=0, metavar="N", help="sent with every request (default: 0)"
    )
    w.add_argument("--no-seed", dest="seed", action="store_const", const=None, help="send no seed")
    w.add_argument(
        "--streams",
        type=int,
        nargs="+",
        default=[1, 16],
        metavar="N",
        help="concurrent streams per burst (default: 1 16)",
    )
    w.add_argument(
        "--bursts",
        type=int,
        default=3,
        metavar="R",
        help="rounds of bursts per prompt after the cold request (default: 3)",
    )
    w.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="JSON object merged into every request body",
    )
    w.add_argument(
        "--salt",
        choices=["auto", "always", "never"],
        default="auto",
        help="tag prompts per order so cold requests are uncached (auto: when an arm is a URL)",
    )
    w.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds per request (default: 600)",
    )
    r = p.add_argument_group("receipt")
    r.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="receipt folder (default: bench-receipts/<UTC time>)",
    )
    r.add_argument(
        "--agree",
        choices=["all", "single", "none"],
        default="all",
        help="which equal requests must give equal outputs: all, single-stream "
        "only, or none (default: all)",
    )
    r.add_argument(
        "--token-ids",
        action="store_true",
        help="request token ids (logprobs) so fingerprints cover tokens, not text",
    )
    r.add_argument(
        "--no-model-hash",
        dest="hash_models",
        action="store_false",
        help="skip hashing the arms' model files",
    )
    r.add_argument("--no-plot", dest="plot", action="store_false", help="no ttft.png")
    r.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar on stderr"
    )
    sub = p.add_subparsers(dest="bench_command", metavar="{check}")
    chk = sub.add_parser(
        "check",
        help="verify a receipt: recompute every summary from the raw "
        "rows and compare outputs across arms",
    )
    chk.add_argument("receipt", help="the receipt folder")


def _plan(args: argparse.Namespace):  # -> runner.Plan (imported lazily)
    from headstart.bench.arms import parse_arms
    from headstart.bench.runner import Plan
    from headstart.bench.workload import Sampling, builtin_prompts, load_prompt_file, select_prompts

    for name in ("orders", "max_tokens", "bursts"):
        if getattr(args, name) < 1:
            raise HeadstartError(f"--{name.replace('_', '-')} must be at least 1")
    if any(s < 1 for s in args.streams):
        raise HeadstartError("--streams values must be at least 1")
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise HeadstartError(f"--extra-body is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise HeadstartError("--extra-body must be a JSON object")
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise HeadstartError(f"--api-key-env: ${args.api_key_env} is not set")
    builtin = args.builtin or ("none" if args.prompts else "all")
    prompts = builtin_prompts(builtin)
    for f in args.prompts:
        prompts += load_prompt_file(f)
    out = Path(args.out or f"bench-receipts/{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}")
    if out.exists() and any(out.iterdir()):
        raise HeadstartError(f"--out {out} exists and is not empty; give a new folder")
    return Plan(
        arms=parse_arms(args.arm),
        prompts=select_prompts(prompts, args.prompt_id, args.max_prompts),
        sampling=Sampling(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            thinking=args.thinking,
            token_ids=args.token_ids,
            extra=extra,
        ),
        streams=list(dict.fromkeys(args.streams)),
        bursts=args.bursts,
        orders=args.orders,
        agree=args.agree,
        salt=args.salt,
        out=out,
        ready_timeout=args.ready_timeout,
        request_timeout=args.request_timeout,
        model_name=args.model_name,
        api_key=api_key,
        hash_models=args.hash_models,
        plot=args.plot,
        progress=args.progress,
    )


def main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run ``headstart bench`` (0: receipt written and checked) or ``bench check``
    (0: the receipt passed; 1: it failed, problems printed)."""
    if args.bench_command == "check":
        from headstart.bench.check import check_receipt

        report = check_receipt(args.receipt)
        print(report.text(), file=sys.stdout if report.ok else sys.stderr)
        return 0 if report.ok else 1
    from headstart.bench.runner import run

    return run(_plan(args), argv if argv is not None else sys.argv)
