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

from headstart.bench.scenarios import AGENT_MAX_TOKENS, SCENARIO_MAX_TOKENS, SCENARIOS
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

prefill scenarios (--scenario; token-id prompts on /v1/completions, each new to the server;
--repeats R per arm per order, the median and each repeat reported):
  long    one new prompt of --prompt-tokens P (8192): its TTFT
  burst   --streams N (16) new prompts of P (31) tokens at once: max and median TTFT; the
          first burst (a server may still compile shapes) is reported apart from the R later
  turn    a --history-tokens H (2000) history (warms the prompt cache), then it plus
          --turn-tokens M (30) new ones: the turn's TTFT, and the same prompt cold
  beside  --streams S (8) streams decoding --decode-tokens D (512) when a new P-token (8192)
          prompt arrives: its TTFT, the decoders' worst inter-token gap during its prefill
          and over the repeat, and their median gap
  agent   an agent loop of --turns N (20) turns, one after another: a P-token (2000) first
          prompt, then per turn the last prompt, the token ids the server answered it
          with (--max-tokens, default 64; the server must return them for logprobs with
          return_tokens_as_token_ids) and an M-token (500) tool result; then the last
          prompt with a new salt (cold). Per turn: TTFT, prompt and cached tokens; the
          median and max TTFT of turns 2..N, the first turn's, the reuse shortfall (cached
          minus the previous prompt and all but its last answer token: 0 or more is full
          reuse) and the cold TTFT. --repeats defaults to 1
  return  a conversation's H-token (4000) history, then --others K (30) other H-token
          conversations one after another (pushing it out of a server's fastest cache
          tier), then it comes back with M (30) new tokens: the return's TTFT, its cached
          tokens and its TTFT over the same prompt cold; with a headstart server, the
          host-tier restore and demotion bandwidths read from its /metrics
  The prompt workload's --bursts, --agree, --token-ids, --thinking and --salt do not apply
  (scenario prompts are always salted); --streams is one count.

examples:
  headstart bench --arm base=http://127.0.0.1:8000 --arm new=http://127.0.0.1:8001
  headstart bench --arm 'a=cmd:headstart serve --port {port} --model ./ckpt --device cuda' \\
                  --arm 'b=cmd:vllm serve ./ckpt --port {port}' --streams 1 16 --bursts 3
  headstart bench --scenario burst --streams 16 --prompt-tokens 31 --arm vllm=http://h:8000
  headstart bench --scenario agent --turns 20 --orders 1 --arm vllm=http://h:8000
  headstart bench --scenario return --others 30 --history-tokens 4000 --orders 1 \
                  --arm 'hs=cmd:headstart serve --port {port} --prompt-cache-host-mib 65536'
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
        default=None,
        metavar="N",
        help="fixed output length, with ignore_eos (default: 128; scenarios: "
        f"{SCENARIO_MAX_TOKENS}, agent {AGENT_MAX_TOKENS})",
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
        default=None,
        metavar="N",
        help="concurrent streams per burst (default: 1 16); scenarios burst and beside: "
        "one count (default: 16 and 8)",
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
    s = p.add_argument_group("prefill scenarios (see below)")
    s.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default=None,
        help="run this scenario instead of the prompt workload",
    )
    s.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        metavar="P",
        help="new prompt length (default: long, beside 8192; burst 31; agent, its first "
        "turn: 2000)",
    )
    s.add_argument(
        "--history-tokens",
        type=int,
        default=None,
        metavar="H",
        help="turn: the cached history (default: 2000); return: the history of every "
        "conversation (default: 4000)",
    )
    s.add_argument(
        "--turn-tokens",
        type=int,
        default=None,
        metavar="M",
        help="turn, return: new tokens after the history (default: 30); agent: the tool "
        "result that ends each turn after the first (default: 500)",
    )
    s.add_argument(
        "--turns",
        type=int,
        default=None,
        metavar="N",
        help="agent: turns of the conversation (default: 20)",
    )
    s.add_argument(
        "--others",
        type=int,
        default=None,
        metavar="K",
        help="return: other conversations sent before the first comes back (default: 30)",
    )
    s.add_argument(
        "--decode-tokens",
        type=int,
        default=None,
        metavar="D",
        help="beside: tokens each decoding stream generates (default: 512); the long "
        "prompt should reach its first token before they end",
    )
    s.add_argument(
        "--repeats",
        type=int,
        default=None,
        metavar="R",
        help="repeats per arm per order (default: 3, agent 1; burst sends its first burst "
        "and R more)",
    )
    s.add_argument(
        "--token-range",
        default=None,
        metavar="LO:HI",
        help="prompt token ids are drawn from [LO, HI), which must lie inside every "
        "arm's vocabulary (default: 1000:4000)",
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
    chk.add_argument(
        "--agree",
        dest="check_agree",
        choices=["all", "single", "none"],
        default=None,
        help="judge output agreement this way instead of as the run recorded",
    )


def _token_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(lo), int(hi)
    except ValueError:
        raise HeadstartError(f"--token-range {text!r}: expected LO:HI, e.g. 1000:4000") from None


def _scenario(args: argparse.Namespace):  # -> scenarios.Scenario | None
    """The scenario the options ask for, or None (the prompt workload); raises
    HeadstartError for options that belong to the other kind of run."""
    from headstart.bench.scenarios import make_scenario

    sizes = (
        "prompt_tokens",
        "history_tokens",
        "turn_tokens",
        "decode_tokens",
        "turns",
        "others",
        "repeats",
    )
    if args.scenario is None:
        given = [n for n in (*sizes, "token_range") if getattr(args, n) is not None]
        if given:
            flags = ", ".join("--" + n.replace("_", "-") for n in given)
            raise HeadstartError(f"{flags}: only with --scenario")
        return None
    workload = {
        "--prompts": args.prompts,
        "--builtin": args.builtin,
        "--prompt-id": args.prompt_id,
        "--max-prompts": args.max_prompts,
    }
    given = [flag for flag, value in workload.items() if value]
    if given:
        raise HeadstartError(f"{', '.join(given)}: not with --scenario (its prompts are token ids)")
    streams = args.streams or [None]
    if len(streams) > 1:
        raise HeadstartError("--scenario takes one --streams count")
    lo, hi = _token_range(args.token_range) if args.token_range else (None, None)
    return make_scenario(
        args.scenario,
        streams=streams[0],
        token_lo=lo,
        token_hi=hi,
        **{n: getattr(args, n) for n in sizes},
    )


def _plan(args: argparse.Namespace):  # -> runner.Plan (imported lazily)
    from headstart.bench.arms import parse_arms
    from headstart.bench.runner import Plan
    from headstart.bench.scenarios import default_max_tokens
    from headstart.bench.workload import Sampling, builtin_prompts, load_prompt_file, select_prompts

    scenario = _scenario(args)
    max_tokens = args.max_tokens
    if max_tokens is None:
        max_tokens = 128 if scenario is None else default_max_tokens(scenario.name)
    streams = args.streams or [1, 16]
    counts = {"--orders": args.orders, "--max-tokens": max_tokens, "--bursts": args.bursts}
    for flag, value in counts.items():
        if value < 1:
            raise HeadstartError(f"{flag} must be at least 1")
    if any(s < 1 for s in streams):
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
    prompts = []
    if scenario is None:
        prompts = builtin_prompts(args.builtin or ("none" if args.prompts else "all"))
        for f in args.prompts:
            prompts += load_prompt_file(f)
        prompts = select_prompts(prompts, args.prompt_id, args.max_prompts)
    out = Path(args.out or f"bench-receipts/{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%SZ}")
    if out.exists() and any(out.iterdir()):
        raise HeadstartError(f"--out {out} exists and is not empty; give a new folder")
    return Plan(
        arms=parse_arms(args.arm),
        prompts=prompts,
        sampling=Sampling(
            max_tokens=max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            thinking=args.thinking,
            token_ids=args.token_ids,
            extra=extra,
        ),
        streams=list(dict.fromkeys(streams)),
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
        scenario=scenario,
    )


def main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run ``headstart bench`` (0: receipt written and checked) or ``bench check``
    (0: the receipt passed; 1: it failed, problems printed)."""
    if args.bench_command == "check":
        from headstart.bench.check import check_receipt

        report = check_receipt(args.receipt, getattr(args, "check_agree", None))
        print(report.text(), file=sys.stdout if report.ok else sys.stderr)
        return 0 if report.ok else 1
    plan, argv = _plan(args), argv if argv is not None else sys.argv
    if plan.scenario is not None:  # a prefill scenario instead of the prompt workload
        from headstart.bench.scenario_run import run_scenario

        return run_scenario(plan, argv)
    from headstart.bench.runner import run

    return run(plan, argv)
