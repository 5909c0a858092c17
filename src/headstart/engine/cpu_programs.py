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

__all__ = ["DecodePrograms", "cache_key", "offered", "warm", "warm_in_background"]

log = logging.getLogger("headstart.engine")


def offered(model: CausalLM) -> bool:
    """Whether ``model`` offers a traceable decode step on the CPU (fp32 models: bf16 ones are
    bound by their int4 matmuls, not by dispatch)."""
    return (
        model.device.type == "cpu"
        and getattr(model, "dtype", None) == torch.float32
        and callable(getattr(model, "decode_program", None))
    )


class DecodePrograms:
    """Compiled decode steps of ``model`` over ``pool``, one per stream bucket, all compiled
    when it is made (see the module docstring); a bucket that fails to compile and those after
    it stay eager."""

    def __init__(
        self, model: CausalLM, pool: StatePool, max_streams: int, scratch_slot: int
    ) -> None:
        from headstart.ops import native

        native.load()  # the traced step's operators without Python, when they build here
        self.model, self.pool, self.scratch = model, pool, scratch_slot
        self.fixed = [g.name for g in pool.groups if not g.per_token]
        self.step, self.weights = model.decode_program()
        self.ready: dict[int, Callable[..., tuple[torch.Tensor, ...]]] = {}
        buckets = buckets_for(max_streams)
        with progress("compiling CPU decode steps", len(buckets)) as tick:
            for b in buckets:
                started = time.monotonic()
                try:
                    self.ready[b] = self._compile(b)
                except Exception:  # eager steps instead: slower, never wrong
                    log.exception("compiling the CPU decode step for %d streams failed", b)
                    return
                took = time.monotonic() - started
                log.info("CPU decode step for %d streams compiled in %.1fs", b, took)
                tick()

    def _inputs(self, n: int) -> list[torch.Tensor]:
        ids = torch.zeros(n, dtype=torch.int64)
        positions = torch.ones(n, dtype=torch.int64)
        slots = torch.full((n,), self.scratch, dtype=torch.int64)
        fresh = torch.zeros(n, dtype=torch.bool)
        return [ids, positions, slots, fresh, *self._groups(), *self.weights]

    def _groups(self) -> list[torch.Tensor]:
        return [self.pool[g.name] for g in self.pool.groups]

    def _compile(self, n: int) -> Callable[..., tuple[torch.Tensor, ...]]:
        from torch._guards import TracingContext, tracing
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        # One compiler thread: a pool of compiler processes made a first compilation slower
        # here (2 cores), not faster.
        inductor_config.compile_threads = 1
        inputs = self._inputs(n)
        # Fake tensors: tracing computes nothing and writes nothing into the pool.
        traced = make_fx(self.step, tracing_mode="fake")(*inputs)
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
        out = self.ready[b](ids, pos, sl, pos == 0, *self._groups(), *self.weights)
        logits, rows = out[0], out[1:]
        for name, new in zip(self.fixed, rows, strict=True):
            self.pool[name][:, sl] = new
        return ForwardOutput(logits[:n], None, {})


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
    folder and loading options, as :func:`warm_in_background` passes them on), its config,
    the pool's shape, torch and the sources above."""
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
