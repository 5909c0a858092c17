"""Python's cycle collector held off around work that must not be paused by it."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Collect once now, then keep the cycle collector off until the block ends (as it was
    before, after). Objects freed by reference counting still go at once; cycles made inside
    wait for the next collection."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
