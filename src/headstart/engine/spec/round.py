"""A whole greedy speculative round on the device: propose, verify, accept, commit.

The engine's ordinary round reads the proposals back to build the verify window, reads the
window's logits back to judge it, then commits and queues features from the host: each of
those is a wait for the device and a few launches, and on a small model they cost more than
the window itself (BENCHMARKS.md, "The default model's drafter"). For greedy streams with
nothing that depends on what they said (no penalties, no logit bias, no logprobs) the verdict
is a pure function of the logits, so :func:`greedy_round` does the whole round from device
tensors: the drafter's block, the chain window over its argmax, the target's argmax per row,
the accepted length, the rollback of the rest and the accepted rows' features into the
drafter's ring. It has no host values, so ``engine/cuda_graph.py`` captures it
(:class:`~headstart.engine.cuda_graph.RoundGraphs`) and the host reads one small tensor back
per round.

It emits exactly what the host path emits (``engine/spec/verification.py``, ``verify``):
``y_0 .. y_a``, the target's argmax after each accepted draft, cut at the stream's room.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from headstart.batch import ForwardBatch
from headstart.engine.spec.drafter import DFlashDrafter, DrafterPool
from headstart.models.contract import CausalLM
from headstart.sampling import SamplingParams
from headstart.state import StatePool


def device_greedy(params: SamplingParams) -> bool:
    """Whether a request's round can be judged on the device: greedy, and nothing but the
    logits decides its tokens (no penalties, logit bias or logprobs)."""
    return (
        params.greedy and not params.penalized and not params.logit_bias and params.logprobs is None
    )


@torch.no_grad()
def greedy_round(
    model: CausalLM,
    pool: StatePool,
    drafter: DFlashDrafter,
    ring: DrafterPool,
    records: object,
    ids: torch.Tensor,
    slots: torch.Tensor,
    anchors: torch.Tensor,
    starts: torch.Tensor,
    rooms: torch.Tensor,
    block: int,
    vocab: int,
    taps: Sequence[int],
) -> torch.Tensor:
    """One round for ``n`` streams: stream ``j`` (slot ``slots[j]``, in the target's pool and
    the drafter's ring) has its pending token ``anchors[j]`` at position ``starts[j]`` and may
    emit ``rooms[j]`` (>= 1) more tokens. ``ids``: ``[n * block]`` scratch for the windows;
    ``records``: the window graphs' shared rollback records; ``vocab``: ids at or past it are
    never drafted or emitted (the embedding table's padding rows).

    Returns ``[n, block + 1]`` int64: per stream the target's argmax after each window row, then
    how many of them the round emits (``keep``). Afterwards the slot holds the state after its
    first ``keep`` window rows (the anchor and the accepted drafts) and the ring their features.
    """
    n = slots.shape[0]
    proposal = drafter.propose_from(ring, slots, anchors, starts, block)  # [n, B-1, V]
    proposal[..., vocab:] = float("-inf")
    drafts = proposal.argmax(-1)
    window = ids.view(n, block)
    window[:, 0] = anchors
    window[:, 1:] = drafts
    out = model.forward_ex(ForwardBatch.windows_of(ids, slots, starts, block, records), pool, taps)
    logits = out.logits.reshape(n, block, -1)
    logits[..., vocab:] = float("-inf")
    said = logits.argmax(-1)  # [n, B]: what plain decoding says after each row
    accepted = (drafts == said[:, :-1]).long().cumprod(1).sum(1)
    keep = torch.minimum(accepted + 1, rooms)
    model.rollback_windows(pool, slots, records, keep, block)
    drafter.add_context_rows(ring, slots, out.taps.reshape(n, block, -1), starts, keep)
    return torch.cat([said, keep[:, None]], dim=1)
