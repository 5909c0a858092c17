"""The prompt cache as the engine sees it: two tiers of snapshots behind one object.

:class:`PromptCache` owns a device tier (a :class:`PromptCacheIndex` over snapshots whose
fixed-size part lives in a :class:`SnapshotStore`) and an optional host tier (an index over host
copies). Its methods follow a prefix cache's interface (``match_prefix``, ``insert``, eviction):
the engine asks where a prompt's prefill may pause (:meth:`PromptCache.boundaries`), restores the
longest match into a new stream's slot, and offers every forward's results for snapshots.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from headstart.engine.config import CacheConfig
from headstart.engine.host_arena import HostArena, HostBlock, aligned
from headstart.engine.host_copies import HostCopies
from headstart.engine.prompt_cache import (
    CacheEntry,
    PrefixHashes,
    PromptCacheIndex,
    Snapshot,
    SnapshotStore,
)
from headstart.engine.scheduler import Sequence as Seq
from headstart.engine.scheduler import Work
from headstart.state import StatePool

if TYPE_CHECKING:
    from headstart.parallel.snapshots import SnapshotTwins

log = logging.getLogger("headstart.engine")


@dataclass(frozen=True)
class Match:
    """A cached prefix found by :meth:`PromptCache.match_prefix`, and the tier holding it."""

    entry: CacheEntry
    index: PromptCacheIndex
    in_place: bool = False  # the slot it is for holds exactly this state already

    @property
    def snapshot(self) -> Snapshot:
        return self.entry.payload


@dataclass(frozen=True)
class Due:
    """A snapshot a step owes (:meth:`PromptCache.snapshots_due`): slot ``slot`` of sequence
    ``seq_id`` holds exactly ``tokens``; ``logits_row``: the step's logits row of the next
    token when the snapshot ends the prompt (kept with it), else None."""

    seq_id: str
    tokens: tuple[int, ...]
    slot: int
    logits_row: int | None


@dataclass
class Transfers:
    """Copies between the tiers: bytes copied and the wall seconds they took, each copy's
    completion included (on CUDA the clock stops after a synchronize), so ``bytes / seconds``
    is the bandwidth the engine thread saw."""

    bytes: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, since: float) -> None:
        """Count a copy of ``nbytes`` that began at ``time.perf_counter()`` = ``since``."""
        self.count(nbytes, time.perf_counter() - since)

    def count(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.seconds += seconds


def _settle(device: torch.device) -> None:
    """Wait for the copies queued on ``device``: a CUDA copy may return before it lands, and
    the forward that follows a restore needs the state anyway."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _start(device: torch.device) -> float:
    """The clock at the start of a copy on ``device``, once the work queued before it is done
    (so a transfer's seconds are its copies', not a forward's still running)."""
    _settle(device)
    return time.perf_counter()


class PromptCache:
    """Snapshots of prompt prefixes in two tiers; the contract:

    * Lookup (:meth:`match_prefix`): each enabled tier finds its longest entry that is a
      prefix of the prompt and usable: an entry as long as the whole prompt is usable only if
      it holds the first token's logits (a boundary snapshot that happens to end where this
      prompt ends cannot give that token, so a shorter entry is used instead). Each enabled
      tier counts one hit or one miss per lookup. The longer of the two tiers' matches is
      returned, the device tier's on a tie.
    * Restore (:meth:`restore`): copies a match into a slot; a failed restore is counted in
      its tier, drops the entry and leaves the stream to prefill from scratch.
    * Snapshots (:meth:`snapshots_due`, then :meth:`take_snapshots` once the step's tokens are
      sent): after a forward, a sequence whose rows just ended at
      one of its boundaries, or at the end of its prompt before any output (then with that
      row's logits), is snapshotted into the device tier unless that prefix is cached already
      or the tier refuses it (over budget, or longer than ``max_tokens``); so is every
      finished generation, prompt and answer (:meth:`take_final`, without logits). A failed
      snapshot is logged and is a later miss, nobody's failure.
    * Eviction: the device tier drops least recently used entries, superseded ones first (a
      strict prefix of another entry: an earlier turn of a conversation whose newer snapshot
      covers it), to stay within its byte budget or when the snapshot store has no free row;
      each entry it drops is copied to the host tier (if there is one and it lacks that
      prefix), whose own budget evicts its least recently used entries for good. The host
      tier only receives entries demoted this way. Its memory is a :class:`HostArena`
      allocated at construction (pinned on CUDA): a demotion reserves a block of it, evicting
      the host tier's least recently used entries until one fits, and is not kept when none
      can (a snapshot larger than the arena's largest region, or space held by copies in
      flight). With ``copies`` (:class:`HostCopies`, on
      CUDA by default) a demotion is copied by a worker thread: the entry is in neither tier
      (a miss) and keeps its device row until its copy is taken in, at the next lookup or
      snapshot; a snapshot that needs a row while all are held waits for the copies.
    * Transfers: a restore from the host tier copies the snapshot's state into the slot and
      its logits and drafter features to the device (the snapshot :meth:`restore` returns
      holds those copies); its bytes (the snapshot's) and wall time are counted, as are a
      demotion's (the host copy's bytes and the time to make it).
    * Statistics (:meth:`stats`): the device tier's entries, bytes, hits, misses, restored
      tokens, evictions and failed restores; the host tier's entries, bytes and hits; the
      bytes and seconds of host restores and of demotions; and seams: lookups of a prompt
      that extends a cached generation's prompt but not its answer as generated (the
      template or the tokenizer gave the answer other tokens: the longest prefix that
      matches token for token is restored, never more).

    Without a device budget the cache is off: no boundaries, no lookups, no snapshots.

    ``twins`` (a tensor-parallel model's rank 0): every snapshot taken, restored or copied to
    the host tier is reported there, so the other ranks do the same with their part of it.
    """

    def __init__(
        self,
        pool: StatePool,
        config: CacheConfig,
        vocab_size: int,
        twins: SnapshotTwins | None = None,
    ) -> None:
        self.pool = pool
        self.twins = twins
        self.device = PromptCacheIndex(config.bytes, config.max_tokens)
        self.host = PromptCacheIndex(config.host_bytes, config.max_tokens)
        self.interval = config.interval
        self.logit_bytes = vocab_size * 4  # a snapshot's logits row, float32
        self.fail_restores = 0  # test hook: make the next N restores raise
        # A cached generation's prompt -> its snapshot's tokens (prompt + answer), each as
        # (length, prefix hash), the newest 4 x max_snapshots of them: what seam counting
        # compares a prompt with, by hash (comparing token tuples cost O(generations x tokens)
        # a lookup: 3 ms on this project's CI machine at turn 20 of an agent loop).
        self.generations: OrderedDict[tuple[int, bytes], tuple[int, bytes]] = OrderedDict()
        self.generation_cap = 4 * config.max_snapshots
        self.seams = 0
        # Slot -> the prefix hashes of the generation snapshot that the slot still holds
        # exactly: set when a stream's generation is snapshotted (its slot is freed next), and
        # dropped when the slot is next looked up for (match_prefix), before anything writes it.
        # The next turn of a conversation usually gets that very slot (freed slots are reused
        # first), and then its restore copies nothing: at 12k tokens of 27B history that copy
        # is 0.8 GB on the device. Its lookup also extends these hashes instead of hashing the
        # whole prompt again.
        self._resident: dict[int, PrefixHashes] = {}
        self.in_place = 0  # restores that found their state already in the slot
        self.host_restores = Transfers()  # host tier -> a slot on the device
        self.demotions = Transfers()  # device tier -> host tier
        self.store: SnapshotStore | None = None
        self.copies: HostCopies | None = None
        # The host tier's memory (a tensor-parallel model's ranks copy per snapshot instead:
        # their twins are kept rank by rank, outside this arena).
        self.arena: HostArena | None = None
        if self.enabled and self.host.enabled and twins is None:
            since = time.perf_counter()
            self.arena = HostArena(config.host_bytes, pin=pool.device.type == "cuda")
            log.info(
                "prompt cache host tier: %d MiB%s in %d regions in %.1fs",
                self.arena.capacity >> 20,
                " pinned" if self.arena.pinned else "",
                len(self.arena.regions),
                time.perf_counter() - since,
            )
            self.host.budget_bytes = self.arena.capacity
            wanted = config.async_demotion
            if wanted or (wanted is None and pool.device.type == "cuda"):
                self.copies = HostCopies(pool.device)
        if self.enabled:
            # Rows for the fixed part of snapshots: as many as the budget could hold, capped so
            # a large budget over a small model does not reserve memory it will never use.
            rows = config.bytes // self.snapshot_bytes(0, False)
            self.store = SnapshotStore(pool, max(1, min(rows, config.max_snapshots)))

    @property
    def enabled(self) -> bool:
        return self.device.enabled

    def boundaries(
        self, prompt_len: int, snapshot_at: Sequence[int], restored: int = 0
    ) -> tuple[int, ...]:
        """Where a prompt's prefill must pause for a snapshot besides its end: the requested
        positions and every ``interval`` tokens, inside the prompt and past the ``restored``
        prefix. A prompt restored up to ``restored`` with fewer than ``interval`` tokens left
        (the next turn of a conversation, an agent's tool result) is not cut at interval
        positions: its snapshots at ``restored`` and at its end are less than an interval
        apart already, and a cut costs it one more step before its first token."""
        if not self.enabled:
            return ()
        n = prompt_len
        fixed = range(self.interval, n, self.interval) if self.interval else ()
        if restored and n - restored < self.interval:
            fixed = ()
        return tuple(sorted({p for p in (*snapshot_at, *fixed) if restored < p < n}))

    def snapshot_bytes(self, length: int, with_logits: bool) -> int:
        logits = self.logit_bytes if with_logits else 0
        return self.pool.fixed_bytes() + self.pool.token_bytes() * length + logits

    # -- lookup and restore ----------------------------------------------------------------
    def match_prefix(self, prompt: Sequence[int], slot: int | None = None) -> Match | None:
        """The longest usable cached prefix of ``prompt`` over both tiers (see the class).
        ``slot``: the slot the prompt was admitted to, which nothing has written since; every
        admission must look up with its slot, whether or not it restores (the match says
        whether the slot holds that state already)."""

        def usable(entry: CacheEntry) -> bool:
            return entry.length < len(prompt) or entry.payload.logits is not None

        held = self._resident.pop(slot, None) if slot is not None else None
        if not self.enabled:
            return None
        self._settle_copies()
        hashes = PrefixHashes(tuple(prompt), base=held)  # once for both tiers
        found = [
            Match(entry, index)
            for index in (self.device, self.host)
            if index.enabled
            for entry in [index.lookup(prompt, usable=usable, hashes=hashes)]
            if entry is not None
        ]
        best = max(found, key=lambda m: m.entry.length, default=None)
        self._count_seam(hashes, best.entry.length if best is not None else 0)
        n = best.entry.length if best is not None else -1
        if held is not None and n == len(held.tokens) and held.at(n) == hashes.at(n):
            best = replace(best, in_place=True)
        return best

    def _count_seam(self, prompt: PrefixHashes, matched: int) -> None:
        """Count a seam when the prompt extends a cached generation's prompt, is longer than
        its prompt + answer, and yet the match stopped short of that generation's snapshot."""
        n = len(prompt.tokens)
        for length in {p for p, _ in self.generations if p < n}:
            answered = self.generations.get((length, prompt.at(length)))
            if (
                answered is not None
                and matched < answered[0] < n
                and (self.device.holds(*answered) or self.host.holds(*answered))
            ):
                self.seams += 1
                return

    def restore(self, match: Match, slot: int, owner: str = "") -> Snapshot | None:
        """Copy ``match`` into ``slot`` (for request ``owner``); its snapshot, or None when the
        restore failed (then the slot must be treated as empty: the stream prefills from
        position 0)."""
        try:
            if self.fail_restores:
                self.fail_restores -= 1
                raise RuntimeError("injected restore failure")
            if match.in_place:  # every rank's slot holds it (they run the same steps)
                snap = match.snapshot
                if match.index is self.host:
                    snap = snap.extras_on(self.pool.device)
                self.in_place += 1
            else:
                if match.index is self.host:
                    snap = self._restore_from_host(match.snapshot, slot)
                else:
                    match.snapshot.restore(self.pool, slot)
                    snap = match.snapshot
                if self.twins is not None:
                    self.twins.restored(match.snapshot, slot)
        except Exception:
            log.exception("prompt-cache restore failed for %s; prefilling instead", owner)
            match.index.stats.failed_restores += 1
            gone = match.index.discard(match.entry.tokens)
            if match.index is self.device:
                self._release(gone)
            else:
                self._drop_host([gone] if gone is not None else [])
            return None
        match.index.stats.restored_tokens += match.entry.length
        return snap

    def _restore_from_host(self, snap: Snapshot, slot: int) -> Snapshot:
        """Copy host snapshot ``snap`` into ``slot``, its logits and features to the device,
        timed until the copies landed; the snapshot with those device copies."""
        since = _start(self.pool.device)
        snap.restore(self.pool, slot)
        out = snap.extras_on(self.pool.device)
        _settle(self.pool.device)
        # Counted only once every copy succeeded: a failed restore moved nothing usable.
        self.host_restores.add(snap.nbytes(), since)
        return out

    # -- snapshots -------------------------------------------------------------------------
    def snapshots_due(self, work: Sequence[Work], last_rows: Sequence[int]) -> list[Due]:
        """After a forward over ``work`` (``last_rows[j]``: the logits row of item j's last
        row), and before any of its tokens is delivered: the snapshots the class docstring
        describes, to be taken by :meth:`take_snapshots`."""
        if not self.enabled:
            return []
        due = []
        for w, row in zip(work, last_rows, strict=True):
            seq = w.seq
            end = w.start + len(w.tokens)
            if end > len(seq.prompt) or w.start >= len(seq.prompt):
                continue
            at_end = end == len(seq.prompt) and w.samples and not seq.output
            if at_end or end in seq.boundaries:
                due.append(Due(seq.id, tuple(seq.prompt[:end]), seq.slot, row if at_end else None))
        return due

    def take_snapshots(
        self,
        due: Sequence[Due],
        logits: torch.Tensor,
        features: Mapping[str, Callable[[int], torch.Tensor | None]],
    ) -> None:
        """Take the snapshots :meth:`snapshots_due` found, once the step's tokens are out (their
        slots must still hold exactly those rows). ``features[seq_id](end)``: the drafter
        features of the sequence's rows before ``end``, or None."""
        for d in due:
            try:
                self.insert(
                    d.tokens,
                    d.slot,
                    logits[d.logits_row] if d.logits_row is not None else None,
                    lambda d=d: features[d.seq_id](len(d.tokens)),
                )
            except Exception:  # a snapshot not taken is a later cache miss, nobody's failure
                log.exception("snapshot of %s failed; not cached", d.seq_id)

    def take_final(self, seq: Seq, features: Callable[[int], torch.Tensor | None]) -> None:
        """At the end of ``seq``'s generation, before its slot is freed: snapshot the prompt
        and the answer tokens that went through the model (the slot holds exactly those), so
        a next prompt that extends prompt + answer (the next turn of a conversation, an agent
        loop) restores all of it. No logits: it serves only longer prompts. ``features(end)``:
        the drafter's features before ``end``."""
        if not self.enabled or seq.computed <= len(seq.prompt):
            return
        tokens = tuple((seq.prompt + seq.output)[: seq.computed])
        try:
            hashes = PrefixHashes(tokens)
            answered = (len(tokens), hashes.at(len(tokens)))
            assert seq.slot is not None
            self._resident[seq.slot] = hashes
            if self.insert(tokens, seq.slot, None, lambda: features(seq.computed), hashes):
                prompt = (len(seq.prompt), hashes.at(len(seq.prompt)))
                self.generations[prompt] = answered
                self.generations.move_to_end(prompt)
                while len(self.generations) > self.generation_cap:
                    self.generations.popitem(last=False)
        except Exception:  # a snapshot not taken is a later cache miss, nobody's failure
            log.exception("end-of-generation snapshot of %s failed; not cached", seq.id)

    def insert(
        self,
        tokens: Sequence[int],
        slot: int,
        logits: torch.Tensor | None,
        features: Callable[[], torch.Tensor | None],
        hashes: PrefixHashes | None = None,
    ) -> bool:
        """Snapshot ``slot``, which holds exactly ``tokens``, into the device tier (with
        ``logits``, the next token's, when given; ``features()``: the drafter's; ``hashes``:
        the tokens' ``PrefixHashes`` when the caller has them). False when the prefix is cached
        already or the tier refuses it."""
        key = tuple(tokens)
        if self.device.contains(key) or not self.device.admits(
            len(key), self.snapshot_bytes(len(key), logits is not None)
        ):
            return False
        assert self.store is not None
        self._settle_copies()
        while not self.store.free:  # fixed storage full: the least recently used goes
            if self.copies is not None and self.copies.pending:
                self._settle_copies(wait=True)  # rows come back as their copies finish
                continue
            self._demote(self.device.evict_oldest())
        snap = self.store.take(
            self.pool, slot, len(key), logits.float() if logits is not None else None, features()
        )
        if self.twins is not None:
            self.twins.taken(snap, slot)
        for gone in self.device.insert(key, snap.nbytes(), snap, hashes):
            self._demote(gone)
        if not self.device.contains(key):  # refused (over budget): give the row back
            self.store.release(snap)
            return False
        return True

    def _demote(self, entry: CacheEntry | None) -> None:
        """A snapshot leaves the device tier: kept in the host tier if there is one."""
        if entry is None:
            return
        if self.host.enabled and not self.host.contains(entry.tokens):
            block = into = None
            if self.arena is not None:
                block = self._reserve_host(entry.payload.host_bytes())
                if block is None:  # no room for it: not kept
                    self._release(entry)
                    return
                into = self.arena.tensor(block)
            if self.copies is not None:  # its row comes back when the copy is done
                self.copies.submit(entry, into, block)
                return
            since = _start(self.pool.device)
            snap = entry.payload.to_host(into=into)
            _settle(self.pool.device)
            self.demotions.add(snap.nbytes(), since)
            if self.twins is not None:
                self.twins.copied(entry.payload, snap)
            self._insert_host(entry, snap, block)
        self._release(entry)

    def _reserve_host(self, nbytes: int) -> HostBlock | None:
        """A block of the arena for ``nbytes``, evicting the host tier's least recently used
        entries until one fits; None when none can."""
        assert self.arena is not None
        if aligned(nbytes) > self.arena.largest_region:
            return None
        while (block := self.arena.reserve(nbytes)) is None and self.host.entries:
            self._drop_host([self.host.evict_oldest()])
        return block

    def _insert_host(self, entry: CacheEntry, snap: Snapshot, block: HostBlock | None) -> None:
        """Add the host copy ``snap`` of device entry ``entry`` (in ``block`` of the arena, if
        any, which it then holds) to the host tier, under the entry's tokens and prefix hashes;
        a copy the tier refuses or has already gives its block back."""
        tokens = entry.tokens
        if self.host.contains(tokens):
            self._drop_block(block)
            return
        nbytes = snap.nbytes()
        if block is not None:  # (without an arena the copy stays the object twins know by id)
            snap, nbytes = replace(snap, block=block), block.nbytes
        self._drop_host(self.host.insert(tokens, nbytes, snap, entry.hashes))
        if not self.host.contains(tokens):
            self._drop_block(block)

    def _drop_host(self, gone: Sequence[CacheEntry | None]) -> None:
        """Host entries that left the tier give their blocks back to the arena."""
        for entry in gone:
            if entry is not None:
                self._drop_block(entry.payload.block)

    def _drop_block(self, block: HostBlock | None) -> None:
        if block is not None and self.arena is not None:
            self.arena.release(block)

    def _settle_copies(self, wait: bool = False) -> None:
        """Take in the demotions copied since the last call (all pending ones when ``wait``):
        each copy joins the host tier unless that prefix is there already, and its device
        row is freed."""
        if self.copies is None:
            return
        for done in self.copies.wait_all() if wait else self.copies.finished():
            self.demotions.count(done.nbytes, done.seconds)
            if done.host is not None:
                self._insert_host(done.entry, done.host, done.block)
            else:
                self._drop_block(done.block)
            self._release(done.entry)

    def settle(self) -> bool:
        """Take in the demotions finished so far (never blocks); whether others are still in
        flight. The engine calls it while idle, so that a demotion that finished between two
        requests joins the host tier then, not inside the next request's lookup, where its
        host-index work would delay that request's first token."""
        self._settle_copies()
        return self.copies is not None and self.copies.pending > 0

    def flush(self) -> None:
        """Wait for every demotion in flight and take it in. Engine thread only (or any thread
        while the engine is idle, as tests do)."""
        self._settle_copies(wait=True)

    def close(self) -> None:
        """Stop the demotion worker (copies in flight finish; their results are dropped)."""
        if self.copies is not None:
            self.copies.close()

    def _release(self, entry: CacheEntry | None) -> None:
        if entry is not None and self.store is not None:
            self.store.release(entry.payload)

    def stats(self) -> dict[str, float]:
        """The ``cache_*`` statistics (see the class docstring); counts are ints, the
        ``*_seconds`` floats."""
        d, h, store = self.device, self.host, self.store
        return {
            "cache_entries": len(d.entries),
            "cache_bytes": d.bytes_held,
            "cache_budget_bytes": d.budget_bytes,
            "cache_store_rows": store.capacity if store else 0,
            "cache_free_rows": len(store.free) if store else 0,
            "cache_host_entries": len(h.entries),
            "cache_host_bytes": h.bytes_held,
            "cache_host_hits": h.stats.hits,
            "cache_host_restored_bytes": self.host_restores.bytes,
            "cache_host_restore_seconds": self.host_restores.seconds,
            "cache_demoted_bytes": self.demotions.bytes,
            "cache_demote_seconds": self.demotions.seconds,
            "cache_demotions_pending": self.copies.pending if self.copies else 0,
            "cache_hits": d.stats.hits,
            "cache_misses": d.stats.misses,
            "cache_restored_tokens": d.stats.restored_tokens,
            "cache_evictions": d.stats.evictions,
            "cache_failed_restores": d.stats.failed_restores,
            "cache_seams": self.seams,
            "cache_restores_in_place": self.in_place,
        }
