"""The tensor-parallel group: which rank this process is, and the collectives the model needs.

Every rank of a group holds a slice of every layer (its heads, its part of the MLP, its vocabulary
rows) and runs the same forward on the same rows; the partial results meet in three collectives:
:meth:`TPGroup.all_reduce` after each row-parallel projection and the vocabulary-parallel
embedding, :meth:`TPGroup.all_gather_last` of the logits, and :meth:`TPGroup.broadcast` of the
tensors rank 0 sends with a call (see ``peers.py``). NCCL on GPUs, gloo on CPUs; the group waits
at most :data:`TIMEOUT` for a rank, so a rank that died makes the others fail, not hang.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["TIMEOUT", "TPGroup", "backend_for", "close_group", "device_for", "free_port"]

# How long a collective waits for the other ranks. Ranks run the same work in lockstep, so a wait
# is at most their imbalance; one this long means a rank is gone (gloo notices a closed peer at
# once, NCCL only through this timeout).
TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group: ``rank`` of ``world``, over
    ``backend`` ("gloo" or "nccl"). The collectives act on the default process group."""

    rank: int
    world: int
    backend: str

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``t``, in place (``t`` is returned)."""
        dist.all_reduce(t)
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` side by side along the last dimension, rank 0 first."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=-1)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` into ``t`` on every rank (in place; ``t`` is returned)."""
        dist.broadcast(t, src=0)
        return t

    @classmethod
    def join(cls, rank: int, world: int, port: int, device: str) -> TPGroup:
        """Join, as ``rank`` working on ``device``, the group that meets on loopback ``port``
        (blocks until every rank has)."""
        backend = backend_for(device)
        if backend == "nccl":  # NCCL's collectives run on the current device
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=TIMEOUT,
        )
        return cls(rank, world, backend)


def close_group() -> None:
    """Leave the group (no-op when this process is in none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def device_for(device: str, rank: int) -> str:
    """The device of ``rank`` when the group serves on ``device``: one GPU per rank, counted
    from the one given (``cuda`` is ``cuda:0``); the CPU for every rank."""
    d = torch.device(device)
    if d.type != "cuda":
        return str(d)
    return f"cuda:{(d.index or 0) + rank}"


def free_port() -> int:
    """A loopback TCP port free now (for the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
