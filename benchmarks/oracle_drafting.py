"""Speculative decoding's ceiling for a given acceptance: an oracle drafter, random weights.

    python benchmarks/oracle_drafting.py [--shape 27b|2b|tiny] [--format 4bit|bf16]
        [--streams 1 16] [--accept 2 4 7] [--block 8] [--new-tokens 121] [--prompt 32]
        [--reps 3] [--refine 32] [--out FILE]

At a real Qwen3.5 shape with random weights (made on the device, as ``serve --load-format
dummy`` makes them), one engine serves everything: CUDA graphs for decode steps, chain verify
windows, rollbacks and proposals; prompt and continuation graphs off (only decode is measured,
and their capture is a large part of a 27B start-up). For each stream count S:

1. plain greedy decode of S fixed prompts, N new tokens each, with drafting opted out per
   request (``EngineRequest(draft=False)``, the same decode graphs): an unmeasured run records
   the tokens, then ``--reps`` measured runs must give them again;
2. for each k, the same requests through the engine's speculative path (chain mode: verify
   windows of ``--block`` rows, rollback of the rejected rows) with :class:`OracleDrafter`,
   which proposes, every round, the next k tokens of the stream's recorded greedy continuation
   and then ``block - 1 - k`` wrong ones, so that the target accepts exactly k.

Checks, per measured run: the output equals plain decode's, token for token; the engine's
counters (``spec_rounds``, ``spec_drafted``, ``spec_accepted``) equal those of rounds that
accept exactly k (:func:`expected_counts`; the last rounds of a stream are shorter when few
tokens remain). Reports decode tokens/s (the tokens after each stream's first, over the time
from the first first-token to the last finish: prefill excluded), the speed-up over plain
decode at the same stream count, accepted tokens per round, wall ms per engine step and host ms
per step in a few engine calls (:class:`PhaseClock`). Prints one table last; ``--out`` writes
the rows as JSON.

The oracle. The engine takes a drafter as a :class:`DFlashDrafter`: the speculator reads its
config (block size, tapped target layers), asks it for a context ring (``new_pool``), feeds it
the target's features (``add_context``) and asks for proposal logits (``propose_logits``, or
replays of ``propose_from`` captured in draft graphs). :class:`OracleDrafter` is a subclass
with a one-layer config and no weights: ``add_context`` runs no network (it writes a stream's
recorded sequence into a device table, once, when the stream first drafts in its slot) and
``propose_from`` makes the logits from that table with a gather and a one-hot fill (device ops
only, so the draft graphs capture it). So a round costs what the verify/rollback path costs,
plus logits of a real drafter's shape ``[streams, block - 1, vocab]`` that the engine masks
and reduces as it would a real drafter's.

Near-ties. On random bf16 weights two tokens' logits can be closer than the rounding
difference between kernels tiled for one row (decode) and for a window's rows, and the verify
path then picks another token than plain decode did (tests/test_gpu_model.py says the same).
Drafts from the plain record would be wrong from there on, and the run would measure that, not
the path. So when a speculative run's output differs from the record it was given, that output
becomes the record and the run repeats (at most ``--refine`` times): a record the verify path
reproduces is the target's own greedy continuation as that path computes it. The report says
whether the output still equals plain decode's and, at the first difference, the gap between
the two tokens' logits in one eager forward beside that row's spread (a near-tie is a gap that
is a small fraction of the spread).

``--shape tiny`` (4 layers, hidden 64) runs the same on the CPU in float32, graphs emulated
(``GraphConfig(enabled=True, capture=False)``: the graphs' bookkeeping with eager forwards);
tests/test_oracle_drafting.py runs it. Its speeds say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import config as shape_config

from headstart.batch import ForwardBatch, SeqChunk
from headstart.engine.config import EngineConfig, GraphConfig, SchedulingConfig, SpecConfig
from headstart.engine.engine import Engine, EngineRequest, Failed, Finish, Piece
from headstart.engine.scheduler import Scheduler
from headstart.engine.scheduler import Sequence as Seq
from headstart.engine.spec.drafter import (
    DFlashDrafter,
    DrafterConfig,
    DrafterPool,
    default_target_layer_ids,
)
from headstart.loading import default_model_dir
from headstart.models.qwen35.config import FULL, LINEAR, ModelConfig, Quantization, QuantSpec
from headstart.models.qwen35.dummy import random_weights
from headstart.models.qwen35.model import Qwen35Model
from headstart.sampling import SamplingParams
from headstart.tokenizer import Tokenizer

COUNTS = ("rounds", "drafted", "accepted")  # the engine's speculative counters compared


def tiny_config(quant: bool) -> ModelConfig:
    """A 4-layer Qwen3.5 (3 GDN + 1 attention, hidden 64) for the CPU: every matrix's input
    width a multiple of 64, so ``--format 4bit`` quantizes them all."""
    return ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_ids=(),
        quantization=Quantization(QuantSpec(4, 64)) if quant else None,
    )


def build_model(shape: str, fmt: str, device: torch.device) -> Qwen35Model:
    """Random weights at ``shape`` (gpu_engine.py's 27b / 2b, or :func:`tiny_config`): bf16
    on a GPU, float32 (the reference kernels') on the CPU; ``fmt`` "4bit": MLX affine 4-bit."""
    quant = fmt == "4bit"
    cfg = tiny_config(quant) if shape == "tiny" else shape_config(shape, quant)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return Qwen35Model(cfg, random_weights(cfg, device, dtype, seed=0), dtype, device)


class OracleDrafter(DFlashDrafter):
    """A drafter that knows each stream's recorded greedy sequence and proposes from it.

    For a stream whose record is ``prompt + output``, a round with its anchor at position p
    proposes the recorded tokens at p+1 .. p+k (k: :attr:`accept`, a device scalar read by
    every proposal, captured ones included), then the recorded token + 1 (mod the vocabulary)
    at the positions after: accepted exactly k when the record is what the target computes.

    What the engine sees is a :class:`DFlashDrafter` (its config: the block size and the
    tapped layers, those of DFlash's rule for five draft layers, so the target's forwards copy
    out as many features as a real pair's would; its ring; its proposal logits). Which stream a
    slot holds comes from the engine's scheduler (:meth:`attach`), read on the engine thread
    when the stream first drafts there; the table row is written then, the rounds only read it.
    """

    def __init__(
        self, target: Qwen35Model, block: int, vocab: int, num_slots: int, context: int
    ) -> None:
        """``vocab``: the tokens the engine may emit (logits past it are masked); the table
        has a row per slot and one for the speculator's spare ring slot (padding streams of
        draft graphs), ``context`` positions each."""
        layers = target.cfg.num_hidden_layers
        taps = tuple(sorted(set(default_target_layer_ids(layers, min(5, layers)))))
        cfg = DrafterConfig(
            hidden_size=target.cfg.hidden_size,
            intermediate_size=1,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=2,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            block_size=block,
            mask_token_id=0,
            target_layer_ids=taps,
            causal=(False,),
            sliding_window=(0,),
        )
        super().__init__(cfg, {}, target)  # no weights: nothing of the network runs
        self.vocab = vocab
        self.table = torch.zeros(num_slots + 1, context, dtype=torch.int64, device=self.device)
        self.accept = torch.zeros((), dtype=torch.int64, device=self.device)
        self.records: dict[tuple[int, ...], list[int]] = {}
        self._scheduler: Scheduler | None = None
        self._occupants: dict[int, Seq] = {}  # slot -> the stream its table row holds

    def attach(self, engine: Engine) -> None:
        """Serve ``engine``'s streams (before this, calls are its start-up's own)."""
        self._scheduler = engine.scheduler

    def set_records(self, records: Mapping[tuple[int, ...], Sequence[int]], accept: int) -> None:
        """Greedy outputs by prompt, and how many drafts of each round are right. Call while
        the engine is idle (the engine thread reads both)."""
        assert 0 <= accept < self.cfg.block_size
        self.records = {tuple(p): list(t) for p, t in records.items()}
        self._occupants.clear()  # every table row is rewritten on its stream's first round
        self.accept.fill_(accept)

    def add_context(self, pool: DrafterPool, slot: int, features: torch.Tensor, start: int) -> None:
        """Not the network's context rows: when ``slot`` holds a stream not yet in its table
        row, write that stream's recorded sequence there (one copy per stream). The speculator
        calls this before each round's proposal for every stream with new features, which a
        stream's first round always has (its prompt's); were it not called, the row would
        still hold another stream's and the counts check would fail."""
        if self._scheduler is None:  # the engine's warm-up and measurements
            return
        seq = next((s for s in self._scheduler.running if s.slot == slot), None)
        if seq is None or self._occupants.get(slot) is seq:
            return
        self._occupants[slot] = seq
        known = seq.prompt + self.records.get(tuple(seq.prompt), [])
        row = torch.zeros(self.table.shape[1], dtype=torch.int64)
        n = min(len(known), row.shape[0])
        row[:n] = torch.tensor(known[:n], dtype=torch.int64)
        self.table[slot].copy_(row)

    def add_context_rows(
        self,
        pool: DrafterPool,
        slot_t: torch.Tensor,
        features: torch.Tensor,
        start_t: torch.Tensor,
        count_t: torch.Tensor,
    ) -> None:
        """Nothing (a whole device round's context rows): the table row holds the stream's
        whole record from its first round on (:meth:`add_context`)."""

    @torch.no_grad()
    def propose_from(
        self,
        pool: DrafterPool,
        slot_t: torch.Tensor,
        anchor_t: torch.Tensor,
        position_t: torch.Tensor,
        block: int,
        rows: int | None = None,
    ) -> torch.Tensor:
        """Logits ``[n, block - 1, target vocab]``, -inf but 0 at each draft (see the class);
        device ops only, as draft graphs capture this."""
        dev = self.device
        j = torch.arange(1, block, device=dev)  # draft j sits at the anchor's position + j
        pos = (position_t[:, None] + j).clamp(max=self.table.shape[1] - 1)
        recorded = self.table[slot_t[:, None], pos]
        drafts = torch.where(j <= self.accept, recorded, (recorded + 1) % self.vocab)
        logits = torch.full(
            (slot_t.shape[0], block - 1, self.target.cfg.vocab_size),
            float("-inf"),
            dtype=self.dtype,
            device=dev,
        )
        return logits.scatter_(2, drafts[..., None], 0.0)


def expected_counts(new_tokens: int, block: int, accept: int) -> dict[str, int]:
    """The engine's speculative counters for one greedy stream of ``new_tokens`` whose rounds
    accept ``accept`` drafts when they draft that many: the first token comes from the prompt;
    then each round drafts ``min(block, room) - 1`` tokens (room: tokens still to emit) and
    emits its accepted drafts and one token of the target's; with one token left the step is
    plain (Speculator.drafts needs room for two). The context is assumed not to bind."""
    produced, counts = 1, dict.fromkeys(COUNTS, 0)
    while produced < new_tokens:
        depth = min(block, new_tokens - produced) - 1
        if depth < 1:
            produced += 1
            continue
        hit = min(accept, depth)
        counts["rounds"] += 1
        counts["drafted"] += depth
        counts["accepted"] += hit
        produced += hit + 1
    return counts


class Recorder:
    """One request's sink: its tokens, the host clock at its first token and at its end, and
    the engine's step count at its first token (called on the engine thread)."""

    def __init__(self, steps: Callable[[], int]) -> None:
        self.steps = steps
        self.tokens: list[int] = []
        self.first: float | None = None
        self.first_step = 0
        self.end: float | None = None
        self.error: str | None = None
        self.done = threading.Event()

    def __call__(self, event: Piece | Finish | Failed) -> None:
        now = time.perf_counter()
        if isinstance(event, Piece):
            if self.first is None:
                self.first, self.first_step = now, self.steps()
            self.tokens.append(event.token_id)
            return
        self.end = now
        if isinstance(event, Failed):
            self.error = event.message
        self.done.set()


class PhaseClock:
    """Host seconds in a few of the engine's calls, wrapped on the instances: "draft"
    (Speculator.propose: feeding the drafter and its proposals), "forward" (ModelRunner.run:
    graph replays or an eager forward, enqueued), "verify" (Engine._settle_round, per stream:
    judging its window, rollback, delivery) and "sample" (Engine._sample_and_deliver: the plain
    rows). On a GPU a call's first host sync waits for the device work before it: "verify" and
    "sample" include the forward's device time, "draft" what the previous step left running
    (rollbacks). Wrap before the engine starts."""

    def __init__(self, engine: Engine) -> None:
        self.seconds: dict[str, float] = {}
        wrapped = {
            "draft": (engine.spec, "propose"),
            "forward": (engine.runner, "run"),
            "verify": (engine, "_settle_round"),
            "sample": (engine, "_sample_and_deliver"),
        }
        for name, (owner, attr) in wrapped.items():
            if owner is not None:
                self._wrap(name, owner, attr)

    def _wrap(self, name: str, owner: object, attr: str) -> None:
        inner = getattr(owner, attr)
        self.seconds[name] = 0.0

        def timed(*args: Any, **kwargs: Any) -> Any:
            # The totals of the run in which the call began: the engine thread may still be
            # in the call that delivered a run's last token when the next run resets.
            totals, t0 = self.seconds, time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - t0

        setattr(owner, attr, timed)

    def reset(self) -> None:
        """Start new totals (the previous ones stay with whoever holds them)."""
        self.seconds = dict.fromkeys(self.seconds, 0.0)


@dataclass
class Run:
    """One batch of requests served to their end."""

    tokens: list[list[int]]
    decode_s: float  # first first-token -> last finish
    decode_tokens: int  # tokens after each stream's first
    decode_steps: int  # engine steps after the one that gave the first token
    steps: int  # every step of the run
    counts: dict[str, int]  # the engine's speculative counters, this run's share
    phases: dict[str, float]  # PhaseClock seconds

    @property
    def tok_s(self) -> float:
        return self.decode_tokens / self.decode_s

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.decode_s / max(1, self.decode_steps)


class Bench:
    """The model, the oracle and one started engine for a set of arguments (see
    :func:`parse_args`); :meth:`close` stops the engine."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cuda = self.device.type == "cuda"
        t0 = time.perf_counter()
        self.model = build_model(args.shape, args.format, self.device)
        self.build_s = time.perf_counter() - t0
        # Any tokenizer serves for timing: logits past its vocabulary are masked (a real
        # checkpoint's padding rows are too), the streams' tokens stay below it.
        self.tokenizer = Tokenizer.from_dir(default_model_dir())
        self.vocab = min(self.tokenizer.vocab_size, self.model.cfg.vocab_size)
        self.slots = args.slots or max(args.streams)
        # Room for every prompt, its tokens and a window past them (windows pad to the block).
        self.context = -(-(args.prompt + args.new_tokens + 2 * args.block) // 64) * 64
        self.oracle = OracleDrafter(self.model, args.block, self.vocab, self.slots, self.context)
        config = EngineConfig(
            self.slots,
            self.context,
            # Chunks as long as a prompt (the eager warm-up then skips a 512-token forward);
            # requests sent together start in one step (a gap of 5 ms without another).
            scheduling=SchedulingConfig(
                prefill_chunk=max(16, args.prompt), gather_gap_s=0.005, gather_max_s=0.05
            ),
            spec=SpecConfig(mode="chain"),
            graphs=GraphConfig(
                enabled=None if cuda else True,
                capture=cuda,
                prefill_tokens=0,
                continuations=False,
                windows=True,
            ),
        )
        t0 = time.perf_counter()
        self.engine = Engine(self.model, self.tokenizer, (), config, drafter=self.oracle)
        self.start_s = time.perf_counter() - t0
        self.oracle.attach(self.engine)
        self.clock = PhaseClock(self.engine)
        self.engine.start()
        self._ids = itertools.count()

    def close(self) -> None:
        self.engine.stop()

    def prompts(self, streams: int) -> list[list[int]]:
        """``streams`` distinct fixed prompts (the first ``n`` are the same for every n)."""
        out = []
        for i in range(streams):
            g = torch.Generator().manual_seed(1000 + i)
            out.append(torch.randint(5, self.vocab, (self.args.prompt,), generator=g).tolist())
        assert len({tuple(p) for p in out}) == len(out), "prompts must differ"
        return out

    def generate(self, prompts: Sequence[Sequence[int]], draft: bool) -> Run:
        """Greedy, ``--new-tokens`` each, all submitted at once; waits for every end."""
        n = self.args.new_tokens
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        e = self.engine
        before, steps0 = e.stats(), e.steps
        self.clock.reset()
        sinks = [Recorder(lambda: e.steps) for _ in prompts]
        for ids, sink in zip(prompts, sinks, strict=True):
            e.submit(EngineRequest(f"o{next(self._ids)}", list(ids), params, n, sink, draft=draft))
        for sink in sinks:
            if not sink.done.wait(600):
                raise TimeoutError("a request did not finish in 600 s")
            if sink.error is not None:
                raise RuntimeError(f"a request failed: {sink.error}")
            if len(sink.tokens) != n:
                raise RuntimeError(f"a request ended after {len(sink.tokens)} of {n} tokens")
        after = e.stats()
        return Run(
            tokens=[s.tokens for s in sinks],
            decode_s=max(s.end for s in sinks) - min(s.first for s in sinks),
            decode_tokens=sum(len(s.tokens) - 1 for s in sinks),
            decode_steps=e.steps - min(s.first_step for s in sinks),
            steps=e.steps - steps0,
            counts={k: int(after[f"spec_{k}"] - before[f"spec_{k}"]) for k in COUNTS},
            phases=self.clock.seconds,  # still this run's totals after the next reset
        )

    def spec(
        self, prompts: Sequence[Sequence[int]], record: Sequence[Sequence[int]], accept: int
    ) -> Run:
        """The requests through the speculative path, the oracle proposing from ``record``
        (per prompt, its greedy output) with ``accept`` right drafts a round."""
        self.oracle.set_records(dict(zip(map(tuple, prompts), record, strict=True)), accept)
        return self.generate(prompts, draft=True)

    def env(self) -> dict:
        """What the rows were measured on."""
        args = self.args
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        cuda = self.device.type == "cuda"
        return {
            "device": torch.cuda.get_device_name(self.device) if cuda else "cpu",
            "torch": torch.__version__,
            "commit": commit,
            "shape": args.shape,
            "format": args.format,
            "block": args.block,
            "new_tokens": args.new_tokens,
            "prompt": args.prompt,
            "build_s": self.build_s,
            "engine_start_s": self.start_s,
        }

    def expected(self, streams: int, accept: int) -> dict[str, int]:
        one = expected_counts(self.args.new_tokens, self.args.block, accept)
        return {k: v * streams for k, v in one.items()}

    def logit_gap(
        self, prompt: Sequence[int], tokens: Sequence[int], index: int, other: int
    ) -> dict[str, float]:
        """At output ``index`` of a stream whose run chose ``tokens[index]`` where another
        chose ``other``: their logits' difference in one eager forward of the prefix, and that
        row's standard deviation and top-2 gap (engine idle: a pool of its own)."""
        ids = tuple(prompt) + tuple(tokens[:index])
        pool = self.model.new_state_pool(1, len(ids) + 1)
        batch = ForwardBatch.build([SeqChunk(0, 0, ids)], self.device)
        with torch.no_grad():
            row = self.model.forward(batch, pool)[-1, : self.vocab].float()
        top = row.topk(2).values
        return {
            "gap": float(row[tokens[index]] - row[other]),
            "std": float(row.std()),
            "top2_gap": float(top[0] - top[1]),
        }

    def settle_record(
        self,
        prompts: Sequence[Sequence[int]],
        record: list[list[int]],
        accept: int,
        limit: int,
    ) -> tuple[list[list[int]], int, Run]:
        """Run the oracle from ``record``; while the output differs from the record it was
        given (near-ties, see the module), at most ``limit`` times, take the output as the
        record and run again. Returns the last record, how often it changed, the last run."""
        run, changed = self.spec(prompts, record, accept), 0
        while run.tokens != record and changed < limit:
            # Each pass agrees with the record up to its first difference and only later
            # windows can differ, so the agreeing prefix grows every pass: a stream of N
            # tokens with d near-ties settles in about d passes.
            where = first_difference(record, run.tokens)
            print(f"k={accept}: refinement {changed + 1}, first difference at {where}", flush=True)
            record, changed = run.tokens, changed + 1
            run = self.spec(prompts, record, accept)
        return record, changed, run

    def measure(self, streams: int) -> list[dict]:
        """Plain decode then each k at ``streams`` streams: one row each (see the module)."""
        args = self.args
        prompts = self.prompts(streams)
        plain = self.generate(prompts, draft=False).tokens  # first use of these shapes
        runs = [self.generate(prompts, draft=False) for _ in range(args.reps)]
        base = sorted(r.tok_s for r in runs)[(len(runs) - 1) // 2]  # as _row takes it
        same = all(r.tokens == plain for r in runs)
        none = all(r.counts == dict.fromkeys(COUNTS, 0) for r in runs)  # drafting opted out
        rows = [_row(streams, None, runs, base, same, None, 0, none)]
        print(json.dumps(rows[-1]), flush=True)
        for k in args.accept:
            # The settling runs are also the first use of k's window widths: unmeasured.
            record, refined, check = self.settle_record(prompts, plain, k, args.refine)
            runs = [self.spec(prompts, record, k) for _ in range(args.reps)]
            expected = self.expected(streams, k)
            exact = check.tokens == record and all(
                r.tokens == record and r.counts == expected for r in runs
            )
            where, diff = first_difference(plain, runs[-1].tokens), None
            if where is not None:  # say whether it is a near-tie (see the module)
                s, i = where
                gap = self.logit_gap(prompts[s], plain[s], i, runs[-1].tokens[s][i])
                diff = {"stream": s, "index": i, **gap}
            same = where is None and all(r.tokens == plain for r in runs)
            rows.append(_row(streams, k, runs, base, same, diff, refined, exact, expected))
            print(json.dumps(rows[-1]), flush=True)
        return rows


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(stream, index) of the first token where two runs' outputs differ; None if equal."""
    for s, (x, y) in enumerate(zip(a, b, strict=True)):
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            if u != v:
                return s, i
    return None


def _row(
    streams: int,
    accept: int | None,
    runs: list[Run],
    plain_tok_s: float,
    same: bool,
    diff: dict | None,
    refined: int,
    exact: bool,
    expected: dict[str, int] | None = None,
) -> dict:
    """A table row from the measured runs: every figure from the median run by tokens/s
    (with an even count, the slower of the middle two), the plain rate from the plain row's."""
    mid = sorted(runs, key=lambda r: r.tok_s)[(len(runs) - 1) // 2]
    rounds = mid.counts["rounds"]
    return {
        "streams": streams,
        "accept": accept,
        "tok_s": mid.tok_s,
        "speedup": mid.tok_s / plain_tok_s,
        "accepted_per_round": mid.counts["accepted"] / rounds if rounds else None,
        "tokens_per_step": mid.decode_tokens / max(1, mid.decode_steps) / streams,
        "ms_per_step": mid.ms_per_step,
        "host_ms_per_step": {k: 1e3 * v / max(1, mid.steps) for k, v in mid.phases.items()},
        "same_as_plain": same,
        "first_difference": diff,
        "refinements": refined,
        "exact_counts": exact,
        "counts": mid.counts,
        "expected_counts": expected,
        "runs_tok_s": [r.tok_s for r in runs],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="27b", choices=["27b", "2b", "tiny"])
    ap.add_argument("--format", default="4bit", choices=["4bit", "bf16"])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--slots", type=int, default=None, help="engine slots (default: most streams)")
    ap.add_argument("--accept", type=int, nargs="+", default=[2, 4, 7], help="k: right drafts")
    ap.add_argument("--block", type=int, default=8, help="verify window rows (1 + drafts)")
    # 121: N - 1 = 120 is a multiple of k + 1 for k = 2, 4, 7, so every round accepts k.
    ap.add_argument("--new-tokens", type=int, default=121)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream")
    ap.add_argument("--reps", type=int, default=3, help="measured runs per row")
    ap.add_argument("--refine", type=int, default=32, help="record refinements (near-ties)")
    ap.add_argument("--device", default=None, help="default: cuda when there is one")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if any(not 0 <= k < args.block for k in args.accept):
        ap.error("every --accept k must satisfy 0 <= k < --block")
    if args.reps < 1 or args.new_tokens < 2:
        ap.error("--reps must be >= 1 and --new-tokens >= 2")
    return args


def run(args: argparse.Namespace) -> dict:
    """Build, measure every stream count, stop; the rows and what they were measured on."""
    bench = Bench(args)
    try:
        rows = [row for streams in args.streams for row in bench.measure(streams)]
    finally:
        bench.close()
    return {"env": bench.env(), "rows": rows}


def table(result: dict) -> str:
    """The rows as a fixed-width table."""
    env = result["env"]
    lines = [
        f"{env['shape']} {env['format']} on {env['device']}: block {env['block']}, "
        f"{env['new_tokens']} new tokens, {env['prompt']}-token prompts; model built in "
        f"{env['build_s']:.1f} s, engine started in {env['engine_start_s']:.1f} s",
        "streams  k  tok/s      x plain  acc/round  tok/step  ms/step  same as plain  exact k",
    ]
    for r in result["rows"]:
        k = "-" if r["accept"] is None else str(r["accept"])
        acc = "-" if r["accepted_per_round"] is None else f"{r['accepted_per_round']:.2f}"
        same = "yes" if r["same_as_plain"] else "NO"
        if r["first_difference"] is not None:
            d = r["first_difference"]
            same += f" (s{d['stream']} t{d['index']}: gap {d['gap']:.3g}, std {d['std']:.3g})"
        if r["accept"] is None:  # plain: no round may have run
            exact = "-" if r["exact_counts"] else "NO (it drafted)"
        else:
            exact = "yes" if r["exact_counts"] else "NO"
        if r["refinements"]:
            exact += f" ({r['refinements']} refined)"
        lines.append(
            f"{r['streams']:7d}  {k:>1}  {r['tok_s']:9.1f}  {r['speedup']:7.2f}  {acc:>9}  "
            f"{r['tokens_per_step']:8.2f}  {r['ms_per_step']:7.2f}  {same:<13}  {exact}"
        )
    lines.append("host ms per step (draft / forward / verify / sample):")
    for r in result["rows"]:
        k = "plain" if r["accept"] is None else f"k={r['accept']}"
        ph = r["host_ms_per_step"]
        parts = " / ".join(
            f"{ph.get(p, 0.0):.2f}" for p in ("draft", "forward", "verify", "sample")
        )
        lines.append(f"  {r['streams']} streams, {k}: {parts}")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    result = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["env"]))
    print(table(result))


if __name__ == "__main__":
    main()
