"""Generating one stream: prompt ids in, text pieces out (used by ``headstart run``).

The single-stream loop on top of the batched forward: prefill in chunks, then one decode row per
step. What happens to each sampled token (stops, detokenization) is
:class:`~headstart.engine.output.OutputStream`'s job, shared with the serving engine.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.engine.output import Finish, OutputStream, Piece
from headstart.models.contract import CausalLM
from headstart.penalties import TokenHistory
from headstart.sampling import Sampler, SamplingParams, make_generator
from headstart.tokenizer import Tokenizer

__all__ = ["Finish", "Piece", "generate", "greedy_tokens"]

PREFILL_CHUNK = 512


def generate(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    eos_token_ids: Sequence[int] = (),
    max_context: int | None = None,
) -> Iterator[Piece | Finish]:
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
    sampler, rng = Sampler(), make_generator(params.seed)
    history = (
        TokenHistory(prompt_ids, model.cfg.vocab_size, model.device) if params.penalized else None
    )
    out = OutputStream(tokenizer, params, eos_token_ids, max_tokens)

    for begin in range(0, len(prompt_ids), PREFILL_CHUNK):
        piece = tuple(prompt_ids[begin : begin + PREFILL_CHUNK])
        last = begin + len(piece) == len(prompt_ids)
        logits = model.forward(
            ForwardBatch.build([SeqChunk(0, begin, piece, int(last))], model.device), pool
        )
    position = len(prompt_ids)
    while True:
        # Rows past the tokenizer's vocabulary are padding of the embedding table.
        logits[:, tokenizer.vocab_size :] = float("-inf")
        result = sampler.sample(logits, [params], [rng], [history])
        token = result.token_ids[0]
        if history is not None:
            history.add(token)
        piece, finish = out.add(
            token,
            result.logprobs[0] if result.logprobs else None,
            result.top_logprobs[0] if result.top_logprobs else None,
        )
        if piece is not None:
            yield piece
        if finish is not None:
            yield finish
            return
        logits = model.forward(
            ForwardBatch.build([SeqChunk(0, position, (token,))], model.device), pool
        )
        position += 1


def greedy_tokens(model: CausalLM, prompt_ids: Sequence[int], n: int) -> list[int]:
    """n greedy tokens after the prompt (no stops): a small helper for tests and tools."""
    pool = model.new_state_pool(1, len(prompt_ids) + n)
    logits = model.forward(
        ForwardBatch.build([SeqChunk(0, 0, tuple(prompt_ids))], model.device), pool
    )
    out = []
    for i in range(n):
        out.append(int(torch.argmax(logits[0])))
        if i + 1 < n:
            logits = model.forward(
                ForwardBatch.build([SeqChunk(0, len(prompt_ids) + i, (out[-1],))], model.device),
                pool,
            )
    return out
