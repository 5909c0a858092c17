"""Prompt-cache snapshots across a tensor-parallel group: each rank keeps its own part.

Every rank's state pool holds only its own heads' state, so a snapshot of a slot is a part per
rank. Rank 0's prompt cache decides everything (what to snapshot, restore, move to host memory,
evict) and holds its own part; every snapshot it makes has a *twin* on each other rank, made,
restored and copied to host memory by the same calls (:class:`SnapshotTwins`, rank 0's side;
:class:`TwinStore`, a worker's), keyed by the snapshot object's ``id``. A twin lives as long as
rank 0's snapshot: when that snapshot is garbage its twins are dropped with the next call. A key
is reused only after its snapshot is gone, and a twin taken under a reused key replaces the old
one, so a late drop costs memory for a while, never a wrong restore.
"""

from __future__ import annotations

import weakref

from headstart.engine.prompt_cache import Snapshot
from headstart.parallel.peers import Call, Peers
from headstart.state import StatePool

__all__ = ["SnapshotTwins", "TwinStore"]


class SnapshotTwins:
    """Rank 0's side: the prompt cache reports what it did with each snapshot of rank 0's
    pool, and the same is done to the twins."""

    def __init__(self, peers: Peers) -> None:
        self.peers = peers
        self._gone: list[int] = []  # keys of snapshots collected since the last call

    def taken(self, snap: Snapshot, slot: int) -> None:
        """``snap`` was just taken from ``slot``."""
        self._send("take", id(snap), slot, snap.length)
        weakref.finalize(snap, self._gone.append, id(snap))

    def restored(self, snap: Snapshot, slot: int) -> None:
        """``snap`` was just restored into ``slot``."""
        self._send("restore", id(snap), slot)

    def copied(self, snap: Snapshot, copy: Snapshot) -> None:
        """``copy`` was just made of ``snap`` (in host memory)."""
        self._send("copy", id(snap), id(copy))
        weakref.finalize(copy, self._gone.append, id(copy))

    def _send(self, method: str, *args: int) -> None:
        gone, self._gone = self._gone, []
        if gone:
            self.peers.call(Call("snapshots", "drop", (gone,)))
        self.peers.call(Call("snapshots", method, args))


class TwinStore:
    """A worker's twins of rank 0's snapshots (its own heads' part), by key."""

    def __init__(self, pool: StatePool) -> None:
        self.pool = pool
        self.twins: dict[int, Snapshot] = {}

    def take(self, key: int, slot: int, length: int) -> None:
        state = {name: view.clone() for name, view in self.pool.slot_state(slot, length).items()}
        self.twins[key] = Snapshot(length, state, None)

    def restore(self, key: int, slot: int) -> None:
        self.twins[key].restore(self.pool, slot)

    def copy(self, key: int, to: int) -> None:
        self.twins[to] = self.twins[key].to_host()

    def drop(self, keys: list[int]) -> None:
        for key in keys:
            self.twins.pop(key, None)
