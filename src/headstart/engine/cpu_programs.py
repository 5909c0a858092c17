"""Compiled decode steps on the CPU; the only module that compiles.

Why: on a CPU an eager decode step of a small model is mostly dispatch, about 900 small aten
ops a step each paying Python and dispatcher overhead (BENCHMARKS.md). A model that offers
``decode_step`` (a decode forward written to be traced: fixed shapes, no host syncs, fixed-size
state returned rather than written in place; Qwen3.5's ``decode_step.py``) gets it traced once
per stream bucket (1, 2, 4, ... up to the slots) with ``make_fx`` and compiled by inductor's C++
backend: the per-row pieces fuse into a few loops, the matmuls and the opaque attention op are
called straight from generated code. Dynamo is bypassed on purpose: its frame evaluation and
guards cost about 30 us a call, as much as a fused layer.

Compilation runs on a background thread at low priority, smallest bucket first; until a bucket
is ready its steps run eagerly, so start-up waits for none of it (inductor's on-disk cache makes
a restart's compilation quick). A step of fewer streams than its bucket pads with rows on the
scratch slot, which compute harmlessly and are dropped, as in the CUDA decode graphs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import torch

from headstart.engine.cuda_graph import buckets_for
from headstart.models.contract import CausalLM, ForwardOutput
from headstart.state import StatePool

__all__ = ["DecodePrograms", "offered"]

log = logging.getLogger("headstart.engine")


def offered(model: CausalLM) -> bool:
    """Whether ``model`` offers a traceable decode step on the CPU (fp32 models: bf16 ones are
    bound by their int4 matmuls, not by dispatch)."""
    return (
        model.device.type == "cpu"
        and getattr(model, "dtype", None) == torch.float32
        and callable(getattr(model, "decode_step", None))
    )


class DecodePrograms:
    """Compiled decode steps of ``model`` over ``pool``, one per stream bucket (see the module
    docstring). ``background=False`` compiles every bucket before returning (tests)."""

    def __init__(
        self,
        model: CausalLM,
        pool: StatePool,
        max_streams: int,
        scratch_slot: int,
        background: bool = True,
    ) -> None:
        self.model, self.pool, self.scratch = model, pool, scratch_slot
        self.fixed = [g.name for g in pool.groups if not g.per_token]
        self.buckets = buckets_for(max_streams)
        self.ready: dict[int, Callable[..., tuple[torch.Tensor, ...]]] = {}
        self.failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._compile_all, name="headstart-cpu-compile", daemon=True
            )
            self._thread.start()
        else:
            self._compile_all()

    def close(self) -> None:
        """Stop compiling after the bucket in progress."""
        self._stop.set()

    def wait(self, timeout: float | None = None) -> None:
        """Until every bucket is compiled (or compilation stopped)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _compile_all(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # below the engine: serving first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        for b in self.buckets:
            if self._stop.is_set():
                return
            started = time.monotonic()
            try:
                self.ready[b] = self._compile(b)
            except Exception:  # eager steps go on: slower, never wrong
                log.exception("compiling the CPU decode step for %d streams failed", b)
                self.failed = True
                return
            took = time.monotonic() - started
            log.info("CPU decode step for %d streams compiled in %.1fs", b, took)

    def _inputs(self, n: int) -> list[torch.Tensor]:
        ids = torch.zeros(n, dtype=torch.int64)
        positions = torch.ones(n, dtype=torch.int64)
        slots = torch.full((n,), self.scratch, dtype=torch.int64)
        fresh = torch.zeros(n, dtype=torch.bool)
        return [ids, positions, slots, fresh, *(self.pool[g.name] for g in self.pool.groups)]

    def _compile(self, n: int) -> Callable[..., tuple[torch.Tensor, ...]]:
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx
        from torch.fx.experimental.proxy_tensor import make_fx

        # One thread: no pool of compiler processes beside a server on a small machine (set
        # before anything of inductor's runs, which would start that pool).
        inductor_config.compile_threads = 1
        inputs = self._inputs(n)
        # Fake tensors: tracing computes nothing and writes nothing into the pool.
        traced = make_fx(self.model.decode_step, tracing_mode="fake", _allow_non_fake_inputs=True)(
            *inputs
        )
        return compile_fx(traced, inputs)

    def bucket(self, n: int) -> int | None:
        """The smallest compiled bucket of at least ``n`` streams (None: none yet)."""
        # tuple(): one step of the GIL, while the compiling thread may add a bucket.
        return min((b for b in tuple(self.ready) if b >= n), default=None)

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
        out = self.ready[b](ids, pos, sl, pos == 0, *(self.pool[g.name] for g in self.pool.groups))
        logits, rows = out[0], out[1:]
        for name, new in zip(self.fixed, rows, strict=True):
            self.pool[name][:, sl] = new
        return ForwardOutput(logits[:n], None, {})
