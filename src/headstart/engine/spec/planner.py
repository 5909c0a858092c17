"""Whether a step should draft, and per round a chain of some depth or a tree.

:class:`SpecPlanner` weighs the expected tokens of each option (from running acceptance estimates)
against measured window costs; :class:`~headstart.engine.spec.proposal.Speculator` asks it.
"""

from __future__ import annotations

import math


class SpecPlanner:
    """Chooses, per round, a chain of some depth or a tree, from measured window costs.

    ``costs[rows]`` is the measured time of a verify window of that many rows (chains) and
    ``tree_cost`` that of a tree window. Acceptance is tracked online: per depth for chains
    (the probability that draft d is accepted given d-1 were) and tokens per round for trees,
    both as moving averages. Each round takes the option with the most expected tokens per
    second; every ``explore``-th round tries the other mode so neither estimate goes stale.

    The measured window and drafter costs leave out what a round pays around them (the
    drafter's context rows, the rollback of rejected rows, reading the proposals and the
    verdict back), which can outweigh them on a small model. So the engine reports the wall
    time of its decode steps (:meth:`observe_step`): plain ones replace the plain step's cost,
    drafting ones give the round's overhead beyond its modelled cost, both as moving averages.
    """

    def __init__(
        self,
        block: int,
        costs: dict[int, float],
        tree_cost: float | None,
        explore: int = 8,
        decay: float = 0.9,
        draft_cost: float = 0.0,
        recheck: int = 32,
        round_cost: float | None = None,
        recheck_budget: float = 0.01,
    ) -> None:
        """``draft_cost``: one drafter forward (paid by every round, chain or tree);
        ``costs[1]``: one plain decode step; ``round_cost``: a whole device round
        (engine/spec/round.py: drafter, window and commit in one replay, always a full block),
        which replaces every chain's window and drafter costs when the engine has such rounds.
        ``recheck``: while drafting does not pay, draft anyway after this many steps so the
        acceptance estimates can recover; the wait doubles after each recheck that changes
        nothing, up to 8x. ``recheck_budget``: and at least as long as keeps a recheck's
        expected loss (its round's cost beyond the plain steps that would emit its expected
        tokens) within this fraction of the plain steps' time between rechecks; on a device
        where drafting is far from paying (a CPU: a round costs several plain steps and
        emits about three tokens) the doubling alone spent about 3% of decode time on
        rechecks. 0: the doubling alone."""
        self.block = block
        self.costs = costs
        self.tree_cost = tree_cost
        self.draft_cost = draft_cost
        self.round_cost = round_cost
        self.recheck = recheck
        self.recheck_budget = recheck_budget
        self.wait = recheck
        self.declined = 0
        self.explore = explore
        self.decay = decay
        self.alpha = [0.5] * block  # alpha[d]: P(draft d+1 accepted | d accepted)
        self.tree_tokens = 1.5
        self.rounds = 0
        self.step_cost = costs.get(1)  # a plain decode step, wall time (observe_step)
        self.overhead = 0.0  # a drafting step's wall time beyond its modelled cost
        self._modelled = 0.0  # the modelled cost of the step being drafted (0: none)

    def expected_chain(self, depth: int) -> float:
        e, p = 1.0, 1.0
        for d in range(depth):
            p *= self.alpha[d]
            e += p
        return e

    def _chain_cost(self, depth: int) -> float | None:
        """A chain round of ``depth`` drafts: its window and the drafter forward, or a whole
        device round, which drafts a full block whatever the depth (None: not measured)."""
        if self.round_cost is not None:
            return self.round_cost
        cost = self.costs.get(depth + 1)
        return cost + self.draft_cost if cost else None

    def _best_chain(self, room: int) -> tuple[int, float]:
        best_depth, best_rate = 1, 0.0
        expected, p = 1.0, 1.0  # expected_chain(depth), kept as depth grows (asked every step)
        for depth in range(1, min(self.block, room)):
            p *= self.alpha[depth - 1]
            expected += p
            cost = self._chain_cost(depth)
            if cost:
                rate = expected / (cost + self.overhead)
                if rate >= best_rate:  # on a tie the deeper chain (whole rounds: same cost)
                    best_depth, best_rate = depth, rate
        return best_depth, best_rate

    def worth_drafting(self) -> bool:
        """Whether a round (drafter forward + verify window) is expected to emit tokens faster
        than plain decode steps. When it is not, the answer is still yes once every
        ``recheck`` calls, so a drafter that starts to fit the text gets noticed. Asked once a
        step, before any :meth:`choose`: a step the engine did not time (one with prompt rows)
        leaves no modelled cost behind for the next."""
        self._modelled = 0.0
        depth, rate = self._best_chain(self.block)
        if self.tree_cost is not None:
            rate = max(rate, self.tree_tokens / self._tree_round())
        step = self.step_cost
        if not step or rate > 1.0 / step:
            self.declined, self.wait = 0, self.recheck
            return True
        self.declined += 1
        if self.declined < self._recheck_wait(step, depth):
            return False
        self.declined, self.wait = 0, min(2 * self.wait, 8 * self.recheck)
        return True

    def _recheck_wait(self, step: float, depth: int) -> int:
        """Declined steps before the next recheck (see ``recheck_budget``), a recheck drafting
        the best chain's ``depth``."""
        if not self.recheck_budget:
            return self.wait
        cost = self._chain_cost(depth)
        if not cost:
            return self.wait
        loss = cost + self.overhead - self.expected_chain(depth) * step
        return max(self.wait, math.ceil(loss / (self.recheck_budget * step)))

    def choose(self, room: int) -> tuple[str, int]:
        """("chain", drafts) or ("tree", depth); room caps tokens this round."""
        self.rounds += 1
        best_depth, best_rate = self._best_chain(room)
        tree = False
        if self.tree_cost is not None and room >= self.block:
            tree = self.tree_tokens / self._tree_round() > best_rate
            if self.explore and self.rounds % self.explore == 0:
                tree = not tree
        if tree:
            cost = self.tree_cost + self.draft_cost
        else:
            cost = self._chain_cost(best_depth) or self.draft_cost
        self._modelled = max(self._modelled, cost)  # the step's slowest stream
        return ("tree", self.block - 1) if tree else ("chain", best_depth)

    def _tree_round(self) -> float:
        assert self.tree_cost is not None
        return self.tree_cost + self.draft_cost + self.overhead

    def observe_step(self, seconds: float, drafted: bool) -> None:
        """The wall time of a decode step (no prompt rows), drafted or plain."""
        keep = self.decay
        if drafted and self._modelled:
            extra = max(0.0, seconds - self._modelled)
            self.overhead = keep * self.overhead + (1 - keep) * extra
        elif not drafted and self.step_cost:
            self.step_cost = keep * self.step_cost + (1 - keep) * seconds
        self._modelled = 0.0

    def observe_chain(self, drafted: int, accepted: int) -> None:
        for d in range(drafted):
            hit = 1.0 if d < accepted else 0.0
            self.alpha[d] = self.decay * self.alpha[d] + (1 - self.decay) * hit
            if d >= accepted:
                break

    def observe_tree(self, emitted: int) -> None:
        self.tree_tokens = self.decay * self.tree_tokens + (1 - self.decay) * emitted
