"""How long each engine step took on the host, by phase, in the log.

Every step at DEBUG level (``serve --log-level debug``), slow ones as a warning: the shape of
the step (chunks, decode rows, tokens) beside the host clock at each phase's end (forward
enqueued, tokens sampled and sent: on a GPU the sampling waits for the forward; snapshots
taken, after the tokens are sent), so a stall shows where it happened.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from headstart.engine.scheduler import Work

__all__ = ["SLOW_STEP_S", "StepClock"]

log = logging.getLogger("headstart.engine")

# A step this slow is logged as a warning: at the default step budget a step computes ~0.2 s, so
# a second means something else (a compilation, a stall) held every stream back.
SLOW_STEP_S = 1.0


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
            "%d decode rows, %d tokens",
            n,
            1e3 * (end - t0),
            1e3 * (run - t0),
            1e3 * (sampled - run),
            1e3 * (end - sampled),
            len(work),
            decode,
            sum(len(w.tokens) for w in work),
        )
