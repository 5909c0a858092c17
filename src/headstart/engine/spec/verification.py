"""Verifying a drafted block: which drafts the target accepts, and the tokens a round emits.

The target has scored the window ``[anchor, d_1 .. d_{b-1}]``; row ``i``'s distribution is the
target's prediction for the token after row ``i``. Going down the rows, the target picks its own
token ``y_i`` (argmax for greedy requests; a sample from the request's processed distribution
otherwise) and the round continues while ``y_i`` equals the next draft. The round emits
``y_0 .. y_a``: the accepted drafts and the target's own token after them. Every emitted token is
exactly what plain decoding would pick (greedy) or a genuine sample of the target distribution
given the emitted prefix (sampling; "sample and match", lossless: the proposals are the drafter's
argmax, so no draft probabilities enter the rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from headstart.penalties import TokenHistory
from headstart.sampling import Sampler, SamplingParams


@dataclass
class Verdict:
    tokens: list[int]  # y_0 .. y_a: accepted drafts followed by the target's own token
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


def verify(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    rng: torch.Generator | None,
    sampler: Sampler,
    history: TokenHistory | None = None,
) -> Verdict:
    """``logits``: ``[b, V]`` for the window rows (masked already); ``drafts``: ``d_1..d_{b-1}``;
    ``history``: what the request has said before the window, when its penalties need it."""
    assert logits.shape[0] == len(drafts) + 1
    want_lp = params.logprobs is not None
    penalized = params.penalized and history is not None
    if params.greedy and not penalized:
        result = sampler.sample(logits, [params] * logits.shape[0], [None] * logits.shape[0])
        ys = result.token_ids
        a = 0
        while a < len(drafts) and drafts[a] == ys[a]:
            a += 1
        keep = range(a + 1)
        return Verdict(
            [ys[i] for i in keep],
            [result.logprobs[i] if want_lp and result.logprobs else None for i in keep],
            [result.top_logprobs[i] if want_lp and result.top_logprobs else None for i in keep],
        )
    # Sampling: one row at a time, so the request's generator is consumed exactly as far as the
    # round goes (draws for rows after a rejection would change nothing but waste randomness).
    # With penalties, row i is judged as plain decoding would judge it: after y_0 .. y_{i-1}.
    said = history.fork() if penalized else None
    tokens, lps, tops = [], [], []
    for i in range(logits.shape[0]):
        r = sampler.sample(logits[i : i + 1], [params], [None if params.greedy else rng], [said])
        if said is not None:
            said.add(r.token_ids[0])
        tokens.append(r.token_ids[0])
        lps.append(r.logprobs[0] if want_lp and r.logprobs else None)
        tops.append(r.top_logprobs[0] if want_lp and r.top_logprobs else None)
        if i == len(drafts) or tokens[-1] != drafts[i]:
            break
    return Verdict(tokens, lps, tops)


@dataclass(frozen=True)
class Draft:
    """A round's proposal: a chain (``parents`` None) or a tree of tokens after the anchor.

    ``tokens[i]`` is window row ``i + 1``; for a tree, ``parents[i]`` is the window row of its
    parent (0 = the anchor), always an earlier row."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...] | None = None

    @property
    def window_parents(self) -> tuple[int, ...] | None:
        return None if self.parents is None else (-1, *self.parents)


def build_tree(logprobs: torch.Tensor, width: int, budget: int) -> Draft:
    """A token tree from one drafter forward (DDTree, "greedy spine first").

    ``logprobs``: ``[D, V]`` per-depth log-probabilities. The greedy chain comes first (so the
    tree never accepts less than the chain would); the rest of the ``budget`` nodes go best-first
    by path score (sum of log-probs along the path) among each node's next-ranked child.
    """
    import heapq

    D = logprobs.shape[0]
    width = max(1, min(width, logprobs.shape[1]))
    top_lp, top_id = (t.tolist() for t in logprobs.float().topk(width, dim=-1))
    tokens: list[int] = []
    parents: list[int] = []
    depth = [0]  # by window row; row 0 is the anchor
    score = [0.0]
    heap: list[tuple[float, int, int]] = []  # (-score, parent row, rank)

    def add(parent: int, rank: int) -> int:
        d = depth[parent]
        tokens.append(top_id[d][rank])
        parents.append(parent)
        depth.append(d + 1)
        score.append(score[parent] + top_lp[d][rank])
        return len(depth) - 1

    row = 0
    for d in range(min(D, budget)):  # the greedy spine
        child = add(row, 0)
        if width > 1:
            heapq.heappush(heap, (-(score[row] + top_lp[d][1]), row, 1))
        row = child
    while len(tokens) < budget and heap:
        _, parent, rank = heapq.heappop(heap)
        child = add(parent, rank)
        d = depth[parent]
        if rank + 1 < width:
            heapq.heappush(heap, (-(score[parent] + top_lp[d][rank + 1]), parent, rank + 1))
        if depth[child] < D:
            heapq.heappush(heap, (-(score[child] + top_lp[depth[child]][0]), child, 0))
    return Draft(tuple(tokens), tuple(parents))


def verify_tree(
    logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    rng: torch.Generator | None,
    sampler: Sampler,
    history: TokenHistory | None = None,
) -> tuple[Verdict, list[int]]:
    """Walk the tree from the anchor: at each row the target picks its token (argmax, or a
    sample of its distribution, penalised by ``history`` and the walk so far); the walk moves
    to the child holding that token, else stops. Returns the verdict and the accepted path as
    window rows (starting with 0)."""
    assert draft.parents is not None
    children: dict[int, dict[int, int]] = {}
    for i, (tok, parent) in enumerate(zip(draft.tokens, draft.parents, strict=True)):
        children.setdefault(parent, {}).setdefault(tok, i + 1)
    want_lp = params.logprobs is not None
    said = history.fork() if params.penalized and history is not None else None
    path, tokens, lps, tops = [0], [], [], []
    while True:
        row = path[-1]
        r = sampler.sample(
            logits[row : row + 1], [params], [None if params.greedy else rng], [said]
        )
        tok = r.token_ids[0]
        if said is not None:
            said.add(tok)
        tokens.append(tok)
        lps.append(r.logprobs[0] if want_lp and r.logprobs else None)
        tops.append(r.top_logprobs[0] if want_lp and r.top_logprobs else None)
        nxt = children.get(row, {}).get(tok)
        if nxt is None:
            return Verdict(tokens, lps, tops), path
        path.append(nxt)
