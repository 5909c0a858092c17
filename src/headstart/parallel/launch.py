"""Starting a tensor-parallel group from rank 0: worker processes, the rendezvous, the shards.

:func:`start` spawns ranks 1 .. N-1 (fresh interpreters, so no CUDA state is inherited) and joins
them as rank 0 on a free loopback port; :func:`load_shards` then has every rank load its shard
at once and returns rank 0's model with the channel to the others (``model.peers``);
:func:`load_parallel` does both. Workers are daemonic and also stop when rank 0's end of their
pipe closes, so none outlives rank 0.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from pathlib import Path
from typing import Any

import torch

from headstart.errors import HeadstartError
from headstart.models.contract import CausalLM, ModelFamily
from headstart.parallel import worker
from headstart.parallel.group import TPGroup, device_for, free_port
from headstart.parallel.peers import Call, Peers

__all__ = ["load_parallel", "load_shards", "start"]

log = logging.getLogger("headstart.parallel")


def _threads(device: str, world: int) -> int:
    """CPU threads per rank on a CPU (the cores shared out; 0: leave torch's default)."""
    if torch.device(device).type == "cuda":
        return 0
    return max(1, (os.cpu_count() or 1) // world)


def _check_devices(device: str, world: int) -> None:
    """Refuse, before any process starts, a GPU group that needs GPUs this machine lacks."""
    d = torch.device(device)
    if d.type == "cuda":
        last, count = (d.index or 0) + world - 1, torch.cuda.device_count()
        if last >= count:
            raise HeadstartError(
                f"--tensor-parallel {world} from {device} needs GPUs up to cuda:{last}; "
                f"this machine has {count}"
            )


def start(world: int, device: str) -> Peers:
    """Spawn ranks 1 .. ``world``-1 and join them as rank 0 (gloo on a CPU, NCCL on GPUs, one
    GPU per rank counted from ``device``'s); rank 0's CPU threads are shared out too."""
    _check_devices(device, world)
    ctx = multiprocessing.get_context("spawn")
    port, threads = free_port(), _threads(device, world)
    processes, pipes = [], []
    for rank in range(1, world):
        here, there = ctx.Pipe()
        proc = ctx.Process(
            target=worker.main,
            args=(rank, world, port, device, there, threads),
            name=f"headstart-tp{rank}",
            daemon=True,
        )
        proc.start()
        there.close()  # the worker's end: only the worker holds it now
        processes.append(proc)
        pipes.append(here)
    if threads:
        torch.set_num_threads(threads)
    try:
        group = TPGroup.join(0, world, port, device_for(device, 0))
    except BaseException:
        for proc in processes:
            proc.terminate()
        raise
    log.info("tensor parallel: %d ranks over %s", world, group.backend)
    return Peers(group, processes, pipes)


def load_parallel(
    family: ModelFamily,
    path: Path,
    world: int,
    dtype: torch.dtype,
    device: str,
    kernels: str,
    extra: dict[str, Any],
) -> CausalLM:
    """Start a group of ``world`` ranks and load the model in ``path`` on it (see
    :func:`load_shards`); the group is closed again when any rank fails to load."""
    peers = start(world, device)
    try:
        return load_shards(peers, family, path, dtype, device, kernels, extra)
    except BaseException:
        peers.close()
        raise


def load_shards(
    peers: Peers,
    family: ModelFamily,
    path: Path,
    dtype: torch.dtype,
    device: str,
    kernels: str,
    extra: dict[str, Any],
) -> CausalLM:
    """Rank 0's shard of the model in ``path`` (``family.load`` with ``tp``), every other rank
    loading its own meanwhile (replacing any model it had); ``model.peers`` is the channel to
    them. Raises HeadstartError naming the ranks that failed."""
    peers.call(Call("worker", "load", (str(path), dtype, kernels, extra), reply=True))
    model = family.load(path, dtype, device_for(device, 0), kernels, tp=peers.group, **extra)
    peers.wait()
    model.peers = peers
    return model
