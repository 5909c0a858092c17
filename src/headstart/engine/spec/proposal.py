"""The drafting side of speculative decoding: the drafter's pool, proposals, and the planner.

Given the decoding streams of a step, :class:`Speculator` writes each stream's pending target
features into the drafter's context ring, runs one drafter forward for all of them, and turns
the proposals into a chain or a tree per stream (the planner decides from measured window costs
and running acceptance). Verifying and committing a window is the engine's part
(:mod:`headstart.engine.speculative` has the acceptance rules).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.drafter import DFlashDrafter
from headstart.engine.speculative import Draft, SpecPlanner, Verdict, build_tree
from headstart.model import Qwen35Model
from headstart.state import StatePool


@dataclass
class DraftJob:
    """One stream's round: anchor at ``start``, at most ``room`` tokens to emit, and the target
    features of its committed rows not yet in the ring (positions ``features_start ..``)."""

    slot: int
    anchor: int
    start: int
    room: int
    features: torch.Tensor | None
    features_start: int


class Speculator:
    def __init__(self, drafter: DFlashDrafter, model: Qwen35Model, num_slots: int, context: int,
                 vocab_size: int, block: int | None = None, window: int = 4096,
                 mode: str = "auto", tree_width: int = 4, tree_budget: int | None = None) -> None:
        assert mode in ("chain", "tree", "auto")
        self.drafter, self.model = drafter, model
        self.context, self.vocab_size = context, vocab_size
        self.taps: tuple[int, ...] = drafter.cfg.target_layer_ids
        self.block = block or drafter.cfg.block_size
        self.window = window
        self.mode = mode
        self.tree_width = tree_width
        self.tree_budget = tree_budget or 2 * max(1, self.block - 1)
        self.spare = num_slots  # a ring slot no stream owns (padding rows of draft graphs)
        self.pool = drafter.new_pool(num_slots + 1, window)
        self.graphs = None  # DraftGraphs, see capture_graphs
        self.planner: SpecPlanner | None = None
        self.stats = {"rounds": 0, "drafted": 0, "accepted": 0, "tree_rounds": 0}

    def measure(self, pool: StatePool, slot: int,
                runners: tuple[Callable[[], object], Callable[[int], object]] | None = None
                ) -> None:
        """Time verify windows (chains of 2..block rows, a tree of the node budget) on an idle
        slot; the planner weighs expected accepted tokens against these costs. ``runners``:
        (one decode step, a chain window of n rows) as the engine will run them (graph
        replays), instead of eager forwards."""
        def timed(fn: Callable[[], object]) -> float:
            best = float("inf")
            for _ in range(3):
                _sync(self.model.device)
                t0 = time.perf_counter()
                fn()
                _sync(self.model.device)
                best = min(best, time.perf_counter() - t0)
            return best

        def eager(chunk: SeqChunk) -> Callable[[], object]:
            batch = ForwardBatch.build([chunk], self.model.device)
            return lambda: self.model.forward_ex(batch, pool, self.taps)

        if self.block < 2:
            return
        if runners is not None:
            step, window = runners
            costs = {1: timed(step)}
            for rows in range(2, self.block + 1):
                costs[rows] = timed(lambda rows=rows: window(rows))
        else:
            costs = {1: timed(eager(SeqChunk(slot, 1, (0,), 1)))}
            for rows in range(2, self.block + 1):
                costs[rows] = timed(eager(SeqChunk(slot, 1, (0,) * rows, rows, record=True)))
        n = self.tree_budget + 1
        tree = timed(eager(SeqChunk(slot, 1, (0,) * n, n, parents=(-1, *range(n - 1)))))
        # One drafter forward over a short context, as a round pays it.
        feats = self.model.forward_ex(ForwardBatch.build([SeqChunk(slot, 0, (0,) * 8, 1)],
                                                         self.model.device), pool, self.taps).taps
        dpool = self.drafter.new_pool(1, 16)
        self.drafter.add_context(dpool, 0, feats, 0)
        before = self.drafter.forwards
        if self.graphs is not None:
            draft = timed(lambda: self.graphs.run([self.spare], [0], [8]))
        else:  # the network's own forward (a subclass may wrap propose_logits)
            draft = timed(lambda: DFlashDrafter.propose_logits(self.drafter, dpool, [0], [0],
                                                               [8], self.block))
        self.drafter.forwards = before  # measuring is not drafting
        self.planner = SpecPlanner(self.block, costs, tree, draft_cost=draft)

    def reset(self, slot: int) -> None:
        self.pool.reset(slot)

    def propose(self, jobs: Sequence[DraftJob]) -> list[Draft]:
        """One drafter forward for all jobs (their features first go into the rings)."""
        for job in jobs:
            if job.features is not None and job.features.shape[0]:
                self.drafter.add_context(self.pool, job.slot, job.features, job.features_start)
        block = max(min(self.block, job.room) for job in jobs)
        args = ([j.slot for j in jobs], [j.anchor for j in jobs], [j.start for j in jobs])
        if self.graphs is not None and self.graphs.covers(len(jobs), block):
            logits = self.graphs.run(*args)
        else:
            logits = self.drafter.propose_logits(self.pool, *args, block)
        logits[..., self.vocab_size:] = float("-inf")
        proposals = logits.argmax(-1).tolist()
        drafts = []
        for k, job in enumerate(jobs):
            b = min(self.block, job.room)
            mode, depth = self.plan(b)
            if mode == "tree":
                budget = min(self.tree_budget, self.context - job.start - 1)
                drafts.append(build_tree(torch.log_softmax(logits[k, :b - 1].float(), -1),
                                         self.tree_width, budget))
            else:
                drafts.append(Draft(tuple(proposals[k][:depth])))
        return drafts

    def capture_graphs(self, max_streams: int, capture: bool, mempool: object | None) -> None:
        """Replay full-block proposals from CUDA graphs from now on."""
        from headstart.engine.cuda_graph import DraftGraphs

        self.graphs = DraftGraphs(self.drafter, self.pool, max_streams, self.spare, self.block,
                                  capture, mempool)

    def worth_drafting(self) -> bool:
        """In "auto" mode, whether this step should draft at all (see SpecPlanner)."""
        return self.mode != "auto" or self.planner is None or self.planner.worth_drafting()

    def plan(self, b: int) -> tuple[str, int]:
        """Chain depth or tree for a stream that may emit up to ``b`` tokens this round."""
        if self.mode == "chain" or self.planner is None:
            return "chain", b - 1
        if self.mode == "tree":
            return "tree", b - 1
        return self.planner.choose(b)

    def observe(self, draft: Draft, verdict: Verdict) -> None:
        s = self.stats
        s["rounds"] += 1
        s["drafted"] += len(draft.tokens)
        s["accepted"] += verdict.accepted
        if draft.parents is None:
            if self.planner is not None:
                self.planner.observe_chain(len(draft.tokens), verdict.accepted)
        else:
            s["tree_rounds"] += 1
            if self.planner is not None:
                self.planner.observe_tree(len(verdict.tokens))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
