"""Prompt-state cache: complete stream states at token boundaries, kept and restored.

A Gated DeltaNet state cannot be rewound, so a prefix can only be reused from a snapshot taken
exactly where that prefix ends. A :class:`Snapshot` holds everything a stream's slot holds at such
a boundary: conv tails and recurrent states of every GDN layer, the KV rows of every attention
layer up to the boundary, and, when the boundary is the end of a prompt, the raw logits of the
first token (so an exact repeat needs no forward at all). Snapshots are immutable: they are filled
by copying out of a slot and restored by copying into one, and no running stream ever aliases
their tensors.

:class:`PromptCacheIndex` is the bookkeeping (torch-free): entries keyed by their token prefix,
longest-prefix lookup by collision-resistant prefix hashes (:class:`PrefixHashes`), a byte
budget with least-recently-used eviction that drops superseded entries first (an entry that is
a strict prefix of another: the earlier turns of a conversation whose newer snapshot covers
them), an optional cap on tokens per entry, and counters for the metrics.
"""

from __future__ import annotations

import array
import hashlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from headstart.engine.host_arena import HostBlock, aligned
from headstart.state import StatePool


@dataclass
class CacheEntry:
    tokens: tuple[int, ...]
    nbytes: int
    payload: Any  # a Snapshot in the engine; anything in bookkeeping tests
    # Index bookkeeping: how many other entries this one is a strict prefix of, and the
    # hashes of its prefixes.
    extensions: int = field(default=0, compare=False)
    hashes: PrefixHashes | None = field(default=None, repr=False, compare=False)

    @property
    def length(self) -> int:
        return len(self.tokens)


HASH_BLOCK = 64  # tokens per link of a :class:`PrefixHashes` chain


class PrefixHashes:
    """A collision-resistant hash of every prefix of ``tokens``, each in O(:data:`HASH_BLOCK`)
    after one pass.

    Why: the index looks a prompt up at every length it holds an entry of, and keeps, for each
    entry, the count of entries it is a prefix of. Hashing and comparing ``tokens[:n]`` as a
    tuple for each such length cost O(entries x tokens) a lookup or an insert: 21 ms an agent
    turn on this project's CI machine once a conversation held 12k tokens and 40 entries.
    A chain of BLAKE2b digests at every multiple of :data:`HASH_BLOCK` makes each prefix's hash
    the link before it and at most ``HASH_BLOCK - 1`` tokens. The digests are 128-bit and
    cryptographic (as vLLM's prefix-cache block hashes are), so an equal hash is taken as an
    equal prefix without comparing tokens: a prompt cannot be crafted to restore another's
    state."""

    __slots__ = ("_bytes", "_chain", "tokens")

    def __init__(self, tokens: tuple[int, ...], base: PrefixHashes | None = None) -> None:
        """``base``: the hashes of an earlier sequence, likely a prefix of ``tokens`` (the state
        a slot holds, which the conversation's next prompt extends). When it is one, its bytes
        and links are reused and only the tokens after it are converted and hashed: an agent
        turn at 12k tokens of history hashes its ~500 new ones, not all 12k (BENCHMARKS.md:
        the lookup's share of a turn's first token). Equal to ``PrefixHashes(tokens)`` either
        way."""
        self.tokens = tokens
        step = 8 * HASH_BLOCK
        n = 0 if base is None else len(base.tokens)
        if n and n <= len(tokens) and tokens[:n] == base.tokens:
            kept = n // HASH_BLOCK  # whole links of base; its partial tail is hashed again
            chain = base._chain[: kept + 1]
            self._bytes = base._bytes[: 8 * n] + array.array("q", tokens[n:]).tobytes()
        else:
            chain = [b""]
            self._bytes = array.array("q", tokens).tobytes()
        for end in range(step * len(chain), len(self._bytes) + 1, step):
            chain.append(_digest(chain[-1] + self._bytes[end - step : end]))
        self._chain = chain

    def at(self, n: int) -> bytes:
        """The hash of ``tokens[:n]`` (``n <= len(tokens)``)."""
        j = n // HASH_BLOCK
        return _digest(b"p" + self._chain[j] + self._bytes[8 * j * HASH_BLOCK : 8 * n])


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    restored_tokens: int = 0
    evictions: int = 0
    inserts: int = 0
    failed_restores: int = 0


@dataclass
class PromptCacheIndex:
    budget_bytes: int
    max_tokens: int = 0  # 0: no cap on tokens per entry
    # Least recently used first. A plain dict, not an OrderedDict: iterating an OrderedDict's
    # values hashes every key again, O(tokens) per entry.
    entries: dict[tuple[int, ...], CacheEntry] = field(default_factory=dict)
    lengths: Counter[int] = field(default_factory=Counter)  # entry lengths, for lookup
    superseded: int = 0  # entries that are a strict prefix of another entry
    bytes_held: int = 0
    stats: CacheStats = field(default_factory=CacheStats)
    # (length, prefix hash) -> the entries with that hash (almost always one).
    hashed: dict[tuple[int, bytes], list[CacheEntry]] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def lookup(
        self,
        tokens: Sequence[int],
        max_length: int | None = None,
        usable: Callable[[CacheEntry], bool] | None = None,
        hashes: PrefixHashes | None = None,
    ) -> CacheEntry | None:
        """The entry with the longest prefix of ``tokens`` (at most ``max_length`` long) that
        ``usable`` accepts (default: any), marked as recently used; None on a miss. Counts
        exactly one hit or one miss; entries ``usable`` refuses are neither marked nor
        counted. ``hashes``: ``PrefixHashes(tokens)`` when the caller has them (a lookup in two
        tiers hashes the prompt once)."""
        limit = len(tokens) if max_length is None else min(max_length, len(tokens))
        if hashes is None:
            hashes = PrefixHashes(tuple(tokens[:limit]))
        for length in sorted((n for n in self.lengths if n <= limit), reverse=True):
            for entry in self._with_prefix_of(hashes, length):
                if usable is None or usable(entry):
                    self._touch(entry.tokens)
                    self.stats.hits += 1
                    return entry
        self.stats.misses += 1
        return None

    def _touch(self, key: tuple[int, ...]) -> None:
        """Mark ``key``'s entry most recently used."""
        self.entries[key] = self.entries.pop(key)

    def _with_prefix_of(self, hashes: PrefixHashes, length: int) -> list[CacheEntry]:
        """The entries equal to ``hashes.tokens[:length]`` (equal prefix hashes)."""
        return self.hashed.get((length, hashes.at(length)), [])

    def contains(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self.entries

    def holds(self, length: int, digest: bytes) -> bool:
        """Whether an entry of ``length`` tokens has the prefix hash ``digest``
        (:meth:`PrefixHashes.at`): :meth:`contains` without hashing the tokens again."""
        return (length, digest) in self.hashed

    def admits(self, length: int, nbytes: int) -> bool:
        return (
            self.enabled
            and nbytes <= self.budget_bytes
            and (self.max_tokens <= 0 or length <= self.max_tokens)
        )

    def insert(
        self,
        tokens: Sequence[int],
        nbytes: int,
        payload: Any,
        hashes: PrefixHashes | None = None,
    ) -> list[CacheEntry]:
        """Add (or refresh) an entry, evicting least recently used ones to stay within budget.
        Returns the evicted entries. An entry the budget or the token cap refuses is not stored.
        ``hashes``: ``PrefixHashes`` of exactly ``tokens`` when the caller has them (an entry
        demoted from another tier keeps its own)."""
        key = tuple(tokens)
        if key in self.entries:
            self._touch(key)
            return []
        if not self.admits(len(key), nbytes):
            return []
        evicted = []
        while self.bytes_held + nbytes > self.budget_bytes and self.entries:
            evicted.append(self._remove(self._victim()))
        if hashes is None or len(hashes.tokens) != len(key):
            hashes = PrefixHashes(key)
        self._count_prefixes(hashes, +1)
        # Entries this one is a prefix of (an earlier turn stored after a later one's).
        n, h = len(key), hashes.at(len(key))
        entry = CacheEntry(key, nbytes, payload, hashes=hashes)
        entry.extensions = sum(
            1
            for e in self.entries.values()
            if e.length > n and e.hashes is not None and e.hashes.at(n) == h
        )
        self.superseded += entry.extensions > 0
        self.entries[key] = entry
        self.hashed.setdefault((n, h), []).append(entry)
        self.lengths[len(key)] += 1
        self.bytes_held += nbytes
        self.stats.inserts += 1
        self.stats.evictions += len(evicted)
        return evicted

    def _count_prefixes(self, hashes: PrefixHashes, delta: int) -> None:
        """``hashes.tokens`` arrives (+1) or leaves (-1): the entries that are its strict
        prefixes gain or lose one entry that extends them."""
        for length in [n for n in self.lengths if n < len(hashes.tokens)]:
            for prefix in self._with_prefix_of(hashes, length):
                before = prefix.extensions > 0
                prefix.extensions += delta
                self.superseded += (prefix.extensions > 0) - before

    def _victim(self) -> tuple[int, ...]:
        """The entry eviction drops next: the least recently used superseded entry (a strict
        prefix of another entry), else the least recently used one."""
        if self.superseded:
            for key, entry in self.entries.items():  # least recently used first
                if entry.extensions > 0:
                    return key
        return next(iter(self.entries))

    def _remove(self, key: tuple[int, ...]) -> CacheEntry:
        entry = self.entries.pop(key)
        self.superseded -= entry.extensions > 0
        hashes = entry.hashes
        assert hashes is not None
        slot = (len(key), hashes.at(len(key)))
        self.hashed[slot] = [e for e in self.hashed[slot] if e is not entry]
        if not self.hashed[slot]:
            del self.hashed[slot]
        self._count_prefixes(hashes, -1)
        self.lengths[len(key)] -= 1
        if not self.lengths[len(key)]:
            del self.lengths[len(key)]
        self.bytes_held -= entry.nbytes
        return entry

    def discard(self, tokens: Sequence[int]) -> CacheEntry | None:
        if tuple(tokens) in self.entries:
            return self._remove(tuple(tokens))
        return None

    def evict_oldest(self) -> CacheEntry | None:
        """Drop the entry eviction picks (see :meth:`_victim`; to free fixed storage); None
        when empty."""
        if not self.entries:
            return None
        self.stats.evictions += 1
        return self._remove(self._victim())


@dataclass(frozen=True)
class Snapshot:
    """A slot's state after ``length`` tokens (see the module docstring), group by group as
    :meth:`StatePool.slot_state` lays it out: each fixed-size group whole (rows of a
    :class:`SnapshotStore` when one is used; ``row`` is then set), each per-token group's first
    ``length`` rows. A host copy packed into a block of the host tier's arena holds that
    ``block``, which goes back to the arena when the copy leaves the tier."""

    length: int
    state: Mapping[str, torch.Tensor]
    logits: torch.Tensor | None  # [vocab] raw logits of the next token, end-of-prompt only
    # The drafter's state: target features of the newest rows before ``length`` (its context
    # ring is rebuilt from them), None without a drafter.
    draft_features: torch.Tensor | None = None
    row: int | None = None
    block: HostBlock | None = None

    def restore(self, pool: StatePool, slot: int) -> None:
        """Overwrite everything the slot's stream reads at positions < length; raises
        ValueError, writing nothing, when the snapshot does not fit ``pool``."""
        pool.load_slot(slot, self.state, self.length)

    def to_host(self, non_blocking: bool = False, into: torch.Tensor | None = None) -> Snapshot:
        """A copy in host memory; ``non_blocking``: the copies may still be running on the
        current CUDA stream. ``into``: a uint8 host buffer of at least :meth:`host_bytes` bytes
        (a block of the host tier's arena) that the copy's tensors are packed into, each at an
        offset aligned to ``ALIGN``; without it each tensor is allocated (pinned when a GPU is
        present, for fast copies back)."""
        pin = torch.cuda.is_available()
        offset = 0

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            nonlocal offset
            if t is None:
                return None
            if into is None:
                out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            else:
                n = t.numel() * t.element_size()
                out = into[offset : offset + n].view(t.dtype).view(t.shape)
                offset += aligned(n)
            return out.copy_(t, non_blocking=non_blocking)

        if into is not None and into.numel() < self.host_bytes():
            raise ValueError(f"host buffer of {into.numel()} bytes < {self.host_bytes()} needed")
        return Snapshot(
            self.length,
            {k: host(t) for k, t in self.state.items()},
            host(self.logits),
            host(self.draft_features),
        )

    def host_bytes(self) -> int:
        """The bytes :meth:`to_host` packs this snapshot into (each tensor aligned)."""
        return sum(aligned(t.numel() * t.element_size()) for t in self._tensors())

    def extras_on(self, device: torch.device) -> Snapshot:
        """This snapshot with its logits and drafter features on ``device`` (copied there when
        they are elsewhere; the state stays where it is, :meth:`restore` copies it into a
        slot). A restore from host memory hands the engine this: it samples from the logits
        and feeds the features on the device, and the restore's timing includes their copy."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Snapshot(
            self.length, self.state, move(self.logits), move(self.draft_features), self.row
        )

    def _tensors(self) -> list[torch.Tensor]:
        return [
            *self.state.values(),
            *(t for t in (self.logits, self.draft_features) if t is not None),
        ]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def fingerprint(self) -> str:
        """A hash of every byte (tests use it to prove snapshots are never written)."""
        h = hashlib.sha256()
        for t in self._tensors():
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


class SnapshotStore:
    """Preallocated storage for the fixed-size part of snapshots (every fixed-size state group,
    e.g. the GDN layers' conv tails and recurrent states: the bulk of a snapshot), ``capacity``
    rows with a free list, so caching prompts does not allocate and free large blocks per
    request. Per-token rows, logits and drafter features vary in size and
    stay per-snapshot tensors."""

    def __init__(self, pool: StatePool, capacity: int) -> None:
        self.fixed = {
            name: torch.empty((capacity, *t.shape), dtype=t.dtype, device=t.device)
            for name, t in pool.slot_state(0, 0).items()
            if not _group(pool, name).per_token
        }
        self._capacity = capacity
        self.free = list(range(capacity - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self._capacity

    def take(
        self,
        pool: StatePool,
        slot: int,
        length: int,
        logits: torch.Tensor | None = None,
        draft_features: torch.Tensor | None = None,
    ) -> Snapshot:
        """Snapshot the slot after ``length`` tokens: the fixed part is copied into a free row,
        per-token rows, logits and drafter features into tensors of their own."""
        row = self.free.pop()
        state = {}
        for name, view in pool.slot_state(slot, length).items():
            if name in self.fixed:
                state[name] = self.fixed[name][row]
                state[name].copy_(view)
            else:
                state[name] = view.clone()
        return Snapshot(
            length,
            state,
            None if logits is None else logits.detach().clone(),
            None if draft_features is None else draft_features.detach().clone(),
            row,
        )

    def release(self, snapshot: Snapshot) -> None:
        """Return the snapshot's row; the snapshot must not be used afterwards."""
        if snapshot.row is not None:
            assert snapshot.row not in self.free, "a row is released once"
            self.free.append(snapshot.row)


def _group(pool: StatePool, name: str):
    return next(g for g in pool.groups if g.name == name)
