"""Generating one stream: prompt ids in, text pieces out (used by ``headstart run``).

This is the single-stream loop on top of the batched forward: prefill in chunks, then one decode
row per step, sampling, stop tokens and stop strings, incremental detokenization. The serving
engine (continuous batching of many streams) is a separate module; both speak the same forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.model import Qwen35Model
from headstart.sampling import Sampler, SamplingParams, make_generator
from headstart.stops import StopStringMatcher
from headstart.tokenizer import IncrementalDetokenizer, Tokenizer

PREFILL_CHUNK = 512


@dataclass
class Piece:
    """One generated token and the text it completed (possibly empty)."""

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class Finish:
    reason: str  # "stop" (eos, stop token or stop string) or "length"
    text: str = ""  # text held back until the end (partial characters, stop-string prefixes)


def generate(model: Qwen35Model, tokenizer: Tokenizer, prompt_ids: Sequence[int],
             params: SamplingParams, eos_token_ids: Sequence[int] = (),
             max_context: int | None = None) -> Iterator[Piece | Finish]:
    """Yield a :class:`Piece` per generated token, then one :class:`Finish`.

    ``max_tokens`` defaults to the room left in ``max_context`` (default: the model's maximum).
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    context = max_context or model.cfg.max_position_embeddings
    room = context - len(prompt_ids)
    if room < 1:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context is {context}")
    max_tokens = min(params.max_tokens or room, room)
    pool = model.new_state_pool(num_slots=1, max_tokens=len(prompt_ids) + max_tokens)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    sampler, rng = Sampler(), make_generator(params.seed)
    detok = IncrementalDetokenizer(tokenizer)
    matcher = StopStringMatcher(params.stop)

    logits = None
    for begin in range(0, len(prompt_ids), PREFILL_CHUNK):
        piece = tuple(prompt_ids[begin:begin + PREFILL_CHUNK])
        last = begin + len(piece) == len(prompt_ids)
        logits = model.forward(ForwardBatch.build([SeqChunk(0, begin, piece, int(last))]), pool)
    position = len(prompt_ids)
    for produced in range(1, max_tokens + 1):
        assert logits is not None
        # Rows past the tokenizer's vocabulary are padding of the embedding table.
        logits[:, tokenizer.vocab_size:] = float("-inf")
        result = sampler.sample(logits, [params], [rng])
        token = result.token_ids[0]
        if token in stops:
            yield _finish("stop", detok, matcher)
            return
        text, stopped = matcher.push(detok.push(token))
        yield Piece(token, text, result.logprobs[0] if result.logprobs else None,
                    result.top_logprobs[0] if result.top_logprobs else None)
        if stopped:
            yield Finish("stop")
            return
        if produced == max_tokens:
            break
        logits = model.forward(ForwardBatch.build([SeqChunk(0, position, (token,))]), pool)
        position += 1
    yield _finish("length", detok, matcher)


def _finish(reason: str, detok: IncrementalDetokenizer, matcher: StopStringMatcher) -> Finish:
    """Release held-back text; a stop string completed by it turns the reason into "stop"."""
    tail, stopped = matcher.push(detok.flush())
    if stopped:
        return Finish("stop", tail)
    return Finish(reason, tail + matcher.flush())


def greedy_tokens(model: Qwen35Model, prompt_ids: Sequence[int], n: int) -> list[int]:
    """n greedy tokens after the prompt (no stops): a small helper for tests and tools."""
    pool = model.new_state_pool(1, len(prompt_ids) + n)
    logits = model.forward(ForwardBatch.build([SeqChunk(0, 0, tuple(prompt_ids))]), pool)
    out = []
    for i in range(n):
        out.append(int(torch.argmax(logits[0])))
        if i + 1 < n:
            logits = model.forward(
                ForwardBatch.build([SeqChunk(0, len(prompt_ids) + i, (out[-1],))]), pool)
    return out
