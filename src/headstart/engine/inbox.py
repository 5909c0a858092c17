"""The engine's inbox: how other threads hand work to the engine thread.

Contract, by thread:

- any thread: :meth:`Inbox.submit`, :meth:`Inbox.abort`, :meth:`Inbox.end_all`,
  :meth:`Inbox.arriving` and :meth:`Inbox.close` never block on the engine (only on a short
  lock) and never touch engine state; :attr:`Inbox.active` and :attr:`Inbox.closed` may be
  read anywhere (snapshots, possibly stale by the time they are used);
- the engine thread only: :meth:`Inbox.drain` (take every command, in the order they were put),
  :meth:`Inbox.ended` (once per accepted request, when it ends), :meth:`Inbox.wait` and
  :meth:`Inbox.wait_quiet`.

The admission bound lives here, not in the scheduler, so that ``submit`` can refuse at once on
the caller's thread: a request counts as active from an accepted ``submit`` until the engine
thread calls ``ended`` for it, and at most ``num_slots + max_queue`` are active at a time. Hence
the scheduler's queue always has room for an ``Add`` the engine drains.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from headstart.engine.request import EngineRequest
from headstart.engine.scheduler import QueueFull

__all__ = ["Abort", "Add", "Command", "EndAll", "Inbox"]


@dataclass(frozen=True)
class Add:
    """Start a request (already validated and counted active by :meth:`Inbox.submit`)."""

    req: EngineRequest


@dataclass(frozen=True)
class Abort:
    """End a request wherever it is, delivering nothing more to it."""

    request_id: str


@dataclass(frozen=True)
class EndAll:
    """Finish every request with a final event of this reason."""

    reason: str


Command = Add | Abort | EndAll


class Inbox:
    """Commands from other threads to the engine thread, and the count of active requests."""

    def __init__(self, num_slots: int, max_queue: int, context: int) -> None:
        self.num_slots, self.max_queue, self.context = num_slots, max_queue, context
        self._lock = threading.Lock()
        self._commands: list[Command] = []  # guarded by _lock
        self._active = 0  # submitted and not yet ended; guarded by _lock
        self._wake = threading.Event()
        self._closed = False
        self._last_put = float("-inf")  # time.monotonic() of the newest command
        self._arriving = 0  # requests read or being parsed, not yet submitted; guarded by _lock

    # -- any thread --------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> None:
        """Queue a request; raises QueueFull when slots and queue are all taken, ValueError when
        it cannot fit the context. Once this returns, the request is active."""
        self._check(req)
        with self._lock:
            if self._active >= self.num_slots + self.max_queue:
                raise QueueFull(
                    f"all {self.num_slots} slots are busy and {self.max_queue} requests are waiting"
                )
            self._active += 1
            self._commands.append(Add(req))
            self._last_put = time.monotonic()
        self._wake.set()

    @contextmanager
    def arriving(self) -> Iterator[None]:
        """Around a request's way in (its body read and parsed, up to its ``submit``): an idle
        engine gathering a burst (:meth:`wait_quiet`) waits for it too, so requests sent
        together start in one step even when parsing them takes longer than the quiet gap.
        Leaving restarts the gap, covering the moment between leaving and ``submit``."""
        with self._lock:
            self._arriving += 1
        try:
            yield
        finally:
            with self._lock:
                self._arriving -= 1
                self._last_put = time.monotonic()

    def abort(self, request_id: str) -> None:
        self._put(Abort(request_id))

    def end_all(self, reason: str) -> None:
        self._put(EndAll(reason))

    def close(self) -> None:
        """Tell the engine thread to stop, waking it out of :meth:`wait`. Commands put later are
        still accepted (and counted), but nothing drains them."""
        self._closed = True
        self._wake.set()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def active(self) -> int:
        """Requests accepted by :meth:`submit` and not yet :meth:`ended`."""
        return self._active

    def _check(self, req: EngineRequest) -> None:
        # Checked on the caller's thread so that a bad request is refused before it is counted.
        if not req.prompt_ids or req.max_new_tokens < 1:
            raise ValueError("a request needs a prompt and at least one token to generate")
        if len(req.prompt_ids) + req.max_new_tokens > self.context:
            raise ValueError(
                f"{len(req.prompt_ids)} prompt tokens + {req.max_new_tokens} new "
                f"tokens exceed the context of {self.context}"
            )

    def _put(self, command: Command) -> None:
        with self._lock:
            self._commands.append(command)
            self._last_put = time.monotonic()
        self._wake.set()

    # -- the engine thread -------------------------------------------------------------------
    def drain(self) -> list[Command]:
        """Every command put since the last drain, oldest first."""
        with self._lock:
            commands, self._commands = self._commands, []
        return commands

    @property
    def pending(self) -> bool:
        """Whether commands wait to be drained (a glance: one may arrive right after)."""
        return bool(self._commands)

    def ended(self) -> None:
        """One accepted request has ended (or could not start): it no longer counts as active."""
        with self._lock:
            self._active -= 1

    def wait(self, timeout: float) -> None:
        """Sleep until something is put (or :meth:`close`) or ``timeout`` seconds pass."""
        self._wake.wait(timeout=timeout)
        self._wake.clear()

    def wait_quiet(self, gap: float, longest: float) -> None:
        """Sleep until nothing has been put for ``gap`` seconds and no request is
        :meth:`arriving`, or ``longest`` seconds pass, or :meth:`close`. Returns at once when
        the newest command is older than ``gap`` and nothing is arriving."""
        deadline = time.monotonic() + longest
        while not self._closed:
            now = time.monotonic()
            quiet_at = self._last_put + gap
            if now >= deadline or (now >= quiet_at and not self._arriving):
                return
            # Sleeping releases the GIL, so the HTTP thread can hand over what it is parsing.
            wake = quiet_at if now < quiet_at else now + max(gap / 4, 1e-4)
            time.sleep(max(0.0, min(wake, deadline) - now))
