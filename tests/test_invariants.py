"""Invariants the serving forward must keep (pure-PyTorch path, float32)."""

from __future__ import annotations

import pytest
import tiny
import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.models.qwen35.model import Qwen35Model
from headstart.state import StatePool

TOL = 5e-5  # logits (BLAS sums in another order for another row count)
STATE_TOL = 1e-4  # recurrent states grow with length; fp32 rounding of chunked vs stepped


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Qwen35Model:
    ref = tiny.causal_lm(seed=21, linear_num_value_heads=4, linear_value_head_dim=24)
    return Qwen35Model.load(tiny.save_text_only(ref, tmp_path_factory.mktemp("inv") / "ckpt"))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def slot_state(pool: StatePool, slot: int, length: int) -> list[torch.Tensor]:
    return [
        pool.conv[:, slot],
        pool.recurrent[:, slot],
        pool.keys[:, slot, :, :length],
        pool.values[:, slot, :, :length],
    ]


def assert_states_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x - y).abs().max() <= STATE_TOL


def prefill(model, pool, slot, ids, chunk):
    """Feed ids in pieces of ``chunk``; return the logits of the last row."""
    for begin in range(0, len(ids), chunk):
        piece = ids[begin : begin + chunk]
        logits = model.forward(ForwardBatch.build([SeqChunk(slot, begin, piece)]), pool)
    return logits[0]


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_shot(model, chunk):
    ids = tokens(150, seed=1)
    one = model.new_state_pool(2, 256)
    want = prefill(model, one, 0, ids, len(ids))
    many = model.new_state_pool(2, 256)
    got = prefill(model, many, 1, ids, chunk)
    assert (got - want).abs().max() <= TOL
    assert_states_close(slot_state(many, 1, 150), slot_state(one, 0, 150))


@pytest.mark.slow
def test_stream_batched_with_others_equals_alone(model):
    a, b, c = tokens(30, 2), tokens(12, 3), tokens(40, 4)
    # Alone: each stream prefilled, then three decode steps, in its own pool.
    alone_logits = []
    for ids in (a, b, c):
        pool = model.new_state_pool(1, 128)
        rows = [prefill(model, pool, 0, ids[:-3], 64)]
        for i, t in enumerate(ids[-3:]):
            rows.append(
                model.forward(ForwardBatch.build([SeqChunk(0, len(ids) - 3 + i, (t,))]), pool)[0]
            )
        alone_logits.append(torch.stack(rows))
    # Together: prefills and decode rows of different streams mixed in the same forwards, in
    # slots that held another stream's state before (reuse must not leak it).
    pool = model.new_state_pool(4, 128)
    prefill(model, pool, 3, tokens(50, 9), 64)
    prefill(model, pool, 0, tokens(20, 8), 64)
    rows = {0: [], 1: [], 2: []}
    slots = {0: 3, 1: 0, 2: 2}
    streams = [a, b, c]
    # Step 1: a's whole prefill + b's prefill in one batch.
    out = model.forward(
        ForwardBatch.build([SeqChunk(slots[0], 0, a[:-3]), SeqChunk(slots[1], 0, b[:-3])]), pool
    )
    rows[0].append(out[0])
    rows[1].append(out[1])
    # Step 2: c's prefill (in two pieces over two steps) mixed with decode rows of a and b.
    pre = c[:-3]
    out = model.forward(
        ForwardBatch.build(
            [
                SeqChunk(slots[0], len(a) - 3, (a[-3],)),
                SeqChunk(slots[2], 0, pre[:20], logit_rows=0),
                SeqChunk(slots[1], len(b) - 3, (b[-3],)),
            ]
        ),
        pool,
    )
    rows[0].append(out[0])
    rows[1].append(out[1])
    out = model.forward(
        ForwardBatch.build(
            [
                SeqChunk(slots[2], 20, pre[20:]),
                SeqChunk(slots[1], len(b) - 2, (b[-2],)),
                SeqChunk(slots[0], len(a) - 2, (a[-2],)),
            ]
        ),
        pool,
    )
    rows[2].append(out[0])
    rows[1].append(out[1])
    rows[0].append(out[2])
    for i in range(3):
        n = len(streams[i])
        done = len(rows[i]) - 1  # decode rows already fed
        for t in streams[i][-3 + done :]:
            out = model.forward(ForwardBatch.build([SeqChunk(slots[i], n - 3 + done, (t,))]), pool)
            rows[i].append(out[0])
            done += 1
    for i in range(3):
        assert (torch.stack(rows[i]) - alone_logits[i]).abs().max() <= TOL


@pytest.mark.slow
def test_prefills_of_several_streams_in_one_forward_equal_each_alone(model):
    """Three new prompts (one shorter than the conv tail) and a continued one in one forward,
    beside a decode row: every row's logits and each stream's state as when it runs alone."""
    new = [tokens(17, 11), tokens(2, 12), tokens(33, 13)]
    cont = tokens(40, 14)

    def rows(pool, slot, ids, begin=0):
        chunk = SeqChunk(slot, begin, ids[begin:], logit_rows=len(ids) - begin)
        return model.forward(ForwardBatch.build([chunk]), pool)

    alone = []
    for ids in new:
        pool = model.new_state_pool(1, 64)
        alone.append((rows(pool, 0, ids), slot_state(pool, 0, len(ids))))
    pool = model.new_state_pool(1, 64)
    prefill(model, pool, 0, cont[:25], 64)
    alone.append((rows(pool, 0, cont, 25), slot_state(pool, 0, 40)))
    pool = model.new_state_pool(6, 64)
    prefill(model, pool, 4, cont[:25], 64)
    prefill(model, pool, 5, tokens(9, 15), 64)
    out = model.forward(
        ForwardBatch.build(
            [
                SeqChunk(0, 0, new[0], logit_rows=17),
                SeqChunk(5, 9, (3,)),
                SeqChunk(1, 0, new[1], logit_rows=2),
                SeqChunk(4, 25, cont[25:], logit_rows=15),
                SeqChunk(2, 0, new[2], logit_rows=33),
            ]
        ),
        pool,
    )
    got = {0: out[:17], 1: out[18:20], 4: out[20:35], 2: out[35:]}
    for (want, state), slot, n in zip(alone, (0, 1, 2, 4), (17, 2, 33, 40), strict=True):
        assert (got[slot] - want).abs().max() <= TOL
        assert_states_close(slot_state(pool, slot, n), state)


def test_prefill_plus_steps_equals_longer_prefill(model):
    ids = tokens(60, seed=5)
    stepped = model.new_state_pool(1, 128)
    prefill(model, stepped, 0, ids[:40], 64)
    for i, t in enumerate(ids[40:]):
        last = model.forward(ForwardBatch.build([SeqChunk(0, 40 + i, (t,))]), stepped)[0]
    longer = model.new_state_pool(1, 128)
    want = prefill(model, longer, 0, ids, 64)
    assert (last - want).abs().max() <= TOL
    assert_states_close(slot_state(stepped, 0, 60), slot_state(longer, 0, 60))


def test_logit_rows_select_the_last_rows(model):
    ids = tokens(10, seed=6)
    pool = model.new_state_pool(1, 32)
    all_rows = model.forward(ForwardBatch.build([SeqChunk(0, 0, ids, logit_rows=10)]), pool)
    pool = model.new_state_pool(1, 32)
    last3 = model.forward(ForwardBatch.build([SeqChunk(0, 0, ids, logit_rows=3)]), pool)
    assert (last3 - all_rows[-3:]).abs().max() <= TOL


def test_pool_overflow_is_refused(model):
    pool = model.new_state_pool(1, 8)
    with pytest.raises(ValueError, match="exceed"):
        model.forward(ForwardBatch.build([SeqChunk(0, 0, tokens(9, 1))]), pool)


def test_pool_size_is_known_before_allocating(model):
    from headstart.state import StatePool

    for slots, tokens in ((1, 8), (3, 100)):
        pool = model.new_state_pool(slots, tokens)
        assert (
            StatePool.bytes_for(model.state_groups(), slots, tokens, model.dtype) == pool.nbytes()
        )
