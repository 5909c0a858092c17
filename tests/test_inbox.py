"""The engine's inbox on its own: validation, the admission bound, command order, waking."""

from __future__ import annotations

import threading
import time

import pytest

from headstart.engine.inbox import Abort, Add, EndAll, Inbox
from headstart.engine.request import EngineRequest
from headstart.engine.scheduler import QueueFull
from headstart.sampling import SamplingParams


def request(rid: str, prompt: int = 3, new: int = 2) -> EngineRequest:
    return EngineRequest(rid, list(range(1, prompt + 1)), SamplingParams(), new, lambda e: None)


def test_submit_refuses_what_cannot_run_before_counting_it():
    inbox = Inbox(num_slots=1, max_queue=1, context=8)
    with pytest.raises(ValueError, match="a prompt and at least one token"):
        inbox.submit(request("empty", prompt=0))
    with pytest.raises(ValueError, match="at least one token"):
        inbox.submit(request("none", new=0))
    with pytest.raises(ValueError, match="exceed the context of 8"):
        inbox.submit(request("long", prompt=6, new=3))
    assert inbox.active == 0 and inbox.drain() == []


def test_admission_is_bounded_by_slots_plus_queue_until_requests_end():
    inbox = Inbox(num_slots=2, max_queue=1, context=64)
    for i in range(3):
        inbox.submit(request(f"r{i}"))
    with pytest.raises(QueueFull, match="all 2 slots are busy and 1 requests are waiting"):
        inbox.submit(request("r3"))
    assert inbox.active == 3
    inbox.ended()  # one ended on the engine thread: room for one more
    inbox.submit(request("r4"))
    assert inbox.active == 3


def test_drain_takes_every_command_once_in_order():
    inbox = Inbox(num_slots=4, max_queue=0, context=64)
    a = request("a")
    inbox.submit(a)
    inbox.abort("a")
    inbox.end_all("shutdown")
    assert inbox.drain() == [Add(a), Abort("a"), EndAll("shutdown")]
    assert inbox.drain() == []


def test_a_command_or_close_wakes_a_waiting_engine_thread():
    inbox = Inbox(num_slots=1, max_queue=0, context=64)
    woke = threading.Event()

    def engine_thread() -> None:
        inbox.wait(timeout=30)
        woke.set()

    for wake in (lambda: inbox.abort("x"), inbox.close):
        woke.clear()
        t = threading.Thread(target=engine_thread)
        t.start()
        time.sleep(0.05)
        wake()
        assert woke.wait(timeout=5)
        t.join()
    assert inbox.closed


def test_concurrent_submits_never_exceed_the_bound():
    inbox = Inbox(num_slots=3, max_queue=2, context=64)
    accepted, refused = [], []

    def client(i: int) -> None:
        try:
            inbox.submit(request(f"r{i}"))
            accepted.append(i)
        except QueueFull:
            refused.append(i)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(accepted) == 5 and len(refused) == 27 and inbox.active == 5
    assert sorted(c.req.id for c in inbox.drain()) == sorted(f"r{i}" for i in accepted)


def test_wait_quiet_waits_for_a_burst_to_end_within_its_bound():
    inbox = Inbox(num_slots=8, max_queue=8, context=64)
    t0 = time.monotonic()
    inbox.wait_quiet(gap=1.0, longest=5.0)  # nothing put: returns at once
    assert time.monotonic() - t0 < 0.5

    def burst():
        for i in range(4):
            inbox.submit(request(f"b{i}"))
            time.sleep(0.05)

    sender = threading.Thread(target=burst)
    sender.start()
    inbox.wait(timeout=5)
    inbox.wait_quiet(gap=0.5, longest=5.0)
    assert len(inbox.drain()) == 4  # the whole burst, though it took ~150 ms to arrive
    sender.join()
    t0 = time.monotonic()
    inbox.submit(request("late"))
    inbox.wait_quiet(gap=10.0, longest=0.2)  # bounded by longest, however long the gap
    assert 0.15 <= time.monotonic() - t0 < 5


def test_wait_quiet_waits_for_requests_still_arriving():
    """A request being parsed (longer than the quiet gap) holds the gathering until it is
    submitted, and a lone request that is not followed by any is not held beyond the gap."""
    inbox = Inbox(num_slots=8, max_queue=8, context=64)
    inbox.submit(request("first"))
    entered, parsed = threading.Event(), threading.Event()

    def slow_parse():
        with inbox.arriving():
            entered.set()
            time.sleep(0.2)  # 400 quiet gaps
        inbox.submit(request("second"))
        parsed.set()

    parser = threading.Thread(target=slow_parse)
    parser.start()
    entered.wait(5)
    t0 = time.monotonic()
    inbox.wait_quiet(gap=0.0005, longest=5.0)
    assert parsed.is_set() and 0.15 <= time.monotonic() - t0 < 5
    assert [c.req.id for c in inbox.drain()] == ["first", "second"]
    parser.join()
    inbox.submit(request("alone"))
    t0 = time.monotonic()
    inbox.wait_quiet(gap=0.0005, longest=5.0)
    assert time.monotonic() - t0 < 0.1
    with inbox.arriving():  # never submitted (a 400): bounded by longest
        t0 = time.monotonic()
        inbox.wait_quiet(gap=0.0005, longest=0.2)
        assert 0.15 <= time.monotonic() - t0 < 5


def test_a_slow_step_is_logged_as_a_warning_with_its_shape(caplog, monkeypatch):
    import headstart.engine.step_log as step_log
    from headstart.engine.scheduler import Sequence, Work

    seq = Sequence("s", [1, 2, 3], 4)
    work = [Work(seq, 0, (1, 2, 3), True)]
    with caplog.at_level("INFO", logger="headstart.engine"):
        step_log.StepClock().log(1, work)  # fast, and DEBUG is off: nothing
        assert not caplog.records
        monkeypatch.setattr(step_log, "SLOW_STEP_S", 0.0)
        clock = step_log.StepClock()
        clock.mark()
        clock.mark()
        clock.log(2, work)
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    assert "step 2:" in record.message and "1 chunks, 0 decode rows, 3 tokens" in record.message
