"""A rank > 0 of a tensor-parallel group: it runs rank 0's calls, in order, until told to stop.

The worker loads its shard of the model (``load``), builds a model runner and a store of snapshot
twins beside it (``start_runner``), then runs each :class:`~headstart.parallel.peers.Call` rank 0
sends on the object of that role: the runner's steps, commits and rollbacks, the model's
embedding and head (for rank 0's drafter), the snapshot copies. It has no scheduler, no sampler
and no server: what its forwards return is dropped (rank 0 has the same logits).

It stops when rank 0 says so, when rank 0 is gone (its pipe closes), or when a call fails: every
rank runs the same code on the same rows, so a failure here that rank 0 did not share leaves the
ranks out of step, and going on could pair collectives of different calls.
"""

from __future__ import annotations

import logging
import signal
from multiprocessing.connection import Connection
from typing import Any

import torch

from headstart.parallel.group import TPGroup, close_group, device_for
from headstart.parallel.peers import Call, Sent

__all__ = ["Worker", "main"]

log = logging.getLogger("headstart.parallel")


def main(rank: int, world: int, port: int, device: str, pipe: Connection, threads: int) -> None:
    """A worker process's entry point (see the module docstring)."""
    # Ctrl-C at a terminal reaches every process of the group: it is rank 0's to handle (it
    # drains its streams, then stops the workers).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(name)s: %(message)s")
    if threads:
        torch.set_num_threads(threads)
    here = device_for(device, rank)
    group = TPGroup.join(rank, world, port, here)
    try:
        Worker(group, here, pipe).serve()
    finally:
        close_group()


class Worker:
    def __init__(self, group: TPGroup, device: str, pipe: Connection) -> None:
        self.group, self.device, self.pipe = group, device, pipe
        self.model: Any = None
        self.runner: Any = None
        self.snapshots: Any = None

    def serve(self) -> None:
        """Run calls until a stop (None), the pipe's end, or a failed call without reply."""
        while True:
            try:
                call = self.pipe.recv()
            except EOFError:  # rank 0 is gone
                return
            if call is None or not self._run(call):
                return

    def _run(self, call: Call) -> bool:
        """Run one call; False when the worker must stop."""
        args = [
            self.group.broadcast(torch.empty(a.shape, dtype=a.dtype, device=self.device))
            if isinstance(a, Sent)
            else a
            for a in call.args
        ]
        target = self if call.target == "worker" else getattr(self, call.target)
        try:
            with torch.no_grad():
                getattr(target, call.method)(*args, **call.kwargs)
        except Exception as e:
            log.exception("rank %d: %s.%s failed", self.group.rank, call.target, call.method)
            if call.reply:  # rank 0 waits for the answer and reports it
                self.pipe.send(("error", f"{type(e).__name__}: {e}"))
            return call.reply
        if call.reply:
            self.pipe.send(("ok", None))
        return True

    # -- calls of rank 0 ------------------------------------------------------------------------
    def load(self, model_dir: str, dtype: torch.dtype, kernels: str, extra: dict) -> None:
        """Load this rank's shard, as rank 0 loads its own (``loading.load``'s arguments)."""
        from pathlib import Path

        from headstart.models import family_for

        path = Path(model_dir)
        self.model = family_for(path).load(
            path, dtype, self.device, kernels, tp=self.group, **extra
        )

    def start_runner(self, config: Any) -> None:
        """A model runner for ``config`` (an EngineConfig), as rank 0's engine makes, and the
        store of this rank's snapshot twins."""
        from headstart.engine.runner import ModelRunner
        from headstart.parallel.snapshots import TwinStore

        self.runner = ModelRunner(self.model, config)
        self.snapshots = TwinStore(self.runner.pool)
