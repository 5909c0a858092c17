"""A request as the engine takes it, and what the engine holds for it while it runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from headstart.engine.output import Event, OutputStream
from headstart.engine.scheduler import Sequence as Seq
from headstart.engine.scheduler import Work
from headstart.engine.spec.features import FeatureQueue
from headstart.engine.spec.proposal import DraftJob
from headstart.penalties import TokenHistory
from headstart.sampling import SamplingParams


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
    draft: bool = True  # speculative decoding when the engine has a drafter ("draft": false)


@dataclass
class Live:
    """A request from submission to its final event: its scheduler sequence, its output
    stream, its generator (None: unseeded), when it drafts its queue of features, and when
    its parameters penalise repeats the tokens it has seen (every emitted token is added)."""

    req: EngineRequest
    seq: Seq
    out: OutputStream
    rng: torch.Generator | None
    features: FeatureQueue | None = None  # set when this stream drafts
    history: TokenHistory | None = None  # set when the request has a penalty

    def draft_job(self, w: Work, context: int) -> DraftJob | None:
        """A draft round for this step's work ``w`` when the stream drafts and ``w`` is its
        decoding row; None otherwise."""
        decoding = w.samples and len(w.tokens) == 1 and not w.seq.prefilling
        if self.features is None or not decoding:
            return None
        # Drafts past what the stream may still emit, or hold, would be wasted.
        room = min(self.out.max_new_tokens - self.out.produced, context - w.start)
        return DraftJob(w.seq.slot, w.tokens[0], w.start, room, self.features)

    def features_before(self, end: int) -> torch.Tensor | None:
        """The drafter's features of this stream's rows before ``end`` (None: no drafting)."""
        return self.features.ending_at(end) if self.features is not None else None
