"""From sampled tokens to what a client receives, for one request.

Owns the per-request decisions that follow sampling: stop token ids (and EOS unless
``ignore_eos``), stop strings, the ``max_tokens`` limit, and incremental detokenization that never
splits a character. Shared by the single-stream loop and the serving engine so both end requests
the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from headstart.sampling import SamplingParams
from headstart.stops import StopStringMatcher
from headstart.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class Piece:
    """One generated token and the text it completed (possibly empty)."""

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class Finish:
    reason: str  # "stop" (eos, stop token or stop string), "length", or "abort"
    text: str = ""  # text held back until the end (partial characters, stop-string prefixes)
    completion_tokens: int = 0  # sampled tokens, a final stop token included (as vLLM counts)
    cached_tokens: int = 0  # prompt tokens restored from the prompt cache (set by the engine)
    # What stopped it, as vLLM reports it: the matched stop string, or a stop_token_ids token;
    # None for EOS, length and abort.
    stop_reason: str | int | None = None


@dataclass
class Failed:
    """The final event of a request that failed inside the engine."""

    message: str


Event = Piece | Finish | Failed


class OutputStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        eos_token_ids: Sequence[int],
        max_new_tokens: int,
    ) -> None:
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.stop_ids = set(params.stop_token_ids)
        self.eos_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_ids |= self.eos_ids
        self.detok = IncrementalDetokenizer(tokenizer)
        self.matcher = StopStringMatcher(params.stop)
        self.produced = 0  # sampled tokens, including a final stop token

    def add(
        self,
        token: int,
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
    ) -> tuple[Piece | None, Finish | None]:
        """Take the next sampled token; returns what to deliver and whether the request ends."""
        self.produced += 1
        if token in self.stop_ids:  # the stop token itself is not shown
            end = self.finish("stop")
            if end.stop_reason is None and token not in self.eos_ids:
                end.stop_reason = token
            return None, end
        text, stopped = self.matcher.push(self.detok.push(token))
        piece = Piece(token, text, logprob, top_logprobs)
        if stopped:
            return piece, Finish("stop", "", self.produced, stop_reason=self.matcher.matched_stop)
        if self.produced >= self.max_new_tokens:
            return piece, self.finish("length")
        return piece, None

    def finish(self, reason: str) -> Finish:
        """Release held-back text; a stop string completed by it turns the reason into "stop"."""
        tail, stopped = self.matcher.push(self.detok.flush())
        if stopped:
            return Finish("stop", tail, self.produced, stop_reason=self.matcher.matched_stop)
        return Finish(reason, tail + self.matcher.flush(), self.produced)
