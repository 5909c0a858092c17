"""Whether a step should draft, and per round a chain of some depth or a tree.

:class:`SpecPlanner` weighs the expected tokens of each option (from running acceptance estimates)
against measured window costs; :class:`~headstart.engine.spec.proposal.Speculator` asks it.
"""

from __future__ import annotations


class SpecPlanner:
    """Chooses, per round, a chain of some depth or a tree, from measured window costs.

    ``costs[rows]`` is the measured time of a verify window of that many rows (chains) and
    ``tree_cost`` that of a tree window. Acceptance is tracked online: per depth for chains
    (the probability that draft d is accepted given d-1 were) and tokens per round for trees,
    both as moving averages. Each round takes the option with the most expected tokens per
    second; every ``explore``-th round tries the other mode so neither estimate goes stale.
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
    ) -> None:
        """``draft_cost``: one drafter forward (paid by every round, chain or tree);
        ``costs[1]``: one plain decode step. ``recheck``: while drafting does not pay, draft
        anyway after this many steps so the acceptance estimates can recover; the wait doubles
        after each recheck that changes nothing, up to 8x."""
        self.block = block
        self.costs = costs
        self.tree_cost = tree_cost
        self.draft_cost = draft_cost
        self.recheck = recheck
        self.wait = recheck
        self.declined = 0
        self.explore = explore
        self.decay = decay
        self.alpha = [0.5] * block  # alpha[d]: P(draft d+1 accepted | d accepted)
        self.tree_tokens = 1.5
        self.rounds = 0

    def expected_chain(self, depth: int) -> float:
        e, p = 1.0, 1.0
        for d in range(depth):
            p *= self.alpha[d]
            e += p
        return e

    def _best_chain(self, room: int) -> tuple[int, float]:
        best_depth, best_rate = 1, 0.0
        for depth in range(1, min(self.block, room)):
            cost = self.costs.get(depth + 1)
            if cost:
                rate = self.expected_chain(depth) / (cost + self.draft_cost)
                if rate > best_rate:
                    best_depth, best_rate = depth, rate
        return best_depth, best_rate

    def worth_drafting(self) -> bool:
        """Whether a round (drafter forward + verify window) is expected to emit tokens faster
        than plain decode steps. When it is not, the answer is still yes once every
        ``recheck`` calls, so a drafter that starts to fit the text gets noticed."""
        rate = self._best_chain(self.block)[1]
        if self.tree_cost is not None:
            rate = max(rate, self.tree_tokens / (self.tree_cost + self.draft_cost))
        step = self.costs.get(1)
        if not step or rate > 1.0 / step:
            self.declined, self.wait = 0, self.recheck
            return True
        self.declined += 1
        if self.declined < self.wait:
            return False
        self.declined, self.wait = 0, min(2 * self.wait, 8 * self.recheck)
        return True

    def choose(self, room: int) -> tuple[str, int]:
        """("chain", drafts) or ("tree", depth); room caps tokens this round."""
        self.rounds += 1
        best_depth, best_rate = self._best_chain(room)
        if self.tree_cost is None or room < self.block:
            return "chain", best_depth
        tree_rate = self.tree_tokens / (self.tree_cost + self.draft_cost)
        tree = tree_rate > best_rate
        if self.explore and self.rounds % self.explore == 0:
            tree = not tree
        return ("tree", self.block - 1) if tree else ("chain", best_depth)

    def observe_chain(self, drafted: int, accepted: int) -> None:
        for d in range(drafted):
            hit = 1.0 if d < accepted else 0.0
            self.alpha[d] = self.decay * self.alpha[d] + (1 - self.decay) * hit
            if d >= accepted:
                break

    def observe_tree(self, emitted: int) -> None:
        self.tree_tokens = self.decay * self.tree_tokens + (1 - self.decay) * emitted
