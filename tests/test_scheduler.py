"""Scheduler bookkeeping, without torch or a model."""

from __future__ import annotations

import random

import pytest

from headstart.engine.scheduler import QueueFull, Scheduler, Sequence, Status


def seq(i: int, n: int = 5, new: int = 3) -> Sequence:
    return Sequence(str(i), list(range(n)), new)


def run_step(s: Scheduler, token: int = 7):
    work = s.schedule()
    s.step_done(work)
    for w in work:
        if w.samples:
            s.append_token(w.seq, token)
    return work


def test_prefill_chunks_then_decode_rows():
    s = Scheduler(num_slots=2, max_queue=4, prefill_chunk=4, step_tokens=6)
    a = seq(0, n=10)
    s.add(a)
    w = run_step(s)
    assert [(x.start, len(x.tokens), x.samples) for x in w] == [(0, 4, False)]
    w = run_step(s)
    assert [(x.start, len(x.tokens), x.samples) for x in w] == [(4, 4, False)]
    w = run_step(s)
    assert [(x.start, len(x.tokens), x.samples) for x in w] == [(8, 2, True)]
    w = run_step(s)
    assert [(x.start, x.tokens, x.samples) for x in w] == [(10, (7,), True)]


def test_decode_rows_go_first_and_budget_limits_prefill():
    s = Scheduler(num_slots=3, max_queue=4, prefill_chunk=6, step_tokens=6)
    a, b = seq(0, n=2), seq(1, n=20)
    s.add(a)
    run_step(s)  # a's prompt done; a now decodes
    s.add(b)
    w = run_step(s)
    assert w[0].seq is a and w[0].samples and len(w[0].tokens) == 1
    assert w[1].seq is b and len(w[1].tokens) == 5  # 6 - 1 decode row


def test_slots_released_exactly_once_and_reused():
    s = Scheduler(num_slots=2, max_queue=1)
    a, b, c = seq(0), seq(1), seq(2)
    for x in (a, b, c):
        s.add(x)
    with pytest.raises(QueueFull):
        s.add(seq(3))
    run_step(s)
    assert {a.slot, b.slot} == {0, 1} and c.status is Status.WAITING
    slot = a.slot
    assert s.finish(a) and not s.finish(a)
    assert sorted(s.free_slots) == [slot]
    run_step(s)
    assert c.slot == slot and c.status is Status.RUNNING
    assert s.finish(c) and s.finish(b)
    assert sorted(s.free_slots) == [0, 1] and not s.running


def test_finish_while_waiting():
    s = Scheduler(num_slots=1, max_queue=2)
    a, b = seq(0), seq(1)
    s.add(a)
    s.add(b)
    run_step(s)
    assert s.finish(b) and b not in s.waiting and s.free_slots == []


def test_random_operations_never_leak_slots():
    rng = random.Random(0)
    s = Scheduler(num_slots=4, max_queue=3, prefill_chunk=3, step_tokens=8)
    alive: list[Sequence] = []
    for i in range(2000):
        op = rng.random()
        if op < 0.3:
            try:
                x = seq(i, n=rng.randint(1, 9))
                s.add(x)
                alive.append(x)
            except QueueFull:
                assert s.num_waiting >= 3
        elif op < 0.5 and alive:
            x = alive.pop(rng.randrange(len(alive)))
            assert s.finish(x)
        else:
            run_step(s)
        held = [x.slot for x in s.running]
        assert len(held) == len(set(held))
        assert sorted(held + s.free_slots) == [0, 1, 2, 3]
    for x in alive:
        s.finish(x)
    assert sorted(s.free_slots) == [0, 1, 2, 3] and not s.running and not s.waiting
