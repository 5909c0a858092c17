"""The serving engine on the embedded default model: batching, aborts, bounds."""

from __future__ import annotations

import threading
import time

import pytest
from engine_helpers import Collector

from headstart.engine.config import EngineConfig, GraphConfig, SchedulingConfig
from headstart.engine.engine import (
    EngineRequest,
    Failed,
    Finish,
    Piece,
    QueueFull,
    wait_idle,
)
from headstart.generate import generate
from headstart.loading import load
from headstart.sampling import SamplingParams


@pytest.fixture(scope="module")
def loaded():
    return load()


@pytest.fixture
def engine(loaded, engines):
    return engines(
        loaded.model,
        loaded.tokenizer,
        loaded.eos_token_ids,
        EngineConfig(4, 256, max_queue=32, scheduling=SchedulingConfig(16, 40)),
    )


def test_requests_sent_together_start_in_one_step(loaded, engines):
    """An idle engine woken by a request gathers the ones right behind it (here 10 ms apart,
    within the 50 ms gap): all start, and finish, in one step."""
    engine = engines(
        loaded.model,
        loaded.tokenizer,
        loaded.eos_token_ids,
        EngineConfig(
            4, 256, scheduling=SchedulingConfig(16, 64, gather_gap_s=0.05, gather_max_s=2.0)
        ),
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    collectors = [Collector() for _ in range(4)]
    for i, c in enumerate(collectors):
        engine.submit(EngineRequest(f"g{i}", [5 + i, 6, 7, 8], params, 1, c))
        time.sleep(0.01)
    for c in collectors:
        assert c.done.wait(60) and isinstance(c.events[-1], Finish)
    assert engine.steps == 1


def alone(loaded, ids, params):
    return [
        e.token_id
        for e in generate(loaded.model, loaded.tokenizer, ids, params, loaded.eos_token_ids)
        if isinstance(e, Piece)
    ]


PROMPTS = [
    "def f(x):",
    "import sys\nprint(",
    "class A:\n    pass\n" * 3,
    "x",
    "# a comment",
    "for i in range(10):",
    "while True:",
    "return None" * 5,
]


@pytest.mark.slow
def test_concurrent_requests_equal_alone(loaded, engine):
    """More requests than slots, mixed prompt lengths, greedy and seeded sampling."""
    cases = []
    for i in range(12):
        ids = loaded.tokenizer.encode(PROMPTS[i % len(PROMPTS)] + str(i))
        params = (
            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
            if i % 2
            else SamplingParams(temperature=0.9, top_k=50, seed=i, max_tokens=8, ignore_eos=True)
        )
        cases.append((ids, params, Collector()))
    for i, (ids, params, c) in enumerate(cases):
        engine.submit(EngineRequest(f"r{i}", ids, params, params.max_tokens, c))
    for ids, params, c in cases:
        assert c.done.wait(60)
        assert isinstance(c.events[-1], Finish) and c.events[-1].reason == "length"
        assert c.tokens == alone(loaded, ids, params)
    assert wait_idle(engine) and engine.stats()["free_slots"] == 4


@pytest.mark.slow  # ~15 s on an idle 2-core machine: its busy-wait starves the engine of the GIL
def test_abort_frees_the_slot_and_sends_nothing_more(loaded, engine):
    ids = loaded.tokenizer.encode("def g():")
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    hogs = [Collector() for _ in range(4)]
    for i, c in enumerate(hogs):
        engine.submit(EngineRequest(f"hog{i}", ids, params, 200, c))
    while not all(c.events for c in hogs):
        pass
    for i in range(4):
        engine.abort(f"hog{i}")
    quick = Collector()
    engine.submit(
        EngineRequest("quick", ids, SamplingParams(temperature=0, max_tokens=3), 3, quick)
    )
    assert quick.done.wait(30)
    assert wait_idle(engine)
    assert engine.stats()["free_slots"] == 4
    counts = [len(c.events) for c in hogs]
    assert all(not isinstance(e, Finish) for c in hogs for e in c.events)
    assert [len(c.events) for c in hogs] == counts  # nothing arrives after the abort


def test_queue_bound_and_context_checks(loaded, engine):
    ids = loaded.tokenizer.encode("x")
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    with pytest.raises(ValueError, match="context"):
        engine.submit(EngineRequest("big", ids * 250, params, 100, Collector()))
    accepted = 0
    with pytest.raises(QueueFull):
        for i in range(4 + 32 + 1):
            engine.submit(EngineRequest(f"q{i}", ids, params, 100, Collector()))
            accepted += 1
    assert accepted == 36
    engine.end_all()
    assert wait_idle(engine)


def test_broken_sink_does_not_hurt_others(loaded, engine):
    def bad(ev):
        raise RuntimeError("client went away")

    ids = loaded.tokenizer.encode("def h():")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    good = Collector()
    engine.submit(EngineRequest("bad", ids, params, 6, bad))
    engine.submit(EngineRequest("good", ids, params, 6, good))
    assert good.done.wait(30) and good.tokens == alone(loaded, ids, params)
    assert wait_idle(engine)


def test_a_request_that_cannot_start_fails_alone(loaded, engine, monkeypatch):
    import headstart.engine.engine as eng

    real = eng.OutputStream

    def picky(tokenizer, params, *a, **kw):
        if params.seed == 666:
            raise RuntimeError("boom")
        return real(tokenizer, params, *a, **kw)

    monkeypatch.setattr(eng, "OutputStream", picky)
    ids = loaded.tokenizer.encode("def k():")
    bad, good = Collector(), Collector()
    engine.submit(EngineRequest("bad", ids, SamplingParams(seed=666, max_tokens=4), 4, bad))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.submit(EngineRequest("good", ids, params, 5, good))
    assert bad.done.wait(30) and isinstance(bad.events[-1], Failed)
    assert good.done.wait(30) and good.tokens == alone(loaded, ids, params)
    assert wait_idle(engine) and engine.stats()["free_slots"] == 4


def unstarted_eager_engine(loaded, engines, slots: int):
    """An engine of ``slots`` slots with no graphs, not started: a warm-up's subject."""
    config = EngineConfig(slots, 256, graphs=GraphConfig(enabled=False))
    return engines(loaded.model, loaded.tokenizer, loaded.eos_token_ids, config, start=False)


@pytest.mark.slow
def test_warm_up_paths_run_and_leave_no_trace(loaded, engines):
    """The GPU start-up warm-up (eager paths on a scratch slot) runs on any device, and a
    request afterwards answers exactly as on a fresh engine."""
    e = unstarted_eager_engine(loaded, engines, slots=2)
    e.runner.warm_eager(scratch=1)
    e.start()
    ids = loaded.tokenizer.encode("def warm():")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    c = Collector()
    e.submit(EngineRequest("w", ids, params, 6, c))
    assert c.done.wait(30) and c.tokens == alone(loaded, ids, params)


@pytest.mark.slow
def test_warm_up_runs_decode_rows_beside_a_chunk_at_every_count(loaded, engines, monkeypatch):
    """The warm-up's mixed steps (decode rows beside a new prompt's chunk) run 1, 2, 4, ..
    and every free slot's decode rows, each on its own slot, so a step of many decoding streams
    beside a long prompt compiles nothing on its first use; a request afterwards (on a slot a
    warm-up decode row wrote) answers as on a fresh engine."""
    e = unstarted_eager_engine(loaded, engines, slots=6)
    forward, steps = e.runner._forward, []

    def spy(chunks, *a, **kw):
        steps.append(list(chunks))
        return forward(chunks, *a, **kw)

    monkeypatch.setattr(e.runner, "_forward", spy)
    e.runner.warm_eager(scratch=5)  # no graphs: no extra slot, the last stands in
    mixed = [s for s in steps if len(s) >= 2 and all(len(c.tokens) == 1 for c in s[:-1])]
    counts = sorted(len(s) - 1 for s in mixed if s[-1].start == 0 and len(s[-1].tokens) > 1)
    assert counts == [1, 2, 4, 5]  # the scratch slot and slots 1-4: slot 0 holds the chunk
    for s in mixed:
        slots = [c.slot for c in s]
        assert len(set(slots)) == len(slots) and s[-1].slot == 0
    monkeypatch.undo()
    e.start()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for i, text in enumerate(("def warm():", "x = [1, 2,", "class A:")):
        ids = loaded.tokenizer.encode(text)
        c = Collector()
        e.submit(EngineRequest(f"w{i}", ids, params, 5, c))
        assert c.done.wait(30) and c.tokens == alone(loaded, ids, params)


def test_queued_drafter_features_keep_the_newest_window():
    """Rows queued for the drafter arrive in pieces (a prompt, then one per step); reading them
    gives the newest ``window`` rows and their first position, as one concatenation would."""
    import torch

    from headstart.engine.spec.features import FeatureQueue

    queue = FeatureQueue(window=6)
    assert queue.rows is None
    ref, start = torch.zeros(0, 3), 10
    for n in (4, 1, 1, 3, 1, 7, 1, 1):
        rows = torch.randn(n, 3)
        queue.add(rows, start + ref.shape[0])
        ref = torch.cat([ref, rows])
        drop = max(0, ref.shape[0] - 6)
        ref, start = ref[drop:], start + drop
        assert torch.equal(queue.rows, ref) and queue.start == start
    queue.take()  # handed to the drafter's ring
    queue.add(torch.ones(2, 3), 99)
    assert queue.start == 99 and queue.rows.shape == (2, 3)


def _sharing_a_step(loaded, engine, bad_params, prompt="def k():"):
    """Submit a bad request between a greedy and a seeded neighbour, all at once (they share
    steps); return (bad collector, neighbours' (tokens, expected))."""
    ids = loaded.tokenizer.encode(prompt)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    first, bad, last = Collector(), Collector(), Collector()
    engine.submit(EngineRequest("n1", ids, greedy, 12, first))
    engine.submit(EngineRequest("bad", ids, bad_params, bad_params.max_tokens, bad))
    engine.submit(EngineRequest("n2", ids, seeded, 12, last))
    for c in (first, bad, last):
        assert c.done.wait(60)
    return bad, [(first, alone(loaded, ids, greedy)), (last, alone(loaded, ids, seeded))]


def test_a_row_that_breaks_sampling_fails_alone(loaded, engine):
    """A parameter the sampler cannot take (a validation gap, emulated by writing past the
    frozen dataclass) fails its own request; its neighbours in the same steps finish as alone."""
    bad_params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    object.__setattr__(bad_params, "top_k", 2**63)  # overflows the kernels' int64
    bad, neighbours = _sharing_a_step(loaded, engine, bad_params)
    assert isinstance(bad.finish, Failed) and "internal error" in bad.finish.message
    for c, want in neighbours:
        assert isinstance(c.finish, Finish) and c.finish.reason == "length"
        assert c.tokens == want
    assert wait_idle(engine) and engine.stats()["free_slots"] == 4


def test_a_row_whose_output_breaks_mid_stream_fails_alone(loaded, engine, monkeypatch):
    import headstart.engine.engine as eng

    real_add = eng.OutputStream.add

    def add(self, token, *a, **kw):
        if self.params.seed == 666 and self.produced >= 2:
            raise RuntimeError("detokenizer broke")
        return real_add(self, token, *a, **kw)

    monkeypatch.setattr(eng.OutputStream, "add", add)
    bad_params = SamplingParams(temperature=0, seed=666, max_tokens=12, ignore_eos=True)
    bad, neighbours = _sharing_a_step(loaded, engine, bad_params)
    assert isinstance(bad.finish, Failed) and len(bad.tokens) == 2
    for c, want in neighbours:
        assert c.tokens == want and c.finish.reason == "length"
    assert wait_idle(engine) and engine.stats()["free_slots"] == 4


@pytest.mark.slow
def test_tiny_temperatures_and_huge_top_k_are_taken(loaded, engine):
    """Values the wire allows: a temperature that rounds to 0 in float32 decodes greedily,
    a top_k past the vocabulary keeps every token."""
    ids = loaded.tokenizer.encode("def k():")
    greedy = alone(loaded, ids, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for params in (
        SamplingParams(temperature=1e-46, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=9.55e-201, seed=3, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, top_k=2**63, max_tokens=8, ignore_eos=True),
    ):
        c = Collector()
        engine.submit(EngineRequest("t", ids, params, 8, c))
        assert c.done.wait(60) and isinstance(c.finish, Finish), c.events[-1]
        assert c.tokens == greedy
    huge_k = SamplingParams(temperature=0.8, top_k=2**63, seed=5, max_tokens=8, ignore_eos=True)
    no_k = SamplingParams(temperature=0.8, top_k=0, seed=5, max_tokens=8, ignore_eos=True)
    c = Collector()
    engine.submit(EngineRequest("k", ids, huge_k, 8, c))
    assert c.done.wait(60) and c.tokens == alone(loaded, ids, no_k)


@pytest.mark.slow
def test_decoding_beside_a_long_prefill_equals_decoding_alone(loaded, engines):
    """Three streams decode while a long prompt arrives and is prefilled in budget-sized
    chunks beside their decode rows (every step holds both): each stream's tokens, the long
    prompt's included, are those it gets alone; and the long prompt really was chunked with
    decode rows riding along."""
    budget = 24
    e = engines(
        loaded.model,
        loaded.tokenizer,
        loaded.eos_token_ids,
        EngineConfig(4, 512, scheduling=SchedulingConfig(budget, budget)),
    )
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    short = [loaded.tokenizer.encode(p) for p in PROMPTS[:3]]
    long = loaded.tokenizer.encode("def g(a, b):\n    return a * b + " * 12)
    assert len(long) > 4 * budget
    shapes = []
    real_plan = e.scheduler.plan

    def plan():
        work = real_plan()
        shapes.append(sorted(len(w.tokens) for w in work))
        return work

    e.scheduler.plan = plan
    cs = []
    for i, ids in enumerate(short):
        cs.append(Collector())
        e.submit(EngineRequest(f"s{i}", ids, params, params.max_tokens, cs[-1]))
    deadline = time.monotonic() + 60
    while not all(len(c.tokens) >= 3 for c in cs):  # they are decoding now
        assert not any(c.done.is_set() for c in cs) and time.monotonic() < deadline
        time.sleep(0.001)
    cs.append(Collector())
    e.submit(EngineRequest("long", long, params, params.max_tokens, cs[-1]))
    for c in cs:
        assert c.done.wait(120) and isinstance(c.finish, Finish)
    for ids, c in zip([*short, long], cs, strict=True):
        assert c.tokens == alone(loaded, ids, params)
    mixed = [s for s in shapes if s.count(1) >= 1 and max(s) > 1 and sum(s) == budget]
    assert len(mixed) >= 3, shapes  # full budget steps: a prompt chunk beside decode rows


def test_start_returns_after_the_engine_threads_warm_up(loaded, engines, monkeypatch):
    """``start`` waits for the engine thread's warm-up (its forward and the sampler's draws),
    so that the first request does not."""
    from headstart.engine.runner import ModelRunner

    warm = ModelRunner.warm_engine_thread
    ran = []

    def slow_warm(runner):
        time.sleep(0.3)  # long enough that a start that did not wait returns first
        logits = warm(runner)
        ran.append(threading.current_thread().name)
        return logits

    monkeypatch.setattr(ModelRunner, "warm_engine_thread", slow_warm)
    cfg = EngineConfig(2, 64)
    engines(loaded.model, loaded.tokenizer, loaded.eos_token_ids, cfg)
    assert ran == ["headstart-engine"]
