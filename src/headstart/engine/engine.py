"""The serving engine: one thread that runs the model over every active stream, step after step.

Other threads talk to it through :meth:`Engine.submit` and :meth:`Engine.abort` (both thread-safe,
non-blocking); results flow back through each request's ``sink`` callback, called on the engine
thread with a :class:`~headstart.engine.output.Piece` per token and one final
:class:`~headstart.engine.output.Finish` or :class:`Failed`. After the final event a request
gets nothing more; an aborted request gets nothing at all. A failure inside a step fails only the
requests of that step, and the engine goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.drafter import DFlashDrafter
from headstart.engine.output import Finish, OutputStream, Piece
from headstart.engine.prompt_cache import PromptCacheIndex, Snapshot, SnapshotStore
from headstart.engine.scheduler import QueueFull, Scheduler, Work
from headstart.engine.scheduler import Sequence as Seq
from headstart.engine.speculative import Draft, verify, verify_tree
from headstart.engine.speculator import DraftJob, Speculator
from headstart.model import ForwardOutput, Qwen35Model
from headstart.sampling import Sampler, SamplingParams, make_generator
from headstart.tokenizer import Tokenizer

log = logging.getLogger("headstart.engine")

__all__ = ["Engine", "EngineRequest", "Failed", "Finish", "Piece", "QueueFull"]


@dataclass
class Failed:
    message: str


Event = Piece | Finish | Failed


@dataclass
class EngineRequest:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    sink: Callable[[Event], None]  # called on the engine thread; must not block
    # Prompt positions worth a snapshot besides the end (e.g. right after the last
    # "<|im_start|>assistant\n", where the next turn of the conversation diverges).
    snapshot_at: tuple[int, ...] = ()
    draft: bool = True  # speculative decoding when the engine has a drafter ("draft": false)


@dataclass
class _Live:
    req: EngineRequest
    seq: Seq
    out: OutputStream
    rng: torch.Generator | None
    draft: bool = False  # this stream drafts (the engine has a drafter and the request allows)
    # Target features (tapped hidden states) of committed rows not yet in the drafter's ring,
    # for positions features_start .. ; capped to the ring's window. Kept as a list of pieces,
    # joined only when read: while a stream does not draft, rows arrive one per step, and
    # joining on every step would copy up to the whole window each time.
    pieces: list[torch.Tensor] = field(default_factory=list)
    held: int = 0  # rows in pieces
    features_start: int = 0

    @property
    def features(self) -> torch.Tensor | None:
        if len(self.pieces) > 1:
            self.pieces = [torch.cat(self.pieces)]
        return self.pieces[0] if self.pieces else None

    @features.setter
    def features(self, value: torch.Tensor | None) -> None:
        self.pieces = [] if value is None else [value]
        self.held = 0 if value is None else value.shape[0]

    def add_features(self, rows: torch.Tensor, start: int, window: int) -> None:
        """Queue ``rows`` (positions ``start ..``), keeping the newest ``window`` rows."""
        if self.held and self.features_start + self.held != start:
            raise AssertionError("features must arrive in position order, without gaps")
        if rows.shape[0] >= window:  # the new rows alone fill the window
            drop = rows.shape[0] - window
            self.pieces, self.held = [rows[drop:].clone()], window
            self.features_start = start + drop
            return
        rows = rows.clone()  # may be a view of a graph's static output
        if self.held == 0:
            self.pieces, self.held, self.features_start = [rows], rows.shape[0], start
        else:
            self.pieces.append(rows)
            self.held += rows.shape[0]
        excess = self.held - window
        while excess > 0:  # drop the oldest rows (whole pieces, then part of one: a view)
            first = self.pieces[0]
            cut = min(excess, first.shape[0])
            if cut == first.shape[0]:
                self.pieces.pop(0)
            else:
                self.pieces[0] = first[cut:]
            self.features_start += cut
            self.held -= cut
            excess -= cut


class Engine:
    def __init__(self, model: Qwen35Model, tokenizer: Tokenizer, eos_token_ids: Sequence[int],
                 num_slots: int, context: int, max_queue: int = 256, prefill_chunk: int = 512,
                 step_tokens: int = 2048, cache_bytes: int = 0, cache_max_tokens: int = 0,
                 cache_interval: int = 1024, drafter: DFlashDrafter | None = None,
                 draft_block: int | None = None, draft_window: int = 4096,
                 graphs: bool | None = None, spec_mode: str = "auto", tree_width: int = 4,
                 tree_budget: int | None = None, max_snapshots: int = 256,
                 host_cache_bytes: int = 0, prefill_graph_tokens: int = 64,
                 window_graphs: bool = True, continuation_graphs: bool = True,
                 graph_capture: bool = True) -> None:
        """``graphs``: replay the decode step (and fresh prefills of 2 .. prefill_graph_tokens
        tokens) from CUDA graphs; default: when the kernels allow it. ``graph_capture=False``
        keeps the graph bookkeeping but runs eagerly (tests on a CPU). ``window_graphs``: with
        a drafter, also replay proposals, chain verify windows and rollbacks from graphs;
        ``continuation_graphs``: continued prefill chunks of up to prefill_graph_tokens tokens
        (both checked bit for bit against eager on a GPU by tests/test_gpu_model.py)."""
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_slots = num_slots
        self.context = context
        self.max_queue = max_queue
        if graphs is None:
            graphs = model.kernels.graphs and model.device.type == "cuda"
        # With graphs, one extra slot takes the padding rows of partly filled buckets.
        self.pool = model.new_state_pool(num_slots + int(graphs), context)
        self.scheduler = Scheduler(num_slots, max_queue, prefill_chunk, step_tokens)
        self.sampler = Sampler()
        self.cache = PromptCacheIndex(cache_bytes, cache_max_tokens)
        # A second tier in host memory: snapshots evicted from the first go there.
        self.host = PromptCacheIndex(host_cache_bytes, cache_max_tokens)
        self.store: SnapshotStore | None = None
        if self.cache.enabled:
            # Rows for the fixed part of snapshots: as many as the budget could hold, capped so
            # a large budget over a small model does not reserve memory it will never use.
            one = self._snapshot_bytes(0, False)
            self.store = SnapshotStore(self.pool, max(1, min(cache_bytes // one, max_snapshots)))
        self.cache_interval = cache_interval
        self.fail_restores = 0  # test hook: make the next N restores raise
        self.drafter = drafter
        self.spec: Speculator | None = None
        if drafter is not None:
            self.spec = Speculator(drafter, model, num_slots, context, tokenizer.vocab_size,
                                   draft_block, draft_window, spec_mode, tree_width, tree_budget)
        self.taps: tuple[int, ...] = self.spec.taps if self.spec else ()
        self.graphs = None
        self.prefill_graphs = None
        self.continuation_graphs = None
        self.window_graphs = None
        self.rollback_graphs = None
        # slot -> (rows its graphed window ran, padded; its index in the window batch), this step
        self._ran_rows: dict[int, tuple[int, int]] = {}
        runners = None
        if graphs:
            runners = self._capture_graphs(graph_capture, prefill_graph_tokens, window_graphs,
                                           continuation_graphs)
        if self.spec is not None:  # after the warm-up, so no timing includes compilation
            self.spec.measure(self.pool, slot=0, runners=runners)
        self._live: dict[str, _Live] = {}  # engine thread only
        self._lock = threading.Lock()
        self._commands: list[tuple[str, object]] = []
        self._active = 0  # submitted and not yet ended; guarded by _lock
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="headstart-engine", daemon=True)
        self.steps = 0

    # -- other threads ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    def submit(self, req: EngineRequest) -> None:
        """Queue a request; raises QueueFull when slots and queue are all taken, ValueError when
        it cannot fit the context."""
        if not req.prompt_ids or req.max_new_tokens < 1:
            raise ValueError("a request needs a prompt and at least one token to generate")
        if len(req.prompt_ids) + req.max_new_tokens > self.context:
            raise ValueError(f"{len(req.prompt_ids)} prompt tokens + {req.max_new_tokens} new "
                             f"tokens exceed the context of {self.context}")
        with self._lock:
            if self._active >= self.num_slots + self.max_queue:
                raise QueueFull(f"all {self.num_slots} slots are busy and {self.max_queue} "
                                "requests are waiting")
            self._active += 1
            self._commands.append(("add", req))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """End a request wherever it is and free its slot; it receives no further events."""
        with self._lock:
            self._commands.append(("abort", request_id))
        self._wake.set()

    def end_all(self, reason: str = "abort") -> None:
        """Finish every request now with a final event (used when shutting down)."""
        with self._lock:
            self._commands.append(("end_all", reason))
        self._wake.set()

    @property
    def active(self) -> int:
        return self._active

    def stats(self) -> dict[str, int]:
        s, c = self.scheduler, self.cache
        return {"running": s.num_running, "waiting": s.num_waiting, "slots": self.num_slots,
                "free_slots": len(s.free_slots), "active": self._active, "steps": self.steps,
                "cache_entries": len(c.entries), "cache_bytes": c.bytes_held,
                "cache_budget_bytes": c.budget_bytes,
                "cache_store_rows": self.store.capacity if self.store else 0,
                "cache_host_entries": len(self.host.entries),
                "cache_host_bytes": self.host.bytes_held, "cache_host_hits": self.host.stats.hits,
                "cache_free_rows": len(self.store.free) if self.store else 0, "cache_hits": c.stats.hits,
                "cache_misses": c.stats.misses, "cache_restored_tokens": c.stats.restored_tokens,
                "cache_evictions": c.stats.evictions, "cache_failed_restores":
                c.stats.failed_restores, **{f"spec_{k}": v for k, v in (self.spec.stats if self.spec else
                                                  {"rounds": 0, "drafted": 0, "accepted": 0,
                                                   "tree_rounds": 0}).items()}}

    def _capture_graphs(self, capture: bool, prefill_tokens: int, windows: bool,
                        continuations: bool):
        """Warm up, then capture: decode steps, fresh prefills and (with a drafter and
        ``windows``) proposals, verify windows and rollbacks. Returns the speculator's cost
        runners when rounds run from graphs (their costs are measured on them)."""
        from headstart.engine.cuda_graph import (
            ContinuationGraphs,
            DecodeGraphs,
            PrefillGraphs,
            RollbackGraphs,
            WindowGraphs,
        )

        scratch = self.num_slots
        model, pool = self.model, self.pool
        self._warm_up(scratch=scratch)
        self.graphs = DecodeGraphs(model, pool, self.num_slots, scratch, self.taps,
                                   capture=capture)
        mempool = self.graphs.mempool
        if prefill_tokens >= 2:
            self.prefill_graphs = PrefillGraphs(model, pool, min(prefill_tokens, self.context - 1),
                                                scratch, self.taps, capture=capture,
                                                mempool=mempool)
            if continuations:
                self.continuation_graphs = ContinuationGraphs(
                    model, pool, prefill_tokens, scratch, self.taps, capture=capture,
                    mempool=mempool)
        if not (windows and self.spec is not None and self.spec.block >= 2):
            return None
        block = self.spec.block
        wg = WindowGraphs(model, pool, self.num_slots, range(2, block + 1), scratch, self.taps,
                          capture=capture, mempool=mempool)
        self.window_graphs = wg
        self.rollback_graphs = RollbackGraphs(model, pool, wg.records, block, scratch,
                                              capture=capture, mempool=mempool)
        self.spec.capture_graphs(self.num_slots, capture, mempool)
        return (lambda: self.graphs.run([0], [1], [scratch]),
                lambda rows: wg.run([[0] * rows], [1], [scratch]))

    def _warm_up(self, scratch: int) -> None:
        """Run each eager path once on the scratch slot so the first request pays no kernel
        compilation or autotuning: prefill chunks of a few sizes and (with a drafter) a
        recorded verify window and a draft."""
        sizes = sorted({min(n, self.context - 1)
                        for n in (7, 14, 16, 31, 32, 64, 128, self.scheduler.prefill_chunk)})
        for n in sizes:
            self.model.forward_ex(ForwardBatch.build([SeqChunk(scratch, 0, (0,) * n, 1)],
                                                     self.model.device), self.pool, self.taps)
        # A chunk that continues a stream (masked attention from position > 0, as after a
        # snapshot boundary or a cache hit) and a step mixing a decode row with a chunk.
        short = min(16, self.context // 4)
        if short >= 2:
            self.model.forward_ex(ForwardBatch.build([SeqChunk(scratch, short, (0,) * short, 1)],
                                                     self.model.device), self.pool, self.taps)
            if self.num_slots >= 2:
                mixed = [SeqChunk(scratch, 2 * short, (0,), 1), SeqChunk(0, 0, (0,) * short, 1)]
                self.model.forward_ex(ForwardBatch.build(mixed, self.model.device), self.pool,
                                      self.taps)
                # Two chunks in one step: the varlen GDN kernels (one chunk takes another path).
                pair = [SeqChunk(scratch, 0, (0,) * short, 1), SeqChunk(0, 0, (0,) * short, 1)]
                self.model.forward_ex(ForwardBatch.build(pair, self.model.device), self.pool,
                                      self.taps)
        if self.spec is not None and self.spec.block >= 2:
            b = self.spec.block
            chunk = SeqChunk(scratch, 1, (0,) * b, b, record=True)
            out = self.model.forward_ex(ForwardBatch.build([chunk], self.model.device),
                                        self.pool, self.taps)
            self.model.rollback(self.pool, scratch, out.records[scratch], 1)
            dpool = self.spec.drafter.new_pool(1, 8)
            self.spec.drafter.add_context(dpool, 0, out.taps, 0)
            self.spec.drafter.propose_logits(dpool, [0], [0], [b], b)
            self.spec.drafter.forwards = 0
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    # -- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            self._apply_commands()
            self._admit()
            try:
                work = self.scheduler.plan()
            except Exception as e:  # a broken invariant: fail what is in flight, keep serving
                log.exception("planning failed; ending every request in flight")
                for live in list(self._live.values()):
                    self._end(live, Failed(f"internal error: {type(e).__name__}: {e}"))
                continue
            if not work:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self._step(work)
            except Exception as e:  # one bad step must not take the engine down
                log.exception("engine step failed")
                for w in work:
                    live = self._live.get(w.seq.id)
                    if live is not None:
                        self._end(live, Failed(f"internal error: {type(e).__name__}: {e}"))
        for live in list(self._live.values()):
            self._end(live, Finish("abort", completion_tokens=live.out.produced))

    def _apply_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for kind, arg in commands:
            if kind == "add":
                req = arg
                assert isinstance(req, EngineRequest)
                try:
                    seq = Seq(req.id, list(req.prompt_ids), req.max_new_tokens,
                              boundaries=self._boundaries(req))
                    out = OutputStream(self.tokenizer, req.params, self.eos_token_ids,
                                       req.max_new_tokens)
                    live = _Live(req, seq, out, make_generator(req.params.seed),
                                 draft=self.drafter is not None and req.draft)
                except Exception as e:  # this request cannot start; the others are unaffected
                    log.exception("request %s could not be queued", req.id)
                    with self._lock:
                        self._active -= 1
                    try:
                        req.sink(Failed(f"internal error: {type(e).__name__}: {e}"))
                    except Exception:
                        log.exception("sink of request %s failed", req.id)
                    continue
                self._live[req.id] = live
                # Admission is bounded in submit(); here the queue always has room.
                self.scheduler.waiting.append(seq)
            elif kind == "abort":
                live = self._live.get(arg)  # type: ignore[arg-type]
                if live is not None:
                    self._end(live, None)
            elif kind == "end_all":
                for live in list(self._live.values()):
                    self._end(live, live.out.finish(str(arg)))

    def _boundaries(self, req: EngineRequest) -> tuple[int, ...]:
        """Where this prompt's prefill must pause for a snapshot (the end is always one)."""
        if not self.cache.enabled:
            return ()
        n = len(req.prompt_ids)
        fixed = range(self.cache_interval, n, self.cache_interval) if self.cache_interval else ()
        return tuple(sorted({p for p in (*req.snapshot_at, *fixed) if 0 < p < n}))

    # -- prompt cache ----------------------------------------------------------------------
    def _admit(self) -> None:
        """Give slots to waiting requests; restore cached prompt state into them; requests whose
        whole prompt was restored get their first token from the cached logits, no forward."""
        exact: list[tuple[_Live, torch.Tensor]] = []
        for seq in self.scheduler.admit():
            live = self._live[seq.id]
            if self.spec is not None:
                self.spec.reset(seq.slot)
            if self.cache.enabled:
                logits = self._restore(live)
                if logits is not None:
                    exact.append((live, logits))
        if exact:
            lives = [lv for lv, _ in exact]
            try:
                # A copy: sampling masks rows in place, and cached logits are immutable.
                logits = torch.stack([lg.to(self.model.device) for _, lg in exact]).clone()
                self._sample_and_deliver(lives, logits)
            except Exception as e:  # only these requests fail; the engine goes on
                log.exception("first token from cached logits failed")
                for live in lives:
                    self._end(live, Failed(f"internal error: {type(e).__name__}: {e}"))

    def _restore(self, live: _Live) -> torch.Tensor | None:
        seq = live.seq
        prompt = seq.prompt
        found = [(e, index) for index in (self.cache, self.host) if index.enabled
                 for e in [_lookup(index, prompt)] if e is not None]
        if not found:
            return None
        entry, cache = max(found, key=lambda f: f[0].length)  # the device tier wins ties
        snap: Snapshot = entry.payload
        try:
            if self.fail_restores:
                self.fail_restores -= 1
                raise RuntimeError("injected restore failure")
            snap.restore(self.pool, seq.slot)
        except Exception:
            # Abandon the restore whole: position 0 makes the forward ignore whatever the slot
            # now holds, and the prompt is prefilled from scratch.
            log.exception("prompt-cache restore failed for %s; prefilling instead", seq.id)
            cache.stats.failed_restores += 1
            gone = cache.discard(entry.tokens)
            if cache is self.cache:
                self._release(gone)
            seq.computed = seq.cached = 0
            return None
        seq.computed = seq.cached = entry.length
        cache.stats.restored_tokens += entry.length
        if live.draft and snap.draft_features is not None:
            live.features = snap.draft_features.clone()
            live.features_start = entry.length - snap.draft_features.shape[0]
        return snap.logits if entry.length == len(prompt) else None

    def _release(self, entry) -> None:
        if entry is not None and self.store is not None:
            self.store.release(entry.payload)

    def _evicted(self, entry) -> None:
        """A snapshot leaves the device tier: kept in the host tier if there is one."""
        if entry is None:
            return
        if self.host.enabled and not self.host.contains(entry.tokens):
            snap = entry.payload.to_host()
            self.host.insert(entry.tokens, snap.nbytes(), snap)
        self._release(entry)

    def _snapshot_bytes(self, length: int, with_logits: bool) -> int:
        logits = self.model.cfg.vocab_size * 4 if with_logits else 0
        return self.pool.fixed_bytes() + self.pool.token_bytes() * length + logits

    def _take_snapshots(self, work: list[Work], logits: torch.Tensor,
                        last_rows: list[int]) -> None:
        """After a forward (and the features bookkeeping): snapshot every sequence that just
        reached one of its boundaries or the end of its prompt (with that row's logits)."""
        for w, row in zip(work, last_rows, strict=True):
            try:
                self._snapshot(w, logits, row)
            except Exception:  # a snapshot not taken is a later cache miss, nobody's failure
                log.exception("snapshot of %s failed; not cached", w.seq.id)

    def _snapshot(self, w: Work, logits: torch.Tensor, row: int) -> None:
        seq = w.seq
        end = w.start + len(w.tokens)
        if end > len(seq.prompt) or w.start >= len(seq.prompt):
            return
        at_end = end == len(seq.prompt) and w.samples and not seq.output
        logit_row = logits[row] if at_end else None
        if not (at_end or end in seq.boundaries):
            return
        key = seq.prompt[:end]
        if self.cache.contains(key) or not self.cache.admits(
                end, self._snapshot_bytes(end, at_end)):
            return
        live = self._live[seq.id]
        feats = None
        if live.features is not None and live.features_start + live.features.shape[0] == end:
            feats = live.features
        assert self.store is not None
        while not self.store.free:  # fixed storage full: the least recently used goes
            self._evicted(self.cache.evict_oldest())
        snap = self.store.take(self.pool, seq.slot, end,
                               logit_row.float() if logit_row is not None else None, feats)
        for gone in self.cache.insert(key, snap.nbytes(), snap):
            self._evicted(gone)
        if not self.cache.contains(key):  # refused (over budget): give the row back
            self.store.release(snap)

    def _propose(self, work: list[Work]) -> dict[int, Draft]:
        """Drafts for the decoding rows of drafting streams, by work index."""
        assert self.spec is not None
        picked, rooms = [], []
        for j, w in enumerate(work):
            live = self._live[w.seq.id]
            if not (live.draft and w.samples and len(w.tokens) == 1 and not w.seq.prefilling):
                continue
            room = min(live.out.max_new_tokens - live.out.produced,
                       self.context - w.start)  # tokens this stream may still emit / hold
            if min(self.spec.block, room) >= 2:
                picked.append(j)
                rooms.append(room)
        # A step that does not draft keeps its features queued for the next one that does.
        if not picked or not self.spec.worth_drafting():
            return {}
        jobs = []
        for j, room in zip(picked, rooms, strict=True):
            w = work[j]
            live = self._live[w.seq.id]
            jobs.append(DraftJob(live.seq.slot, w.tokens[0], w.start, room, live.features,
                                 live.features_start))
            if live.features is not None:  # handed to the drafter's ring now
                live.features_start += live.features.shape[0]
                live.features = live.features[:0]
        return dict(zip(picked, self.spec.propose(jobs), strict=True))

    # At most this many prefill chunks are replayed one by one in a step; more go eager, where
    # they share one batched forward.
    MAX_GRAPH_PREFILLS = 4

    def _graph_plan(self, work: list[Work]) -> tuple[list[int], list[int]] | None:
        """(decode items, prefill-chunk items) when the whole step can replay graphs."""
        g, pg, cg = self.graphs, self.prefill_graphs, self.continuation_graphs
        if g is None:
            return None
        decode = [j for j, w in enumerate(work) if len(w.tokens) == 1 and w.start > 0 and w.samples]
        chunks = [j for j, w in enumerate(work) if len(w.tokens) > 1 and (
            pg.covers(len(w.tokens)) if w.start == 0 and pg is not None else
            cg is not None and w.start > 0 and cg.covers(len(w.tokens)))]
        if (len(decode) + len(chunks) != len(work) or len(chunks) > self.MAX_GRAPH_PREFILLS
                or len(decode) > self.num_slots):
            return None
        return decode, chunks

    def _windows_fit(self, work: list[Work], drafts: dict[int, Draft]) -> bool:
        wg = self.window_graphs
        if wg is None or len(drafts) != len(work) or any(d.parents is not None
                                                          for d in drafts.values()):
            return False
        width = max(len(w.tokens) for w in work)
        # Padded windows write rows up to start + width: they must stay inside the pool.
        return wg.covers(len(work), width) and all(w.start + width <= self.pool.max_tokens
                                                   for w in work)

    def _window_forward(self, work: list[Work]) -> ForwardOutput:
        """Every item a chain window: one replay at the widest window's width (shorter ones
        padded; the padding rows are rolled back like rejected drafts), outputs laid out as the
        eager forward's."""
        width = max(len(w.tokens) for w in work)
        out = self.window_graphs.run([w.tokens + (0,) * (width - len(w.tokens)) for w in work],
                                     [w.start for w in work], [w.seq.slot for w in work])
        rows = torch.cat([torch.arange(j * width, j * width + len(w.tokens))
                          for j, w in enumerate(work)]).to(out.logits.device)
        self._ran_rows = {w.seq.slot: (width, j) for j, w in enumerate(work)}
        return ForwardOutput(out.logits[rows], out.taps[rows] if out.taps is not None else None,
                             out.records)

    def _graph_forward(self, work: list[Work], decode: list[int], chunks: list[int]
                       ) -> ForwardOutput:
        """One step from graph replays, its outputs laid out as the eager forward's would be
        (logit rows and tap rows in work order)."""
        logits: dict[int, torch.Tensor] = {}
        taps: dict[int, torch.Tensor | None] = {}
        for j in chunks:
            w = work[j]
            out = (self.prefill_graphs.run(w.tokens, w.seq.slot) if w.start == 0 else
                   self.continuation_graphs.run(w.tokens, w.start, w.seq.slot))
            # Cloned: another prefill of the same length in this step replays the same graph.
            logits[j] = out.logits.clone() if w.samples else out.logits[:0]
            taps[j] = out.taps.clone() if out.taps is not None else None
        if decode:
            out = self.graphs.run([work[j].tokens[0] for j in decode],
                                  [work[j].start for j in decode],
                                  [work[j].seq.slot for j in decode])
            for r, j in enumerate(decode):
                logits[j] = out.logits[r:r + 1]
                taps[j] = out.taps[r:r + 1] if out.taps is not None else None
        order = range(len(work))
        tapped = [taps[j] for j in order]
        return ForwardOutput(torch.cat([logits[j] for j in order]),
                             torch.cat(tapped) if all(t is not None for t in tapped) else None,
                             {})

    def _step(self, work: list[Work]) -> None:
        self.steps += 1  # counted before any event of this step is delivered
        drafts = self._propose(work) if self.spec is not None else {}
        for j, d in drafts.items():
            w = work[j]
            work[j] = Work(w.seq, w.start, w.tokens + d.tokens, samples=True)
        chunks = [SeqChunk(w.seq.slot, w.start, w.tokens,
                           len(w.tokens) if j in drafts else int(w.samples),
                           record=j in drafts and drafts[j].parents is None,
                           parents=drafts[j].window_parents if j in drafts else None)
                  for j, w in enumerate(work)]
        graphed = self._graph_plan(work) if not drafts else None
        self._ran_rows = {}
        if graphed is not None:
            out = self._graph_forward(work, *graphed)
        elif self._windows_fit(work, drafts):
            out = self._window_forward(work)
        else:
            out = self.model.forward_ex(ForwardBatch.build(chunks, self.model.device), self.pool,
                                        self.taps if any(self._live[w.seq.id].draft for w in work)
                                        else ())
        logits = out.logits
        self.scheduler.step_done([w for j, w in enumerate(work) if j not in drafts])
        # Row bookkeeping: the last logits row of each work item, and its packed rows.
        last_rows, row, begin = [], 0, 0
        spans = []
        for c in chunks:
            row += c.logit_rows
            last_rows.append(row - 1)
            spans.append((begin, begin + len(c.tokens)))
            begin += len(c.tokens)
        for j, w in enumerate(work):  # features of committed prompt/decode rows
            live = self._live[w.seq.id]
            if live.draft and out.taps is not None and j not in drafts:
                b0, b1 = spans[j]
                live.add_features(out.taps[b0:b1], w.start, self.spec.window)
        if self.cache.enabled:
            self._take_snapshots(work, logits, last_rows)
        plain = [j for j, w in enumerate(work) if w.samples and j not in drafts]
        if plain:
            self._sample_and_deliver([self._live[work[j].seq.id] for j in plain],
                                     logits[[last_rows[j] for j in plain]])
        for j, d in drafts.items():
            live = self._live.get(work[j].seq.id)
            if live is not None:
                first = last_rows[j] - len(d.tokens)
                self._per_request(live, self._settle_round, live, work[j], d,
                                  logits[first:last_rows[j] + 1],
                                  out.taps[spans[j][0]:spans[j][1]] if out.taps is not None
                                  else None, out.records[live.seq.slot])

    def _settle_round(self, live: _Live, w: Work, draft: Draft, logits: torch.Tensor,
                      taps: torch.Tensor | None, record) -> None:
        """Accept a verified window: deliver its tokens, set the GDN state to the last accepted
        row (chains replay the kept rows; trees copy the node's state and move its path's KV
        rows into place), and queue the committed rows' features for the drafter."""
        logits[:, self.tokenizer.vocab_size:] = float("-inf")
        if draft.parents is None:
            verdict = verify(logits, list(draft.tokens), live.req.params, live.rng, self.sampler)
            path = list(range(len(verdict.tokens)))
        else:
            verdict, path = verify_tree(logits, draft, live.req.params, live.rng, self.sampler)
        assert self.spec is not None
        self.spec.observe(draft, verdict)
        seq = live.seq
        emitted = []
        for token, lp, top in zip(verdict.tokens, verdict.logprobs, verdict.top_logprobs,
                                  strict=True):
            piece, finish = live.out.add(token, lp, top)
            emitted.append(token)
            if piece is not None and not self._deliver(live, piece):
                return
            if finish is not None:
                self._end(live, finish)
                return
        keep = len(emitted)  # the path's rows (anchor + accepted drafts) are committed
        if draft.parents is not None:
            self.model.commit_tree(self.pool, seq.slot, w.start, record, path)
        elif seq.slot in self._ran_rows:  # a graphed window: roll back from its records
            width, index = self._ran_rows[seq.slot]
            if keep < width:
                self.rollback_graphs.run(seq.slot, index, keep)
        elif keep < len(w.tokens):
            self.model.rollback(self.pool, seq.slot, record, keep)
        seq.output.extend(emitted)
        seq.computed = w.start + keep
        if taps is not None:
            live.add_features(taps[path], w.start, self.spec.window)

    def _sample_and_deliver(self, lives: list[_Live], logits: torch.Tensor) -> None:
        logits[:, self.tokenizer.vocab_size:] = float("-inf")  # embedding-table padding rows
        states = [lv.rng.get_state() if lv.rng is not None else None for lv in lives]
        try:
            results = [self.sampler.sample(logits, [lv.req.params for lv in lives],
                                           [lv.rng for lv in lives])] * len(lives)
            rows = list(range(len(lives)))
        except Exception:
            # One row's parameters broke the batched draw: draw row by row, so the request at
            # fault fails alone. Generators are rewound first, and a row's draw depends only on
            # its own generator, so the others get the tokens they would have got.
            log.exception("batched sampling failed; sampling row by row")
            for live, state in zip(lives, states, strict=True):
                if state is not None:
                    live.rng.set_state(state)
            results, rows = [], []
            for i, live in enumerate(lives):
                try:
                    results.append(self.sampler.sample(logits[i:i + 1], [live.req.params],
                                                       [live.rng]))
                    rows.append(0)
                except Exception as e:  # noqa: BLE001 - this row's request fails, alone
                    results.append(None)
                    rows.append(0)
                    self._fail(live, e)
        for live, result, i in zip(lives, results, rows, strict=True):
            if result is None:
                continue
            self._per_request(live, self._emit_sampled, live, result, i)

    def _emit_sampled(self, live: _Live, result, i: int) -> None:
        token = result.token_ids[i]
        piece, finish = live.out.add(
            token, result.logprobs[i] if result.logprobs else None,
            result.top_logprobs[i] if result.top_logprobs and live.req.params.logprobs
            else None)
        if piece is not None and not self._deliver(live, piece):
            return
        if finish is not None:
            self._end(live, finish)
        else:
            self.scheduler.append_token(live.seq, token)

    def _per_request(self, live: _Live, fn: Callable[..., None], *args) -> None:
        """Run one request's part of a step; a failure there ends that request alone."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - whatever broke, it broke for this request only
            self._fail(live, e)

    def _fail(self, live: _Live, e: Exception) -> None:
        log.error("request %s failed in its part of a step", live.req.id,
                  exc_info=(type(e), e, e.__traceback__))
        self._end(live, Failed(f"internal error: {type(e).__name__}: {e}"))

    def _deliver(self, live: _Live, event: Event) -> bool:
        try:
            live.req.sink(event)
            return True
        except Exception:  # the receiver is gone or broken: end the request quietly
            log.exception("sink of request %s failed; aborting it", live.req.id)
            self._end(live, None)
            return False

    def _end(self, live: _Live, final: Event | None) -> None:
        """Free the slot exactly once and deliver the final event (None: deliver nothing)."""
        if self._live.pop(live.req.id, None) is None:
            return
        self.scheduler.finish(live.seq)
        if isinstance(final, Finish):
            final.cached_tokens = live.seq.cached
        with self._lock:
            self._active -= 1
        if final is not None:
            try:
                live.req.sink(final)
            except Exception:
                log.exception("sink of request %s failed on its final event", live.req.id)


def _lookup(index: PromptCacheIndex, prompt: list[int]):
    """Longest cached prefix; a whole-prompt entry without logits (a boundary snapshot that
    happens to end where this prompt ends) cannot give the first token, so then one shorter."""
    entry = index.lookup(prompt)
    if entry is not None and entry.length == len(prompt) and entry.payload.logits is None:
        index.stats.hits -= 1  # counted again by the second lookup
        entry = index.lookup(prompt, max_length=len(prompt) - 1)
    return entry


def wait_idle(engine: Engine, timeout: float = 10.0) -> bool:
    """Block until no request is active (tests and shutdown)."""
    deadline = time.monotonic() + timeout
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.active == 0
