"""Rank 0's side of a tensor-parallel group: the calls it sends the other ranks.

Only rank 0 schedules, samples and drafts. Every other rank runs a worker (``worker.py``) that
executes, in order, the calls rank 0 sends it through a pipe: the model runner's steps, commits
and rollbacks, the prompt cache's snapshot copies, the drafter's uses of the target's embedding
and head. A method marked :func:`lockstep` is such a call: on rank 0 (an object whose ``peers``
is set) a call made outside any other lockstep call is first sent to the workers' object of the
same role, so that every rank runs the same forward on the same rows and meets the others in its
collectives; calls nested in it (the embedding inside a step's forward) are not sent again.
Objects without peers (one process, and the workers' own) just run the method.

Tensors among a call's arguments go by broadcast on the group, the rest is pickled through the
pipe. A worker that exits (or fails a call: it exits then) marks the group lost: rank 0's calls
then raise at once, naming the rank, instead of waiting on it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import torch

from headstart.errors import HeadstartError
from headstart.parallel.group import TPGroup, close_group

__all__ = ["Call", "Peers", "Sent", "lockstep"]

log = logging.getLogger("headstart.parallel")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Sent:
    """A tensor argument of a call: it follows the call by broadcast."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Call:
    """``target.method(*args, **kwargs)`` on every worker; ``target`` names the object by its
    role ("runner", "model", "snapshots" or "worker"). ``reply``: the worker answers
    ``("ok", None)`` or ``("error", text)`` once done."""

    target: str
    method: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    reply: bool = False


def lockstep(target: str) -> Callable[[F], F]:
    """Mark a method that every rank runs (see the module docstring); ``target``: the role of
    the object it belongs to, as the workers name it."""

    def mark(method: F) -> F:
        @functools.wraps(method)
        def run(self, *args: Any, **kwargs: Any) -> Any:
            peers = self.peers
            if peers is None or peers.leading:
                return method(self, *args, **kwargs)
            with peers.leading_call(Call(target, method.__name__, args, kwargs)):
                return method(self, *args, **kwargs)

        return run  # type: ignore[return-value]

    return mark


class Peers:
    """Rank 0's channel to ranks 1 .. world-1 (``processes``, ``pipes``, in rank order), in
    ``group``. Engine thread only (start-up before the thread starts)."""

    def __init__(
        self, group: TPGroup, processes: Sequence[BaseProcess], pipes: Sequence[Connection]
    ) -> None:
        self.group = group
        self._processes, self._pipes = list(processes), list(pipes)
        self.leading = False  # inside a lockstep call: nested ones are not sent
        self.lost: str | None = None  # why the group cannot run calls any more
        self._closing = False
        threading.Thread(target=self._watch, name="headstart-tp-watch", daemon=True).start()

    def call(self, call: Call) -> None:
        """Send ``call`` to every worker (then its tensor arguments, by broadcast)."""
        if self.lost is not None:
            raise RuntimeError(self.lost)
        tensors = [a for a in call.args if isinstance(a, torch.Tensor)]
        args = tuple(
            Sent(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in call.args
        )
        message = Call(call.target, call.method, args, call.kwargs, call.reply)
        for rank, pipe in enumerate(self._pipes, 1):
            try:
                pipe.send(message)
            except OSError as e:
                raise RuntimeError(self._lose(rank, f"its pipe failed ({e})")) from e
        for t in tensors:
            self.group.broadcast(t.contiguous())

    @contextmanager
    def leading_call(self, call: Call) -> Iterator[None]:
        """Send ``call``, then run rank 0's part of it inside the block."""
        self.call(call)
        self.leading = True
        try:
            yield
        except Exception as e:
            # A collective that failed because a rank is gone says so in gloo's or NCCL's
            # words; name the rank instead.
            if self._check() is not None:
                raise RuntimeError(self.lost) from e
            raise
        finally:
            self.leading = False

    def wait(self) -> None:
        """Every worker's answer to the last call sent with ``reply``; raises HeadstartError
        naming each rank that failed it (or exited meanwhile)."""
        errors = []
        for rank, (pipe, proc) in enumerate(zip(self._pipes, self._processes, strict=True), 1):
            while not pipe.poll(0.2):
                if not proc.is_alive():
                    raise HeadstartError(self._lose(rank, f"it exited (code {proc.exitcode})"))
            status, detail = pipe.recv()
            if status != "ok":
                errors.append(f"rank {rank}: {detail}")
        if errors:
            raise HeadstartError("; ".join(errors))

    def close(self) -> None:
        """Stop the workers (asked first, then terminated) and leave the group."""
        if self._closing:
            return
        self._closing = True
        for pipe in self._pipes:
            with contextlib.suppress(OSError):  # gone already
                pipe.send(None)  # stop
        for proc in self._processes:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        close_group()

    def _check(self) -> str | None:
        """Why the group is lost, looking at the workers now (the watcher may not have woken
        yet), or None."""
        for rank, proc in enumerate(self._processes, 1):
            if self.lost is None and not self._closing and not proc.is_alive():
                self._lose(rank, f"it exited (code {proc.exitcode})")
        return self.lost

    def _lose(self, rank: int, why: str) -> str:
        if self.lost is None:
            self.lost = f"tensor-parallel rank {rank} is gone: {why}; restart the server"
            log.error("%s", self.lost)
        return self.lost

    def _watch(self) -> None:
        """Mark the group lost as soon as a worker exits while it should be running."""
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self._processes, 1)}
        ready = wait(list(sentinels))
        if not self._closing:
            rank, proc = sentinels[ready[0]]
            proc.join(timeout=1)
            self._lose(rank, f"it exited (code {proc.exitcode})")
