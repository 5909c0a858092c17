"""Drawing one token for each of a step's sampling rows, so that a row at fault fails alone."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from headstart.penalties import TokenHistory
from headstart.sampling import Sampler, SampleResult, SamplingParams

log = logging.getLogger("headstart.engine")

# Row i's draw: the result holding it and its index there, or what the row's draw raised.
Drawn = tuple[SampleResult, int] | Exception


def draw_rows(
    sampler: Sampler,
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[TokenHistory | None],
) -> list[Drawn]:
    """One token per row of ``logits`` (``params[i]``, ``generators[i]``, ``histories[i]``:
    row i's), in one batched draw. When the batched draw raises (one row's parameters broke
    it), every generator is rewound and the rows are drawn one by one: a row's draw depends
    only on its own generator and history, so the rows that do not fail get exactly the tokens
    the batched draw would have given them, and a row that fails has its exception as its
    outcome."""
    states = [g.get_state() if g is not None else None for g in generators]
    try:
        result = sampler.sample(logits, list(params), list(generators), list(histories))
        return [(result, i) for i in range(len(params))]
    except Exception:
        log.exception("batched sampling failed; sampling row by row")
    for g, state in zip(generators, states, strict=True):
        if state is not None:
            g.set_state(state)
    drawn: list[Drawn] = []
    for i, (p, g, h) in enumerate(zip(params, generators, histories, strict=True)):
        try:
            drawn.append((sampler.sample(logits[i : i + 1], [p], [g], [h]), 0))
        except Exception as e:
            drawn.append(e)
    return drawn
