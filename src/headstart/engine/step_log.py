"""How long each engine step took on the host, by phase, in the log.

Every step at DEBUG level (``serve --log-level debug``), slow ones as a warning: the shape of
the step (chunks, decode rows, tokens) beside the host clock at each phase's end (forward
enqueued, tokens sampled and sent: on a GPU the sampling waits for the forward; snapshots
taken, after the tokens are sent), so a stall shows where it happened; on CUDA, what the caching
allocator asked of the driver during the step, when it asked anything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from headstart.engine.scheduler import Work

__all__ = ["SLOW_STEP_S", "StepClock"]

log = logging.getLogger("headstart.engine")

# A step this slow is logged as a warning: at the default step budget a step computes ~0.2 s, so
# a second means something else (a compilation, a stall) held every stream back.
SLOW_STEP_S = 1.0


_ALLOCATOR_KEYS = ("segment.all.allocated", "segment.all.freed", "num_alloc_retries")
_allocator_seen: dict[str, int] = {}


def _allocator_events() -> str:
    """What the CUDA caching allocator did since the last call, when it did anything: segments
    it got from and gave back to the driver (each a cudaMalloc or cudaFree, which can wait for
    the device while the calling thread holds the GIL), and retries after a failed cudaMalloc
    (each frees every cached block first). Empty off CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return ""
    stats = torch.cuda.memory_stats()
    now = {k: int(stats.get(k, 0)) for k in _ALLOCATOR_KEYS}
    delta = {k: v - _allocator_seen.get(k, v) for k, v in now.items()}
    _allocator_seen.update(now)
    if not any(delta.values()):
        return ""
    got, gave, retries = (delta[k] for k in _ALLOCATOR_KEYS)
    return f"; allocator: {got} segments allocated, {gave} freed, {retries} retries"


class StepClock:
    """The host clock at a step's start and at each :meth:`mark` (forward, sampling)."""

    def __init__(self) -> None:
        self.marks = [time.perf_counter()]

    def mark(self) -> None:
        self.marks.append(time.perf_counter())

    def log(self, n: int, work: Sequence[Work]) -> None:
        """Log step ``n`` (see the module docstring); the step ends now."""
        self.mark()
        t0, end = self.marks[0], self.marks[-1]
        run, sampled = (self.marks[1:3] + [end, end])[:2]  # phases not marked end with the step
        slow = end - t0 >= SLOW_STEP_S
        if not (slow or log.isEnabledFor(logging.DEBUG)):
            return
        decode = sum(len(w.tokens) == 1 and w.start >= len(w.seq.prompt) for w in work)
        (log.warning if slow else log.debug)(
            "step %d: %.1f ms (forward %.1f, sampling %.1f, snapshots %.1f): %d chunks, "
            "%d decode rows, %d tokens%s",
            n,
            1e3 * (end - t0),
            1e3 * (run - t0),
            1e3 * (sampled - run),
            1e3 * (end - sampled),
            len(work),
            decode,
            sum(len(w.tokens) for w in work),
            _allocator_events(),
        )
