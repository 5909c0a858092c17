"""The drafting side of speculative decoding: the drafter's pool, proposals, and the planner.

Given the decoding streams of a step, :class:`Speculator` writes each stream's pending target
features into the drafter's context ring, runs one drafter forward for all of them, and turns
the proposals into a chain or a tree per stream (the planner decides from measured window costs
and running acceptance). It also judges a verified window (:meth:`Speculator.judge`, the rules
in :mod:`headstart.engine.spec.verification`); committing the accepted rows to the target's
state is the model runner's part.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from headstart.batch import SeqChunk
from headstart.engine.config import SpecConfig
from headstart.engine.spec.drafter import DFlashDrafter
from headstart.engine.spec.features import FeatureQueue
from headstart.engine.spec.planner import SpecPlanner
from headstart.engine.spec.verification import Draft, Verdict, build_tree, verify, verify_tree
from headstart.models.contract import CausalLM
from headstart.penalties import TokenHistory
from headstart.sampling import Sampler, SamplingParams

K = TypeVar("K")
STATS = ("rounds", "drafted", "accepted", "tree_rounds")  # the keys of Speculator.stats


@dataclass
class DraftJob:
    """One stream's round: anchor at ``start``, at most ``room`` tokens to emit, and the queue
    of target features of its committed rows not yet in its ring."""

    slot: int
    anchor: int
    start: int
    room: int
    features: FeatureQueue


class Speculator:
    def __init__(
        self,
        drafter: DFlashDrafter,
        model: CausalLM,
        num_slots: int,
        context: int,
        vocab_size: int,
        config: SpecConfig,
    ) -> None:
        assert config.mode in ("chain", "tree", "auto")
        self.drafter, self.model = drafter, model
        self.context, self.vocab_size = context, vocab_size
        self.taps: tuple[int, ...] = drafter.cfg.target_layer_ids
        self.block = config.draft_block or drafter.cfg.block_size
        self.window = config.draft_window
        self.mode = config.mode
        self.tree_width = config.tree_width
        self.tree_budget = config.tree_budget or 2 * max(1, self.block - 1)
        self.spare = num_slots  # a ring slot no stream owns (padding rows of draft graphs)
        self.pool = drafter.new_pool(num_slots + 1, self.window)
        self.graphs = None  # DraftGraphs, see capture_graphs
        self.planner: SpecPlanner | None = None
        self.stats = dict.fromkeys(STATS, 0)

    def warm_up(self, features: torch.Tensor) -> None:
        """Run the drafter once (context from ``features``, one proposal) on a pool of its own,
        so the first round pays no kernel compilation; not counted as drafting."""
        dpool = self.drafter.new_pool(1, 8)
        self.drafter.add_context(dpool, 0, features, 0)
        self.drafter.propose_logits(dpool, [0], [0], [self.block], self.block)
        self.drafter.forwards = 0

    def measure(
        self,
        runnable: Callable[[SeqChunk], Callable[[], object]],
        features: torch.Tensor,
        whole: Callable[[], object] | None = None,
    ) -> None:
        """Time a plain decode step, verify windows (chains of 2..block rows, a tree of the node
        budget) and one drafter forward (context: ``features``, the taps of a short prompt);
        the planner weighs expected accepted tokens against these costs. ``runnable(chunk)``
        runs ``chunk``'s forward as the engine's steps will (a graph replay or an eager
        forward) on an idle slot; ``whole`` runs a whole device round of a full chain on one
        (engine/spec/round.py), when the engine has them."""

        def timed(fn: Callable[[], object]) -> float:
            best = float("inf")
            for _ in range(3):
                _sync(self.model.device)
                t0 = time.perf_counter()
                fn()
                _sync(self.model.device)
                best = min(best, time.perf_counter() - t0)
            return best

        if self.block < 2:
            return
        costs = {1: timed(runnable(SeqChunk(0, 1, (0,), 1)))}
        for rows in range(2, self.block + 1):
            costs[rows] = timed(runnable(SeqChunk(0, 1, (0,) * rows, rows, record=True)))
        n = self.tree_budget + 1
        tree = timed(runnable(SeqChunk(0, 1, (0,) * n, n, parents=(-1, *range(n - 1)))))
        # One drafter forward over a short context, as a round pays it.
        dpool = self.drafter.new_pool(1, 16)
        self.drafter.add_context(dpool, 0, features, 0)
        before = self.drafter.forwards
        if self.graphs is not None:
            draft = timed(lambda: self.graphs.run([self.spare], [0], [8]))
        else:  # the network's own forward (a subclass may wrap propose_logits)
            draft = timed(
                lambda: DFlashDrafter.propose_logits(self.drafter, dpool, [0], [0], [8], self.block)
            )
        round_cost = timed(whole) if whole is not None else None
        self.drafter.forwards = before  # measuring is not drafting
        self.pool.reset(self.spare)  # a timed round wrote context rows there
        self.planner = SpecPlanner(self.block, costs, tree, draft_cost=draft, round_cost=round_cost)

    def reset(self, slot: int) -> None:
        self.pool.reset(slot)

    def drafts(
        self, jobs: Mapping[K, DraftJob], whole: Callable[[], bool] | None = None
    ) -> dict[K, Draft] | None:
        """Drafts, by key, for the jobs whose stream may emit two tokens or more, when this
        step drafts at all (see :meth:`worth_drafting`); a step that does not draft leaves
        every queue of features for the next one that does. ``whole()``: whether the engine can
        run this step as whole device rounds (engine/spec/round.py), asked only when the step
        drafts; then None when every job drafts a chain (as a full block, cut at its room),
        their queued features already in the rings."""
        jobs = {k: job for k, job in jobs.items() if min(self.block, job.room) >= 2}
        if not jobs or not self.worth_drafting():
            return {}
        plans = [self.plan(min(self.block, job.room)) for job in jobs.values()]
        # A whole round drafts a full block and emits at most the stream's room: every chain
        # takes one (rows past a shorter chain cost nothing more in one replay).
        if whole is not None and all(mode == "chain" for mode, _ in plans) and whole():
            for job in jobs.values():
                self._flush(job)
            return None
        return dict(zip(jobs, self.propose(list(jobs.values()), plans), strict=True))

    def whole_again(self, streams: int) -> bool:
        """Whether ``streams`` streams that drafted whole rounds last step (their features in
        the rings) draft them again now: always in "chain" mode; in "auto" as the
        planner says for this step (asked as :meth:`drafts` would)."""
        if self.mode == "chain":
            return True
        if self.mode != "auto" or not self.worth_drafting():
            return False
        return all(self.plan(self.block)[0] == "chain" for _ in range(streams))

    def _flush(self, job: DraftJob) -> None:
        """Hand the job's queued features to its ring."""
        features, start = job.features.take()
        if features is not None and features.shape[0]:
            self.drafter.add_context(self.pool, job.slot, features, start)

    def propose(
        self, jobs: Sequence[DraftJob], plans: Sequence[tuple[str, int]] | None = None
    ) -> list[Draft]:
        """One drafter forward for all jobs (their queued features first go into the rings);
        ``plans``: each job's :meth:`plan` when already asked."""
        for job in jobs:
            self._flush(job)
        block = max(min(self.block, job.room) for job in jobs)
        args = ([j.slot for j in jobs], [j.anchor for j in jobs], [j.start for j in jobs])
        if self.graphs is not None and self.graphs.covers(len(jobs), block):
            logits = self.graphs.run(*args)
        else:
            logits = self.drafter.propose_logits(self.pool, *args, block)
        logits[..., self.vocab_size :] = float("-inf")
        proposals = logits.argmax(-1).tolist()
        drafts = []
        for k, job in enumerate(jobs):
            b = min(self.block, job.room)
            mode, depth = plans[k] if plans is not None else self.plan(b)
            if mode == "tree":
                budget = min(self.tree_budget, self.context - job.start - 1)
                drafts.append(
                    build_tree(
                        torch.log_softmax(logits[k, : b - 1].float(), -1), self.tree_width, budget
                    )
                )
            else:
                drafts.append(Draft(tuple(proposals[k][:depth])))
        return drafts

    def capture_graphs(self, max_streams: int, capture: bool, mempool: object | None) -> None:
        """Replay full-block proposals from CUDA graphs from now on."""
        from headstart.engine.cuda_graph import DraftGraphs

        self.graphs = DraftGraphs(
            self.drafter, self.pool, max_streams, self.spare, self.block, capture, mempool
        )

    def worth_drafting(self) -> bool:
        """In "auto" mode, whether this step should draft at all (see SpecPlanner)."""
        return self.mode != "auto" or self.planner is None or self.planner.worth_drafting()

    def observe_step(self, seconds: float, drafted: bool) -> None:
        """A decode step's wall time (no prompt rows in it), for the planner's costs."""
        if self.planner is not None:
            self.planner.observe_step(seconds, drafted)

    def plan(self, b: int) -> tuple[str, int]:
        """Chain depth or tree for a stream that may emit up to ``b`` tokens this round."""
        if self.mode == "chain" or self.planner is None:
            return "chain", b - 1
        if self.mode == "tree":
            return "tree", b - 1
        return self.planner.choose(b)

    def judge(
        self,
        logits: torch.Tensor,
        draft: Draft,
        params: SamplingParams,
        rng: torch.Generator | None,
        sampler: Sampler,
        history: TokenHistory | None = None,
    ) -> tuple[Verdict, list[int]]:
        """The verdict on a verified window (``logits``: its rows, masked) and the accepted
        path as window rows (0, the anchor, first); counted in :attr:`stats` and the planner.
        ``history``: the request's tokens so far, for its penalties."""
        if draft.parents is None:
            verdict = verify(logits, list(draft.tokens), params, rng, sampler, history)
            path = list(range(len(verdict.tokens)))
        else:
            verdict, path = verify_tree(logits, draft, params, rng, sampler, history)
        self.observe(draft, verdict)
        return verdict, path

    def observe_whole(self, emitted: int, room: int) -> None:
        """A whole device round that emitted ``emitted`` tokens of a stream's ``room``: counted
        as the chain it stands for, of the drafts that room could take."""
        self._count(min(self.block, room) - 1, emitted - 1, None)

    def observe(self, draft: Draft, verdict: Verdict) -> None:
        self._count(len(draft.tokens), verdict.accepted, draft.parents)

    def _count(self, drafted: int, accepted: int, parents: tuple[int, ...] | None) -> None:
        s = self.stats
        s["rounds"] += 1
        s["drafted"] += drafted
        s["accepted"] += accepted
        if parents is None:
            if self.planner is not None:
                self.planner.observe_chain(drafted, accepted)
        else:
            s["tree_rounds"] += 1
            if self.planner is not None:
                self.planner.observe_tree(accepted + 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
