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

from headstart.sampling import Sampler, SamplingParams


@dataclass
class Verdict:
    tokens: list[int]  # y_0 .. y_a: accepted drafts followed by the target's own token
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


def verify(logits: torch.Tensor, drafts: Sequence[int], params: SamplingParams,
           rng: torch.Generator | None, sampler: Sampler) -> Verdict:
    """``logits``: ``[b, V]`` for the window rows (masked already); ``drafts``: ``d_1..d_{b-1}``."""
    assert logits.shape[0] == len(drafts) + 1
    want_lp = params.logprobs is not None
    if params.greedy:
        result = sampler.sample(logits, [params] * logits.shape[0], [None] * logits.shape[0])
        ys = result.token_ids
        a = 0
        while a < len(drafts) and drafts[a] == ys[a]:
            a += 1
        keep = range(a + 1)
        return Verdict([ys[i] for i in keep],
                       [result.logprobs[i] if want_lp and result.logprobs else None for i in keep],
                       [result.top_logprobs[i] if want_lp and result.top_logprobs else None
                        for i in keep])
    # Sampling: one row at a time, so the request's generator is consumed exactly as far as the
    # round goes (draws for rows after a rejection would change nothing but waste randomness).
    tokens, lps, tops = [], [], []
    for i in range(logits.shape[0]):
        r = sampler.sample(logits[i:i + 1], [params], [rng])
        tokens.append(r.token_ids[0])
        lps.append(r.logprobs[0] if want_lp and r.logprobs else None)
        tops.append(r.top_logprobs[0] if want_lp and r.top_logprobs else None)
        if i == len(drafts) or tokens[-1] != drafts[i]:
            break
    return Verdict(tokens, lps, tops)
