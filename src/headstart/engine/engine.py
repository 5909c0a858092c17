"""The serving engine: one thread that runs the model over every active stream, step after step.

Other threads talk to it through :meth:`Engine.submit`, :meth:`Engine.abort` and
:meth:`Engine.end_all` (thread-safe, non-blocking: they put commands into its
:class:`~headstart.engine.inbox.Inbox`); results flow back through each request's ``sink``
callback, called on the engine thread with a :class:`~headstart.engine.output.Piece` per token
and one final :class:`~headstart.engine.output.Finish` or :class:`Failed`. After the final event
a request gets nothing more; an aborted request gets nothing at all. A failure in one request's
part of a step (sampling, output, a verify round) ends that request alone; a failure of a whole
step fails the requests of that step, and the engine goes on. A step: commands, admission (with
prompt-cache restores), the plan, drafts, one ``ModelRunner`` run, sampling or verification and
delivery per request, then snapshots. When the next step is certain (decode rows of every
stream, nothing arriving, no stream able to end), it is launched before this one's tokens are
delivered, so the device computes while this thread delivers: whole drafting rounds, and on
CUDA plain decode steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace

import torch

from headstart.engine.config import EngineConfig
from headstart.engine.draw import Drawn, draw_rows
from headstart.engine.inbox import Abort, Add, EndAll, Inbox
from headstart.engine.output import Event, Failed, Finish, OutputStream, Piece
from headstart.engine.prompt_cache_tiers import PromptCache
from headstart.engine.request import EngineRequest, Live
from headstart.engine.runner import ModelRunner, Step
from headstart.engine.scheduler import QueueFull, Scheduler, Work
from headstart.engine.scheduler import Sequence as Seq
from headstart.engine.spec.drafter import DFlashDrafter
from headstart.engine.spec.features import FeatureQueue
from headstart.engine.spec.proposal import STATS, DraftJob, Speculator
from headstart.engine.spec.round import device_greedy
from headstart.engine.spec.verification import Draft
from headstart.engine.step_log import StepClock
from headstart.models.contract import CausalLM, ForwardOutput
from headstart.penalties import TokenHistory
from headstart.sampling import Sampler, SampleResult, SamplingParams, make_generator
from headstart.tokenizer import Tokenizer

log = logging.getLogger("headstart.engine")

#: How often an idle engine looks for finished demotions while some are in flight (seconds).
IDLE_POLL_S = 0.002


@dataclass
class _Rounds:
    """Whole device rounds launched: per stream (its request, the anchor's position, the
    tokens it may still emit), and when the step that launched them began."""

    streams: list[tuple[Live, int, int]]
    since: float


@dataclass
class _Decodes:
    """A plain decode step launched ahead: its work (one decoding row per stream, in the
    order of ``lives``), the forward's output (views of graph outputs, valid until the next
    run), and when the read-back before its launch happened."""

    work: list[Work]
    lives: list[Live]
    out: ForwardOutput
    since: float


__all__ = ["Engine", "EngineConfig", "EngineRequest", "Failed", "Finish", "Piece", "QueueFull"]


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        eos_token_ids: Sequence[int],
        config: EngineConfig,
        drafter: DFlashDrafter | None = None,
    ) -> None:
        """Allocates the state pool and the prompt cache's storage, warms up and captures
        graphs (see :class:`EngineConfig`); :meth:`start` starts the thread."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.eos_token_ids = tuple(eos_token_ids)
        # Final events of requests that ended inside the step running now (None: no step runs).
        self._finals: list[tuple[EngineRequest, Event | None]] | None = None
        self.num_slots, self.context = config.num_slots, config.context
        self.max_queue = config.max_queue
        plan = config.scheduling
        self.scheduler = Scheduler(
            self.num_slots, self.max_queue, plan.prefill_chunk, plan.step_tokens
        )
        self._gather = (plan.gather_gap_s, plan.gather_max_s)
        self.sampler = Sampler()
        self.spec: Speculator | None = None
        if drafter is not None:
            self.spec = Speculator(
                drafter, model, self.num_slots, self.context, tokenizer.vocab_size, config.spec
            )
        self.runner = ModelRunner(model, config, self.spec)
        self.cache = PromptCache(
            self.runner.pool, config.cache, model.cfg.vocab_size, self.runner.twins
        )
        self.runner.warm_up()
        self._live: dict[str, Live] = {}  # engine thread only
        # A step launched ahead, not yet collected: whole rounds, or plain decode rows.
        self._ahead: _Rounds | _Decodes | None = None
        # Launch a plain decode step before the last one's tokens are delivered (see
        # _launch_decodes). Only where the forward runs asynchronously: on a CPU it would hold
        # every token back by a whole forward. Tests turn it on to check it there.
        self.decode_ahead = model.device.type == "cuda"
        self._inbox = Inbox(self.num_slots, self.max_queue, self.context)
        self._thread = threading.Thread(target=self._loop, name="headstart-engine", daemon=True)
        self._warmed = threading.Event()  # the engine thread's own warm-up has run
        self.steps = 0

    # -- other threads ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; returns once its warm-up has run, so that the first
        request does not wait for it."""
        self._thread.start()
        self._warmed.wait()

    def stop(self) -> None:
        """End the thread after its current step; requests still in flight finish "abort"."""
        self._inbox.close()
        self._thread.join(timeout=30)
        self.cache.close()

    def submit(self, req: EngineRequest) -> None:
        """Queue a request; raises QueueFull when slots and queue are all taken, ValueError when
        it cannot fit the context."""
        self._inbox.submit(req)

    def arriving(self) -> AbstractContextManager[None]:
        """Around a request's way in, up to its :meth:`submit` (:meth:`Inbox.arriving`)."""
        return self._inbox.arriving()

    def abort(self, request_id: str) -> None:
        """End a request wherever it is and free its slot; it receives no further events."""
        self._inbox.abort(request_id)

    def end_all(self, reason: str = "abort") -> None:
        """Finish every request now with a final event (used when shutting down)."""
        self._inbox.end_all(reason)

    @property
    def active(self) -> int:
        """Requests submitted and not yet ended (queued or running)."""
        return self._inbox.active

    def stats(self) -> dict[str, float]:
        s = self.scheduler
        spec = self.spec.stats if self.spec is not None else dict.fromkeys(STATS, 0)
        return {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "slots": self.num_slots,
            "free_slots": len(s.free_slots),
            "active": self._inbox.active,
            "steps": self.steps,
            **self.cache.stats(),
            **{f"spec_{k}": v for k, v in spec.items()},
        }

    # -- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._warm_sampler(self.runner.warm_engine_thread())
        except Exception:  # a slower first request, never a dead engine
            log.exception("warming up the engine thread failed")
        finally:
            self._warmed.set()
        while not self._inbox.closed:
            if self._ahead is not None:  # a step of rounds launched ahead: collect them first
                self._step_ahead()
                continue
            self._apply_commands()
            self._admit()
            try:
                work = self.scheduler.plan()
            except Exception as e:  # a broken invariant: fail what is in flight, keep serving
                log.exception("planning failed; ending every request in flight")
                self._fail_all(list(self._live.values()), e)
                continue
            if not work:
                # Idle: demotions that finish now are taken in now, polled every 2 ms while
                # any is in flight, rather than by the next request's lookup.
                copying = self.cache.settle()
                self._inbox.wait(timeout=IDLE_POLL_S if copying else 0.5)
                self._inbox.wait_quiet(self._gather[0], self._gather[1])
                continue
            try:
                self._step(work)
            except Exception as e:  # one bad step must not take the engine down
                log.exception("engine step failed")
                self._fail_all([lv for w in work if (lv := self._live.get(w.seq.id))], e)
        if self._ahead is not None:  # settle the slots first (their final snapshots)
            self._step_ahead(launch=False)
        for live in list(self._live.values()):
            self._end(live, Finish("abort", completion_tokens=live.out.produced))

    def _apply_commands(self) -> None:
        for command in self._inbox.drain():
            match command:
                case Add(req):
                    self._add(req)
                case Abort(request_id):
                    live = self._live.get(request_id)
                    if live is not None:
                        self._end(live, None)
                case EndAll(reason):
                    for live in list(self._live.values()):
                        self._end(live, live.out.finish(reason))

    def _add(self, req: EngineRequest) -> None:
        try:
            boundaries = self.cache.boundaries(len(req.prompt_ids), req.snapshot_at)
            seq = Seq(req.id, list(req.prompt_ids), req.max_new_tokens, boundaries=boundaries)
            out = OutputStream(self.tokenizer, req.params, self.eos_token_ids, req.max_new_tokens)
            features = (
                FeatureQueue(self.spec.window) if self.spec is not None and req.draft else None
            )
            history = (
                TokenHistory(req.prompt_ids, self.model.cfg.vocab_size, self.model.device)
                if req.params.penalized
                else None
            )
            live = Live(req, seq, out, make_generator(req.params.seed), features, history)
            # Admission is bounded by the inbox (Inbox.submit); here the queue always has room.
            self.scheduler.add(seq)
        except Exception as e:  # this request cannot start; the others are unaffected
            log.exception("request %s could not be queued", req.id)
            self._inbox.ended()
            _send_final(req, _failed(e))
            return
        self._live[req.id] = live

    def _admit(self) -> None:
        """Give slots to waiting requests; restore cached prompt state into them; requests whose
        whole prompt was restored get their first token from the cached logits, no forward."""
        exact: list[tuple[Live, torch.Tensor]] = []
        for seq in self.scheduler.admit():
            live = self._live[seq.id]
            if self.spec is not None:
                self.spec.reset(seq.slot)
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
                self._fail_all(lives, e)

    def _restore(self, live: Live) -> torch.Tensor | None:
        """Restore the longest cached prefix into the stream's slot; the cached logits when it
        was the whole prompt."""
        seq = live.seq
        match = self.cache.match_prefix(seq.prompt, seq.slot)
        snap = self.cache.restore(match, seq.slot, seq.id) if match is not None else None
        if snap is None:
            return None
        after = self.cache.boundaries(len(seq.prompt), live.req.snapshot_at, snap.length)
        self.scheduler.restored(seq, snap.length, after)
        if live.features is not None and snap.draft_features is not None:
            live.features.load(snap.draft_features, snap.length)
        return snap.logits if snap.length == len(seq.prompt) else None

    # -- a step ------------------------------------------------------------------------------
    def _step(self, work: list[Work]) -> None:
        """One step over ``work``. Requests that end in it get their final event (and stop
        counting as active) only when the step is over, its snapshots taken: whoever sees a
        request finish sees the cache that its prompt left."""
        self._in_step(self._run_step, work)

    def _step_ahead(self, launch: bool = True) -> None:
        """The step launched ahead: collect and deliver it (launching the next one first,
        unless ``launch`` is False or the step could change)."""
        ahead, self._ahead = self._ahead, None
        self.steps += 1
        if isinstance(ahead, _Rounds):
            collect, lives = self._collect_rounds, [lv for lv, _, _ in ahead.streams]
        else:
            collect, lives = self._collect_decodes, ahead.lives
        try:
            self._in_step(collect, ahead, launch)
        except Exception as e:  # as for a failed step: its requests fail, the engine goes on
            log.exception("engine step failed")
            self._fail_all([lv for lv in lives if self._live.get(lv.req.id) is lv], e)

    def _in_step(self, run: Callable[..., None], *args: object) -> None:
        self._finals = []
        try:
            run(*args)
        finally:
            finals, self._finals = self._finals, None
            for req, final in finals:
                self._inbox.ended()
                if final is not None:
                    _send_final(req, final)

    def _run_step(self, work: list[Work]) -> None:
        self.steps += 1  # counted before any event of this step is delivered
        began = time.perf_counter()
        drafts: dict[int, Draft] | None = {}
        if self.spec is not None:  # a draft job for each decoding row of a drafting stream
            jobs = {j: self._live[w.seq.id].draft_job(w, self.context) for j, w in enumerate(work)}
            drafts = self.spec.drafts(
                {j: job for j, job in jobs.items() if job is not None},
                whole=lambda: self._whole_rounds_fit(work, jobs),
            )
            if drafts is None:  # every stream drafts a chain, as whole device rounds
                self._whole_rounds(work, [jobs[j] for j in range(len(work))], began)
                return
        taps = any(self._live[w.seq.id].features is not None for w in work)  # a drafting stream
        step = Step.of(work, drafts, taps=taps)
        clock = StepClock()
        out = self.runner.run(step)
        clock.mark()
        plain = [j for j in range(len(work)) if j not in drafts]  # rows committed as they are
        committed = [work[j] for j in plain]
        self.scheduler.step_done(committed)
        for j in plain:  # features of committed prompt and decode rows
            queue = self._live[work[j].seq.id].features
            if queue is not None and out.taps is not None:
                queue.add(out.taps[step.rows(j)], work[j].start)
        features = {w.seq.id: self._live[w.seq.id].features_before for w in committed}
        last_rows = [step.last_row(j) for j in plain]
        # Which snapshots are due is decided before any output; they are taken once this
        # step's tokens are sent, so a first token never waits for the cache's copies and
        # bookkeeping. The slots still hold exactly those rows: nothing runs on them, and no
        # slot a request freed meanwhile is handed out, before the next step.
        due = self.cache.snapshots_due(committed, last_rows)
        sampling = [j for j in plain if work[j].samples]
        if sampling:
            lives = [self._live[work[j].seq.id] for j in sampling]
            drawn = self._draw_for(lives, out.logits[[step.last_row(j) for j in sampling]])
            if not drafts and not due and not taps and len(sampling) == len(work):
                self._ahead = self._launch_decodes(work, lives, drawn, time.perf_counter())
            self._deliver_drawn(lives, drawn)
        clock.mark()
        self.cache.take_snapshots(due, out.logits, features)
        clock.log(self.steps, work)
        for j, draft in drafts.items():
            live = self._live.get(work[j].seq.id)
            if live is not None:
                taps = out.taps[step.rows(j)] if out.taps is not None else None
                logits = out.logits[step.logit_rows(j)]
                self._per_request(self._settle_round, live, work[j].start, draft, logits, taps)
        if self.spec is not None and all(len(w.tokens) == 1 and w.samples for w in work):
            # A decode step, whole: what a round costs beyond its windows is measured here.
            self.spec.observe_step(time.perf_counter() - began, bool(drafts))

    def _launch_decodes(
        self, work: list[Work], lives: list[Live], drawn: list[Drawn], now: float
    ) -> _Decodes | None:
        """Launch the next plain decode step, fed the tokens just drawn, before they are
        delivered, and return it, when the next step would be exactly that: ``work`` is one
        decoding row of every running stream, nothing waits to be admitted or commanded, and
        no stream can end on these tokens (every draw succeeded, no stop token among them, no
        stop strings, room left for two more). Otherwise None: the next step is planned as
        usual. The device then computes it while this thread delivers the tokens (detokenize,
        stop checks, the sinks) and plans: as :meth:`_launch_next` does for whole rounds."""
        if (
            not self.decode_ahead
            or self._inbox.pending
            or self.scheduler.num_waiting
            or len(work) != self.scheduler.num_running
        ):
            return None
        ahead = []
        for w, live, d in zip(work, lives, drawn, strict=True):
            if isinstance(d, Exception) or live.features is not None:
                return None
            token = d[0].token_ids[d[1]]
            if (
                len(w.tokens) != 1
                or w.start < len(w.seq.prompt)
                or w.start + 1 >= self.context
                or _may_stop_on(live, (token,))
                or live.out.max_new_tokens - live.out.produced < 2
            ):
                return None
            ahead.append(Work(w.seq, w.start + 1, (token,), samples=True))
        return _Decodes(ahead, lives, self.runner.run(Step.of(ahead, {}, taps=False)), now)

    def _collect_decodes(self, decodes: _Decodes, launch: bool = True) -> None:
        """Collect a plain decode step launched ahead: draw its tokens (waiting for the
        device), launch the next one when nothing can change it (``launch``), deliver. The
        rows of streams that ended since its launch (a broken sink) are dropped: their slots
        are handed out only after this, and later work on them runs after it on the device."""
        clock = StepClock()
        self.scheduler.step_done(decodes.work)
        kept = [j for j, lv in enumerate(decodes.lives) if self._live.get(lv.req.id) is lv]
        if not kept:
            return
        lives = [decodes.lives[j] for j in kept]
        work = [decodes.work[j] for j in kept]
        clock.mark()
        drawn = self._draw_for(lives, decodes.out.logits[kept])
        done = time.perf_counter()
        self._ahead = self._launch_decodes(work, lives, drawn, done) if launch else None
        self._deliver_drawn(lives, drawn)
        clock.log(self.steps, work)
        if self.spec is not None:  # launched ahead, a step costs the time between read-backs
            self.spec.observe_step(done - decodes.since, False)

    def _whole_rounds_fit(self, work: list[Work], jobs: dict[int, DraftJob | None]) -> bool:
        """Whether this step can run as whole device rounds (engine/spec/round.py): every row
        a drafting stream's decoding row with room for two tokens or more (a round emits at
        most its room), judged by the argmax of its logits alone, and a round graph that
        holds them."""
        return (
            all(job is not None and job.room >= 2 for job in jobs.values())
            and all(device_greedy(self._live[w.seq.id].req.params) for w in work)
            and self.runner.rounds_fit([w.start for w in work])
        )

    def _whole_rounds(self, work: list[Work], jobs: list[DraftJob], began: float) -> None:
        """One whole device round per stream: the runner commits each slot and ring; here
        the tokens are delivered (and the next rounds launched first, when nothing can
        change the step: see :meth:`_launch_next`)."""
        self.runner.launch_rounds(
            [job.slot for job in jobs],
            [job.anchor for job in jobs],
            [job.start for job in jobs],
            [job.room for job in jobs],
        )
        lives = [self._live[w.seq.id] for w in work]
        self._collect_rounds(
            _Rounds([(lv, job.start, job.room) for lv, job in zip(lives, jobs, strict=True)], began)
        )

    def _collect_rounds(self, rounds: _Rounds, launch: bool = True) -> None:
        """Wait for the launched rounds; launch the next ones (``launch``) when nothing can
        change the step, so the device computes them while this thread delivers; deliver."""
        said = self.runner.collect_rounds()
        done = time.perf_counter()
        self._ahead = self._launch_next(rounds, said, done) if launch else None
        for (live, start, room), tokens in zip(rounds.streams, said, strict=True):
            self.spec.observe_whole(len(tokens), room)
            if self._live.get(live.req.id) is live:  # not ended since the launch
                self._per_request(self._settle_whole, live, start, tokens)
        # Launched ahead, a round costs the time between two read-backs; else its whole step.
        end = done if self._ahead is not None else time.perf_counter()
        self.spec.observe_step(end - rounds.since, True)

    def _launch_next(self, rounds: _Rounds, said: list[list[int]], now: float) -> _Rounds | None:
        """Launch every stream's next whole round before this one's tokens are delivered, and
        return it, when the next step would be exactly that: nothing waits to be admitted or
        commanded, and no stream can end on these tokens (no stop token among them, no stop
        strings, room left for two more). Otherwise None: the next step is planned as usual,
        from a settled state."""
        if self._inbox.pending or self.scheduler.num_waiting:
            return None
        streams = []
        for (live, start, room), tokens in zip(rounds.streams, said, strict=True):
            if (
                self._live.get(live.req.id) is not live
                or _may_stop_on(live, tokens)
                or room - len(tokens) < 2
            ):
                return None
            streams.append((live, start + len(tokens), room - len(tokens)))
        starts = [start for _, start, _ in streams]
        if not self.runner.rounds_fit(starts) or not self.spec.whole_again(len(streams)):
            return None
        self.runner.launch_rounds(
            [live.seq.slot for live, _, _ in streams],
            [tokens[-1] for tokens in said],
            starts,
            [room for _, _, room in streams],
        )
        return _Rounds(streams, now)

    def _settle_whole(self, live: Live, start: int, tokens: list[int]) -> None:
        self.scheduler.accept(live.seq, tokens, start + len(tokens))
        for token in tokens:
            if not self._emit(live, token, None, None):
                return

    def _settle_round(
        self, live: Live, start: int, draft: Draft, logits: torch.Tensor, taps: torch.Tensor | None
    ) -> None:
        """Accept a verified window (``logits``: its rows): deliver its tokens, commit the
        accepted rows to the slot's state and queue their features for the drafter."""
        assert self.spec is not None
        logits[:, self.tokenizer.vocab_size :] = float("-inf")
        verdict, path = self.spec.judge(
            logits, draft, live.req.params, live.rng, self.sampler, live.history
        )
        # The path's rows (anchor + accepted drafts) are committed, the others undone, before
        # any token is delivered: a request that ends on one of them leaves a settled slot.
        self.runner.commit(live.seq.slot, path)
        self.scheduler.accept(live.seq, verdict.tokens, start + len(path))
        if taps is not None and live.features is not None:
            live.features.add(taps[path], start)
        for token, lp, top in zip(
            verdict.tokens, verdict.logprobs, verdict.top_logprobs, strict=True
        ):
            if not self._emit(live, token, lp, top):
                return

    # -- delivery ----------------------------------------------------------------------------
    def _warm_sampler(self, row: torch.Tensor) -> None:
        """Draw from ``row`` (one row of logits) greedily and with every filter, at one row
        and at a full batch: a GPU loads a kernel's code on its first launch, which the first
        burst of requests paid (the warm-up's forwards sample nothing)."""
        every = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, logprobs=2)
        penalized = SamplingParams(
            temperature=0.0,
            repetition_penalty=1.1,
            frequency_penalty=0.1,
            presence_penalty=0.1,
            logit_bias=((0, 1.0),),
        )
        history = TokenHistory((0,), row.shape[-1], row.device)
        history.add(0)
        for n in sorted({1, self.num_slots}):
            kinds = (SamplingParams(temperature=0.0), every, replace(every, seed=0), penalized)
            for params in kinds:
                rngs = [make_generator(params.seed) for _ in range(n)]
                said = [history if params.penalized else None] * n
                self._draw(row.expand(n, -1).clone(), [params] * n, rngs, said)

    def _draw(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        rngs: Sequence[torch.Generator | None],
        histories: Sequence[TokenHistory | None],
    ) -> list[Drawn]:
        logits[:, self.tokenizer.vocab_size :] = float("-inf")  # embedding-table padding rows
        return draw_rows(self.sampler, logits, params, rngs, histories)

    def _sample_and_deliver(self, lives: list[Live], logits: torch.Tensor) -> None:
        self._deliver_drawn(lives, self._draw_for(lives, logits))

    def _draw_for(self, lives: list[Live], logits: torch.Tensor) -> list[Drawn]:
        """One token for each of ``lives`` from its row of ``logits`` (read back to the host)."""
        return self._draw(
            logits,
            [lv.req.params for lv in lives],
            [lv.rng for lv in lives],
            [lv.history for lv in lives],
        )

    def _deliver_drawn(self, lives: list[Live], drawn: list[Drawn]) -> None:
        """Deliver each stream its drawn token; a row whose draw failed fails its request."""
        for live, d in zip(lives, drawn, strict=True):  # failed rows first, as they were drawn
            if isinstance(d, Exception):
                self._fail(live, d)
        for live, d in zip(lives, drawn, strict=True):
            if not isinstance(d, Exception):
                self._per_request(self._emit_sampled, live, *d)

    def _emit_sampled(self, live: Live, result: SampleResult, i: int) -> None:
        token = result.token_ids[i]
        logprob = result.logprobs[i] if result.logprobs else None
        top = result.top_logprobs[i] if result.top_logprobs and live.req.params.logprobs else None
        if self._emit(live, token, logprob, top):
            self.scheduler.append_token(live.seq, token)

    def _emit(
        self, live: Live, token: int, logprob: float | None, top: list[tuple[int, float]] | None
    ) -> bool:
        """Deliver one generated token; False when that ended the request (a stop, the length
        limit, or a broken sink)."""
        if live.history is not None:
            live.history.add(token)
        piece, finish = live.out.add(token, logprob, top)
        if piece is not None and not self._deliver(live, piece):
            return False
        if finish is not None:
            self._end(live, finish)
            return False
        return True

    def _per_request(self, fn: Callable[..., None], live: Live, *args: object) -> None:
        """Run one request's part of a step, ``fn(live, *args)``; a failure there ends that
        request alone."""
        try:
            fn(live, *args)
        except Exception as e:
            self._fail(live, e)

    def _fail(self, live: Live, e: Exception) -> None:
        log.error("request %s failed in its part of a step", live.req.id, exc_info=e)
        self._end(live, _failed(e))

    def _fail_all(self, lives: list[Live], e: Exception) -> None:
        for live in lives:
            self._end(live, _failed(e))

    def _deliver(self, live: Live, event: Event) -> bool:
        try:
            live.req.sink(event)
            return True
        except Exception:  # the receiver is gone or broken: end the request quietly
            log.exception("sink of request %s failed; aborting it", live.req.id)
            self._end(live, None)
            return False

    def _end(self, live: Live, final: Event | None) -> None:
        """Free the slot exactly once and deliver the final event (None: deliver nothing)."""
        if self._live.pop(live.req.id, None) is None:
            return
        if isinstance(final, Finish):  # the slot still holds the answer: snapshot it
            final.cached_tokens = live.seq.cached
            self.cache.take_final(live.seq, live.features_before)
        self.scheduler.finish(live.seq)
        if self._finals is not None:  # inside a step: at its end (see _step)
            self._finals.append((live.req, final))
            return
        self._inbox.ended()
        if final is not None:
            _send_final(live.req, final)


def _may_stop_on(live: Live, tokens: Sequence[int]) -> bool:
    """Whether delivering ``tokens`` could end ``live`` before its length limit: a stop token
    among them, or stop strings to match (a step launched ahead of their delivery must not
    have been fed past the end)."""
    return bool(live.req.params.stop) or any(t in live.out.stop_ids for t in tokens)


def _failed(e: Exception) -> Failed:
    return Failed(f"internal error: {type(e).__name__}: {e}")


def _send_final(req: EngineRequest, final: Event) -> None:
    """Deliver a request's last event; a broken sink is logged, as nothing more goes to it."""
    try:
        req.sink(final)
    except Exception:
        log.exception("sink of request %s failed on its final event", req.id)


def wait_idle(engine: Engine, timeout: float = 10.0) -> bool:
    """Block until no request is active (tests and shutdown)."""
    deadline = time.monotonic() + timeout
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.active == 0
