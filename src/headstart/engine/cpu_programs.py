"""Compiled decode steps on the CPU; the only module that compiles.

Why: on a CPU an eager decode step of a small model is mostly dispatch, about 900 small aten
ops a step each paying Python and dispatcher overhead (BENCHMARKS.md). A model that offers
``decode_program`` (its decode forward as a pure function of its tensors: fixed shapes, no host
syncs, fixed-size state returned rather than written in place; Qwen3.5's ``decode_step.py``)
gets it traced once per stream bucket (1, 2, 4, ... up to the slots) with ``make_fx`` and
compiled by inductor's C++ backend: the per-row pieces fuse into a few loops, the matmuls and
the opaque attention op are called straight from generated code. Dynamo is bypassed on purpose:
its frame evaluation and guards cost about 30 us a call, as much as a fused layer.

Compilation happens before the server answers: compiled on a background thread of the server
instead, it held the GIL for seconds at a time and a 4,000-token prompt took 18-42 s instead of
2 (BENCHMARKS.md). The weights are arguments of the traced step, so a compiled step depends only
on shapes and inductor's on-disk cache serves a restart in seconds, while a first compilation
takes about a minute. So ``serve`` compiles at start-up only when a marker (:func:`warm`) says
this model's steps were compiled here before; else it serves eagerly at once and warms the
cache for the next start in a separate, low-priority process (``cpu_warmer.py``), which
shares no GIL with the server. A step of fewer streams
than its bucket pads with rows on the scratch slot, which compute harmlessly and are dropped,
as in the CUDA decode graphs.

Windows: a short prompt chunk of one stream (up to :data:`WINDOW_WIDTHS`' last: a short
prompt, a chat prompt's tail after its snapshot boundary, a short new turn) runs from a
program of the same function at a width of several rows (``decode_step.py``), its last rows
padding past the chunk's end. Eager, a chunk pays the forward's fixed dispatch: a chat
prompt's 4-token tail cost 6.5 ms after 17.8 ms for its first 63 tokens (BENCHMARKS.md).

Verify windows: with a drafter, a speculative chain window of one stream (the pending token
and its drafts) runs from a program that returns every row's logits and the state after
each row (``decode_step.py``'s ``every_row``), and writes no fixed-size state: committing the
accepted rows (:meth:`DecodePrograms.commit`) copies the state after the last of them, where
the eager window records its inputs and replays the kept rows (several milliseconds here).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from headstart.engine.cuda_graph import buckets_for
from headstart.models.contract import CausalLM, ForwardOutput
from headstart.progress import progress
from headstart.state import StatePool

__all__ = [
    "WINDOW_WIDTHS",
    "DecodePrograms",
    "cache_key",
    "offered",
    "verify_widths",
    "warm",
    "warm_in_background",
]

log = logging.getLogger("headstart.engine")

#: Widths of the one-stream window programs: a chunk of 2..64 tokens pads to the next. Each
#: costs start-up time (loaded from inductor's cache: 1.9 s at 4 rows, 4.2 at 16, 7.6 s for 32
#: and 64 together here), so there are few.
WINDOW_WIDTHS = (4, 8, 16, 32, 64)


def verify_widths(block: int) -> tuple[int, ...]:
    """The verify programs for a drafter of ``block``: a full block's window, and one of 4 rows
    for the shorter chains the planner picks where window rows are dear (a CPU's: every row
    costs about half a decode step, BENCHMARKS.md); each costs start-up time."""
    return tuple(sorted({w for w in (min(4, block), block) if w >= 2}))


def offered(model: CausalLM) -> bool:
    """Whether ``model`` offers a traceable decode step on the CPU (fp32 models: bf16 ones are
    bound by their int4 matmuls, not by dispatch)."""
    return (
        model.device.type == "cpu"
        and getattr(model, "dtype", None) == torch.float32
        and callable(getattr(model, "decode_program", None))
    )


class DecodePrograms:
    """Compiled decode steps of ``model`` over ``pool``, one per stream bucket, then one-stream
    windows (:data:`WINDOW_WIDTHS`), all compiled when it is made (see the module docstring);
    a program that fails to compile and those after it stay eager. With ``taps`` (a drafter's
    target layers) every program also returns its rows' tapped features, so that a drafting
    stream's steps run compiled too; ``verify``: the widths of one-stream verify windows."""

    def __init__(
        self,
        model: CausalLM,
        pool: StatePool,
        max_streams: int,
        scratch_slot: int,
        widths: Sequence[int] = WINDOW_WIDTHS,
        taps: Sequence[int] = (),
        verify: Sequence[int] = (),
    ) -> None:
        from headstart.ops import native

        native.load()  # the traced step's operators without Python, when they build here
        self.model, self.pool, self.scratch = model, pool, scratch_slot
        self.taps = tuple(taps)
        self.fixed = [g.name for g in pool.groups if not g.per_token]
        self.step, self.weights = model.decode_program(taps=self.taps)
        self.ready: dict[int, Callable[..., tuple[torch.Tensor, ...]]] = {}
        self.windows: dict[int, Callable[..., tuple[torch.Tensor, ...]]] = {}
        self.verifiers: dict[int, Callable[..., tuple[torch.Tensor, ...]]] = {}
        # Of the verify window run last, per slot: the fixed-size state after each of its rows
        # (by group, [layers, width, ...]), until commit() keeps one of them.
        self._rows: dict[int, list[torch.Tensor]] = {}
        shapes = [(b, 1, False) for b in buckets_for(max_streams)]
        shapes += [(1, w, False) for w in widths if w < pool.max_tokens]
        shapes += [(1, w, True) for w in sorted(set(verify)) if 2 <= w < pool.max_tokens]
        self.complete = False  # every program compiled
        with progress("compiling CPU decode steps", len(shapes)) as tick:
            for n, width, every_row in shapes:
                started = time.monotonic()
                try:
                    program = self._compile(n, width, every_row)
                except Exception:  # eager steps instead: slower, never wrong
                    log.exception("compiling the CPU step of %d x %d rows failed", n, width)
                    return
                if every_row:
                    self.verifiers[width] = program
                elif width == 1:
                    self.ready[n] = program
                else:
                    self.windows[width] = program
                took = time.monotonic() - started
                log.info("CPU step of %d stream(s) x %d rows compiled in %.1fs", n, width, took)
                tick()
        self.complete = True

    def _inputs(self, n: int, width: int = 1) -> list[torch.Tensor]:
        rows = n * width
        ids = torch.zeros(rows, dtype=torch.int64)
        positions = torch.arange(1, rows + 1, dtype=torch.int64)
        slots = torch.full((rows,), self.scratch, dtype=torch.int64)
        fresh = torch.zeros(n, dtype=torch.bool)
        lengths = torch.full((n,), width, dtype=torch.int64)
        return [ids, positions, slots, fresh, lengths, *self._groups(), *self.weights]

    def _groups(self) -> list[torch.Tensor]:
        return [self.pool[g.name] for g in self.pool.groups]

    def _compile(
        self, n: int, width: int, every_row: bool = False
    ) -> Callable[..., tuple[torch.Tensor, ...]]:
        from torch._guards import TracingContext, tracing
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        # One compiler thread: a pool of compiler processes made a first compilation slower
        # here (2 cores), not faster.
        inductor_config.compile_threads = 1
        inputs = self._inputs(n, width)
        if width == 1:
            step = self.step
        else:
            step = self.model.decode_program(width, self.taps, every_row)[0]
        # Fake tensors: tracing computes nothing and writes nothing into the pool.
        traced = make_fx(step, tracing_mode="fake")(*inputs)
        # A tracing context with a shape environment, as Dynamo would give: inductor's graph
        # cache serves only such compilations (a restart then loads instead of compiling).
        with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv()))):
            return compile_fx(traced, inputs)

    def bucket(self, n: int) -> int | None:
        """The smallest compiled bucket of at least ``n`` streams (None: none yet)."""
        return min((b for b in self.ready if b >= n), default=None)

    def run(
        self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int]
    ) -> ForwardOutput | None:
        """The decode step of ``tokens[i]`` at ``positions[i]`` of ``slots[i]`` from a compiled
        program, its fixed-size state written back; None when no bucket is ready for it."""
        n = len(tokens)
        b = self.bucket(n)
        if b is None:
            return None
        pad = b - n
        ids = torch.tensor([*tokens, *(0,) * pad], dtype=torch.int64)
        pos = torch.tensor([*positions, *(1,) * pad], dtype=torch.int64)
        sl = torch.tensor([*slots, *(self.scratch,) * pad], dtype=torch.int64)
        ones = torch.ones(b, dtype=torch.int64)
        out = self.ready[b](ids, pos, sl, pos == 0, ones, *self._groups(), *self.weights)
        self._write_back(sl, out[1 : 1 + len(self.fixed)])
        return ForwardOutput(out[0][:n], out[-1][:n] if self.taps else None, {})

    def width(self, tokens: int) -> int | None:
        """The narrowest compiled window of at least ``tokens`` rows (None: none yet)."""
        return min((w for w in self.windows if w >= tokens), default=None)

    def run_window(self, tokens: Sequence[int], start: int, slot: int) -> ForwardOutput | None:
        """``tokens`` at ``start..`` of ``slot`` (one stream's chunk) from a compiled window,
        the last token's logits returned and the fixed-size state written back; None when no
        window is ready for it or its padding would run past the slot's rows."""
        w = self.width(len(tokens))
        if w is None or start + w > self.pool.max_tokens:
            return None
        out = self.windows[w](*self._window_inputs(tokens, start, slot, w))
        self._write_back(torch.tensor([slot]), out[1 : 1 + len(self.fixed)])
        return ForwardOutput(out[0], out[-1][: len(tokens)] if self.taps else None, {})

    def _window_inputs(
        self, tokens: Sequence[int], start: int, slot: int, width: int
    ) -> list[torch.Tensor]:
        """A one-stream window program's arguments: ``tokens`` at ``start..`` of ``slot``,
        padded to ``width`` rows, then the pool's groups and the weights."""
        ids = torch.tensor([*tokens, *(0,) * (width - len(tokens))], dtype=torch.int64)
        pos = torch.arange(start, start + width, dtype=torch.int64)
        sl = torch.full((width,), slot, dtype=torch.int64)
        fresh = torch.tensor([start == 0])
        lengths = torch.tensor([len(tokens)], dtype=torch.int64)
        return [ids, pos, sl, fresh, lengths, *self._groups(), *self.weights]

    def verify_width(self, tokens: int) -> int | None:
        """The narrowest compiled verify window of at least ``tokens`` rows (None: none)."""
        return min((w for w in self.verifiers if w >= tokens), default=None)

    def run_verify(self, tokens: Sequence[int], start: int, slot: int) -> ForwardOutput | None:
        """A chain verify window, ``tokens`` at ``start..`` of ``slot``, from a compiled
        verify program: every row's logits (and taps), keys and values written, the slot's
        fixed-size state left as it was until :meth:`commit`. None when no program is ready
        for it or its padding would run past the slot's rows."""
        w = self.verify_width(len(tokens))
        if w is None or start + w > self.pool.max_tokens:
            return None
        n = len(tokens)
        out = self.verifiers[w](*self._window_inputs(tokens, start, slot, w))
        self._rows[slot] = [rows[:, 0] for rows in out[1 : 1 + len(self.fixed)]]
        return ForwardOutput(out[0][:n], out[-1][:n] if self.taps else None, {})

    def forget(self) -> None:
        """Drop what uncommitted verify windows left (a new step begins: none awaits)."""
        self._rows.clear()

    def verified(self, slot: int) -> bool:
        """Whether ``slot``'s last window ran from a verify program and awaits its commit."""
        return slot in self._rows

    def commit(self, slot: int, keep: int) -> None:
        """Give ``slot`` the state after the first ``keep`` rows of its verify window (the
        anchor and the accepted drafts)."""
        rows = self._rows.pop(slot)
        for name, after in zip(self.fixed, rows, strict=True):
            self.pool[name][:, slot] = after[:, keep - 1]

    def _write_back(self, slots: torch.Tensor, rows: Sequence[torch.Tensor]) -> None:
        for name, new in zip(self.fixed, rows, strict=True):
            self.pool[name][:, slots] = new


# The code a compiled step is made from: a change here makes a marker stale (a slower start-up,
# never a wrong step: inductor's cache is keyed by the graph itself).
_SOURCES = (
    "engine/cpu_programs.py",
    "models/qwen35/decode_step.py",
    "ops/attention/cpu.py",
    "ops/attention/decode_f32.c",
    "ops/cpu_ops.cpp",
    "ops/native.py",
    "ops/quant_matmul/cpu_f32.py",
    "ops/quant_matmul/int4_f32.c",
    "ops/pointwise/reference.py",
    "ops/gated_delta/reference.py",
    "ops/conv/reference.py",
)


def marker(key: str) -> Path:
    """The file that says the steps of ``key`` were compiled here."""
    from headstart.ops.c_build import cache_root

    return cache_root() / "programs" / f"{key}.done"


def cache_key(load_args: dict[str, str], slots: int, context: int) -> str:
    """What a model's compiled steps depend on: how it was loaded (``load_args``: the model's
    folder and loading options, ``taps``, the drafter's target layers, and ``verify``, its
    verify windows' widths, as
    :func:`warm_in_background` passes them on), its config, the pool's shape, torch and the
    sources above."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(json.dumps([load_args, slots, context, torch.__version__]).encode())
    h.update((Path(load_args["model"]) / "config.json").read_bytes())
    for name in _SOURCES:
        h.update((root / name).read_bytes())
    return h.hexdigest()[:24]


def warm(key: str) -> bool:
    """Whether the steps of ``key`` were compiled on this machine before (inductor's cache
    then holds them, unless it was cleared since)."""
    return marker(key).exists()


def warm_in_background(
    load_args: dict[str, str], slots: int, context: int, key: str
) -> subprocess.Popen:
    """Compile the model's steps in a separate low-priority process that fills inductor's cache
    and leaves the marker of ``key`` (:func:`cache_key` of the same arguments); the caller
    ends it when it stops first."""
    cmd = [sys.executable, "-m", "headstart.engine.cpu_warmer", "--slots", str(slots)]
    cmd += ["--context", str(context), f"--marker={marker(key)}"]
    cmd += [f"--{k}={v}" for k, v in load_args.items()]
    nice = getattr(os, "nice", None)
    return subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=(lambda: nice(10)) if nice else None,
    )
