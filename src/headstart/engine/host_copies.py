"""Device-to-host snapshot copies made off the engine thread: the host tier's demotions.

Job: a snapshot evicted from the device tier is copied to host memory to be kept there. Made on
the engine thread, that copy (hundreds of MB at the 27B shape, into pinned memory allocated for
it) held up the step that evicted it: BENCHMARKS.md records 1.3-2.4 GB/s demotions and steps of
seconds on an H200. :class:`HostCopies` hands each copy to one worker thread, which waits for
the work queued on the engine's stream before the hand-over (the snapshot's contents), then
copies on a stream of its own, into the host block it was given (a block of the host tier's
:class:`~headstart.engine.host_arena.HostArena`: pinning memory per copy stalled the engine's
CUDA calls as much as copying on its thread did).

Contract: :meth:`HostCopies.submit` (engine thread) never blocks on a copy; the snapshot it is
given must stay as it is (its store row not reused, its tensors not freed) until its copy comes
back from :meth:`HostCopies.finished` (never blocks) or :meth:`HostCopies.wait_all`, in the
order submitted; so must the host buffer ``into``, which nobody else may use meanwhile. A copy
that fails comes back with ``host=None`` (and is logged): the snapshot is then simply not kept.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from headstart.engine.host_arena import HostBlock
from headstart.engine.prompt_cache import CacheEntry, Snapshot

__all__ = ["Copied", "HostCopies"]

log = logging.getLogger("headstart.engine")


@dataclass(frozen=True)
class Copied:
    """A finished copy: the device ``entry`` and its ``host`` copy (None: it failed), with the
    copy's bytes and seconds (the copy, not the wait for queued work), and the ``block`` it was
    submitted with."""

    entry: CacheEntry
    host: Snapshot | None
    nbytes: int
    seconds: float
    block: HostBlock | None = None


class HostCopies:
    """One worker thread copying device snapshots to host memory (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: deque[Copied] = deque()  # guarded by _ready
        self._ready = threading.Condition()
        self._pending = 0  # submitted and not yet returned; engine thread only
        self._thread = threading.Thread(target=self._run, name="headstart-host-copies", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Copies submitted and not yet returned (may be read from any thread)."""
        return self._pending

    def submit(
        self,
        entry: CacheEntry,
        into: torch.Tensor | None = None,
        block: HostBlock | None = None,
    ) -> None:
        """Copy ``entry``'s snapshot to host memory (packed into ``into``, the bytes of
        ``block``, when given), after the work queued so far."""
        event = None
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record()  # on the engine thread's current stream
        self._pending += 1
        self._todo.put((entry, event, into, block))

    def finished(self) -> list[Copied]:
        """The copies done since the last call, oldest first; never blocks."""
        with self._ready:
            done = list(self._done)
            self._done.clear()
        self._pending -= len(done)
        return done

    def wait_all(self) -> list[Copied]:
        """Every pending copy, once all are done, oldest first."""
        with self._ready:
            self._ready.wait_for(lambda: len(self._done) >= self._pending)
        return self.finished()

    def close(self) -> None:
        """Stop the worker once the copies submitted so far are done."""
        self._todo.put((None, None, None, None))

    def _run(self) -> None:
        while True:
            entry, event, into, block = self._todo.get()
            if entry is None:
                return
            done = self._copy(entry, event, into, block)
            with self._ready:
                self._done.append(done)
                self._ready.notify_all()

    def _copy(
        self,
        entry: CacheEntry,
        event: torch.cuda.Event | None,
        into: torch.Tensor | None,
        block: HostBlock | None,
    ) -> Copied:
        try:
            if event is not None:
                event.synchronize()  # the snapshot's contents have landed
            since = time.perf_counter()
            if self._stream is None:
                host = entry.payload.to_host(into=into)
            else:
                with torch.cuda.stream(self._stream):
                    host = entry.payload.to_host(non_blocking=True, into=into)
                self._stream.synchronize()
            return Copied(entry, host, host.nbytes(), time.perf_counter() - since, block)
        except Exception:  # not kept in the host tier: a later miss, nobody's failure
            log.exception("copying a snapshot to host memory failed; not kept")
            return Copied(entry, None, 0, 0.0, block)
