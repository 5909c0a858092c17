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
from dataclasses import dataclass

import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.engine.output import Finish, OutputStream, Piece
from headstart.engine.prompt_cache import PromptCacheIndex, Snapshot
from headstart.engine.scheduler import QueueFull, Scheduler, Work
from headstart.engine.scheduler import Sequence as Seq
from headstart.model import Qwen35Model
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


@dataclass
class _Live:
    req: EngineRequest
    seq: Seq
    out: OutputStream
    rng: torch.Generator | None


class Engine:
    def __init__(self, model: Qwen35Model, tokenizer: Tokenizer, eos_token_ids: Sequence[int],
                 num_slots: int, context: int, max_queue: int = 256, prefill_chunk: int = 512,
                 step_tokens: int = 2048, cache_bytes: int = 0, cache_max_tokens: int = 0,
                 cache_interval: int = 1024) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_slots = num_slots
        self.context = context
        self.max_queue = max_queue
        self.pool = model.new_state_pool(num_slots, context)
        self.scheduler = Scheduler(num_slots, max_queue, prefill_chunk, step_tokens)
        self.sampler = Sampler()
        self.cache = PromptCacheIndex(cache_bytes, cache_max_tokens)
        self.cache_interval = cache_interval
        self.fail_restores = 0  # test hook: make the next N restores raise
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
                "cache_budget_bytes": c.budget_bytes, "cache_hits": c.stats.hits,
                "cache_misses": c.stats.misses, "cache_restored_tokens": c.stats.restored_tokens,
                "cache_evictions": c.stats.evictions, "cache_failed_restores":
                c.stats.failed_restores}

    # -- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            self._apply_commands()
            try:
                self._admit()
            except Exception as e:
                log.exception("admission failed")
                for live in [lv for lv in self._live.values() if lv.seq.slot is not None
                             and lv.seq.computed == len(lv.seq.prompt) and not lv.seq.output]:
                    self._end(live, Failed(f"internal error: {type(e).__name__}: {e}"))
            work = self.scheduler.plan()
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
            self.steps += 1
        for live in list(self._live.values()):
            self._end(live, Finish("abort", completion_tokens=live.out.produced))

    def _apply_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for kind, arg in commands:
            if kind == "add":
                req = arg
                assert isinstance(req, EngineRequest)
                seq = Seq(req.id, list(req.prompt_ids), req.max_new_tokens,
                          boundaries=self._boundaries(req))
                out = OutputStream(self.tokenizer, req.params, self.eos_token_ids,
                                   req.max_new_tokens)
                live = _Live(req, seq, out, make_generator(req.params.seed))
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
            if self.cache.enabled:
                logits = self._restore(live)
                if logits is not None:
                    exact.append((live, logits))
        if exact:
            # A copy: sampling masks rows in place, and cached logits are immutable.
            logits = torch.stack([lg for _, lg in exact]).clone()
            self._sample_and_deliver([lv for lv, _ in exact], logits)

    def _restore(self, live: _Live) -> torch.Tensor | None:
        seq, cache = live.seq, self.cache
        prompt = seq.prompt
        entry = cache.lookup(prompt)
        if entry is not None and entry.length == len(prompt) and entry.payload.logits is None:
            cache.stats.hits -= 1  # counted again by the second lookup
            entry = cache.lookup(prompt, max_length=len(prompt) - 1)
        if entry is None:
            return None
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
            cache.discard(entry.tokens)
            seq.computed = seq.cached = 0
            return None
        seq.computed = seq.cached = entry.length
        cache.stats.restored_tokens += entry.length
        return snap.logits if entry.length == len(prompt) else None

    def _snapshot_bytes(self, length: int, with_logits: bool) -> int:
        p = self.pool
        fixed = (p.conv[:, 0].numel() * p.conv.element_size()
                 + p.recurrent[:, 0].numel() * p.recurrent.element_size())
        per_token = 2 * p.keys[:, 0, :, 0].numel() * p.keys.element_size()
        logits = self.model.cfg.vocab_size * 4 if with_logits else 0
        return fixed + per_token * length + logits

    def _take_snapshots(self, work: list[Work], logits: torch.Tensor) -> None:
        """After a forward: snapshot every sequence that just reached one of its boundaries or
        the end of its prompt (with that row's logits)."""
        row = 0
        for w in work:
            seq = w.seq
            end = w.start + len(w.tokens)
            at_end = end == len(seq.prompt) and w.samples and not seq.output
            logit_row = logits[row] if w.samples else None
            row += int(w.samples)
            if not (at_end or end in seq.boundaries) or end > len(seq.prompt):
                continue
            key = seq.prompt[:end]
            if self.cache.contains(key) or not self.cache.admits(
                    end, self._snapshot_bytes(end, at_end)):
                continue
            snap = Snapshot.take(self.pool, seq.slot, end, logit_row.float() if at_end else None)
            self.cache.insert(key, snap.nbytes(), snap)

    def _step(self, work: list[Work]) -> None:
        chunks = [SeqChunk(w.seq.slot, w.start, w.tokens, int(w.samples)) for w in work]
        logits = self.model.forward(ForwardBatch.build(chunks, self.model.device), self.pool)
        self.scheduler.step_done(work)
        if self.cache.enabled:
            self._take_snapshots(work, logits)
        sampled = [w for w in work if w.samples]
        if sampled:
            self._sample_and_deliver([self._live[w.seq.id] for w in sampled], logits)

    def _sample_and_deliver(self, lives: list[_Live], logits: torch.Tensor) -> None:
        logits[:, self.tokenizer.vocab_size:] = float("-inf")  # embedding-table padding rows
        result = self.sampler.sample(logits, [lv.req.params for lv in lives],
                                     [lv.rng for lv in lives])
        for i, live in enumerate(lives):
            token = result.token_ids[i]
            piece, finish = live.out.add(
                token, result.logprobs[i] if result.logprobs else None,
                result.top_logprobs[i] if result.top_logprobs and live.req.params.logprobs
                else None)
            if piece is not None and not self._deliver(live, piece):
                continue
            if finish is not None:
                self._end(live, finish)
            else:
                self.scheduler.append_token(live.seq, token)

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


def wait_idle(engine: Engine, timeout: float = 10.0) -> bool:
    """Block until no request is active (tests and shutdown)."""
    deadline = time.monotonic() + timeout
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.active == 0
