"""Repetition, frequency and presence penalties: what a request has said already, per token.

The rules are vLLM's (and, for ``repetition_penalty``, HF transformers'
``RepetitionPenaltyLogitsProcessor``), applied to the raw logits before temperature and the
filters, greedy rows included:

- ``repetition_penalty`` ``r`` (1 = off): every token seen in the prompt or the output so far
  has its logit divided by ``r`` when positive, multiplied by ``r`` otherwise;
- ``frequency_penalty`` ``f`` (0 = off): ``f`` times the token's count in the output so far is
  subtracted;
- ``presence_penalty`` ``p`` (0 = off): ``p`` is subtracted from every token the output holds.

A request's :class:`TokenHistory` is owned by whoever decodes it (the engine's ``Live``, the
reference ``generate``) and holds one vocabulary-sized row each for the prompt and the output,
on the logits' device, so a step adds one token with one small kernel and never copies the
history over.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from headstart.sampling import SamplingParams

__all__ = ["TokenHistory", "apply_penalties"]


class TokenHistory:
    """The tokens one request has seen: its prompt's (a mask) and its output's (counts)."""

    def __init__(self, prompt_ids: Sequence[int], vocab: int, device: str | torch.device) -> None:
        self.prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        ids = [t for t in prompt_ids if 0 <= t < vocab]
        if ids:
            self.prompt[torch.tensor(ids, device=device)] = True
        self.output = torch.zeros(vocab, dtype=torch.int32, device=device)

    def add(self, token: int) -> None:
        """Count one generated token."""
        self.output[token] += 1

    def fork(self) -> TokenHistory:
        """A copy to extend without touching this one (a verify round walks drafted rows
        that are counted for real only once they are emitted)."""
        out = TokenHistory.__new__(TokenHistory)
        out.prompt, out.output = self.prompt, self.output.clone()  # the prompt never changes
        return out


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
) -> torch.Tensor:
    """``logits`` ``[B, V]`` (float32) with each row's penalties applied; the input itself
    when no row has both a penalty and a history. Never modifies the input."""
    pairs = enumerate(zip(params, histories, strict=True))
    rows = [i for i, (p, h) in pairs if p.penalized and h is not None]
    if not rows:
        return logits
    device = logits.device
    counts = torch.stack([histories[i].output for i in rows]).to(device, torch.float32)
    said = counts > 0
    seen = said | torch.stack([histories[i].prompt for i in rows]).to(device)

    def per_row(name: str) -> torch.Tensor:
        values = [getattr(params[i], name) for i in rows]
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    index = torch.tensor(rows, device=device)
    sub = logits.index_select(0, index)
    # Any r > 0 is valid (vLLM's rule), but past float32's range r would be 0 or inf, and a
    # zero logit times inf is NaN. Beyond 1e6 either way the rule's effect is whole already.
    r = per_row("repetition_penalty").clamp(1e-6, 1e6)
    sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    sub = sub - per_row("frequency_penalty") * counts - per_row("presence_penalty") * said
    out = logits.clone()
    out[index] = sub
    return out
