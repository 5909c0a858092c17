"""Plain decode steps launched before the last one's tokens are delivered
(``Engine.decode_ahead``, on by default on CUDA) give every request exactly what steps planned
one by one give it: tokens, text, log-probabilities, how and where it ends, what the prompt
cache keeps of it, and what a broken or aborted stream does to the others. On the CPU the
forward is synchronous, so the tests turn it on themselves; each one checks that steps were
really launched ahead."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_helpers import Collector

from headstart.engine.config import CacheConfig, EngineConfig, SchedulingConfig
from headstart.engine.engine import EngineRequest, Finish, Piece, wait_idle
from headstart.loading import load
from headstart.sampling import SamplingParams


@pytest.fixture(scope="module")
def loaded():
    return load()


def make_engine(engines, loaded, ahead: bool, cache_mib: int = 0):
    config = EngineConfig(
        4,
        256,
        max_queue=16,
        scheduling=SchedulingConfig(16, 48),
        cache=CacheConfig(bytes=cache_mib << 20, interval=0),
    )
    e = engines(loaded.model, loaded.tokenizer, loaded.eos_token_ids, config, start=False)
    e.decode_ahead = ahead
    e.collected_ahead = 0
    real = e._collect_decodes

    def counted(*args, **kwargs):
        e.collected_ahead += 1
        return real(*args, **kwargs)

    e._collect_decodes = counted
    e.start()
    return e


def record(c: Collector) -> list[tuple]:
    """What a client would see of a request: every event's fields."""
    out = []
    for ev in c.events:
        if isinstance(ev, Piece):
            out.append(("piece", ev.token_id, ev.text, ev.logprob, ev.top_logprobs))
        else:
            assert isinstance(ev, Finish), ev
            out.append(("finish", ev.reason, ev.text, ev.completion_tokens, ev.stop_reason))
    return out


def run_all(engine, cases) -> list[list[tuple]]:
    collectors = [Collector() for _ in cases]
    for i, ((ids, params), c) in enumerate(zip(cases, collectors, strict=True)):
        engine.submit(EngineRequest(f"r{i}", ids, params, params.max_tokens, c))
    for c in collectors:
        assert c.done.wait(120)
    assert wait_idle(engine) and engine.stats()["free_slots"] == 4
    return [record(c) for c in collectors]


@pytest.mark.slow
def test_decode_ahead_gives_every_request_what_planned_steps_give(loaded, engines):
    """More requests than slots (some wait, which holds launches back), greedy and seeded
    sampling with penalties and log-probabilities, a stop token met while steps run ahead, a
    stop string, EOS, and length limits that end streams at different steps."""
    enc = loaded.tokenizer.encode
    plain = make_engine(engines, loaded, ahead=False)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    probe = run_all(plain, [(enc("def add(a, b):"), greedy)])[0]
    stop_at = probe[5][1]  # the sixth token of that answer, as a stop token
    cases = [
        (enc("def add(a, b):"), greedy),
        (
            enc("def add(a, b):"),
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_at,)),
        ),
        (enc("import os\n"), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
        (
            enc("for i in range(3):"),
            SamplingParams(
                temperature=0.8,
                top_p=0.9,
                seed=3,
                repetition_penalty=1.2,
                logprobs=2,
                max_tokens=13,
                ignore_eos=True,
            ),
        ),
        (enc("class Point:"), SamplingParams(temperature=0, max_tokens=16)),
        (enc("# sum a list\n"), SamplingParams(temperature=0, max_tokens=10, stop=("\n",))),
        (enc("while True:"), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)),
    ]
    want = run_all(plain, cases)
    assert plain.collected_ahead == 0
    ahead = make_engine(engines, loaded, ahead=True)
    assert run_all(ahead, cases) == want
    assert ahead.collected_ahead > 0  # few: the stop string holds launches back
    assert want[1][-1][:2] == ("finish", "stop") and len(want[1]) == 6  # five pieces, the stop


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["length", "stop"])
def test_decode_ahead_leaves_the_answer_for_the_next_turn(loaded, engines, ending):
    """The end-of-generation snapshot holds exactly the prompt and the answer that went
    through the model, when steps ran ahead up to the answer's end: its length limit, or a
    stop token (which a step launched ahead must not have been fed)."""
    enc = loaded.tokenizer.encode
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    e = make_engine(engines, loaded, ahead=True, cache_mib=64)
    cold = make_engine(engines, loaded, ahead=False)
    ids = enc("def mean(xs):\n")
    fed = -1  # the last token of an answer cut by its length was never fed
    if ending == "stop":
        (probe,) = run_all(cold, [(ids, params)])
        params = replace(params, stop_token_ids=(probe[9][1],), ignore_eos=False)
        fed = 0
    (answer,) = run_all(e, [(ids, params)])
    assert answer[-1][:2] == ("finish", ending) and e.collected_ahead > 2
    tokens = [ev[1] for ev in answer if ev[0] == "piece"]
    # The slot itself, bit for bit, against the same request's on an engine that plans every
    # step: a step fed a token past the answer's end would have moved its recurrent state.
    computed = len(ids) + len(tokens) + fed
    (again,) = run_all(cold, [(ids, params)])
    assert again == answer
    mine, theirs = (x.runner.pool.slot_state(0, computed) for x in (e, cold))
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    turn = ids + tokens[: len(tokens) + fed] + enc("\n# and the median\n")
    c = Collector()
    e.submit(EngineRequest("t2", turn, params, params.max_tokens, c))
    assert c.done.wait(60)
    assert c.finish.cached_tokens == computed
    assert record(c) == run_all(cold, [(turn, params)])[0]


@pytest.mark.slow
def test_a_stream_broken_or_aborted_while_steps_run_ahead_ends_alone(loaded, engines):
    """One stream's sink breaks at its fourth token, another is aborted at its third (from the
    engine thread, while the next step is in flight): the others get what they get alone,
    and every slot comes back."""
    enc = loaded.tokenizer.encode
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [enc("def f(x):"), enc("x = [1, 2"), enc("print("), enc("# todo")]
    plain = make_engine(engines, loaded, ahead=False)
    want = run_all(plain, [(i, params) for i in ids])
    e = make_engine(engines, loaded, ahead=True)
    seen = []

    def breaks(ev):
        seen.append(ev)
        if len(seen) == 4:
            raise RuntimeError("client went away")

    aborted = Collector()

    def aborting(ev):
        aborted(ev)
        if len(aborted.events) == 3:
            e.abort("r2")

    good = [Collector(), Collector()]
    sinks = [breaks, good[0], aborting, good[1]]
    for i, (p, sink) in enumerate(zip(ids, sinks, strict=True)):
        e.submit(EngineRequest(f"r{i}", p, params, params.max_tokens, sink))
    for c in good:
        assert c.done.wait(60)
    assert wait_idle(e) and e.stats()["free_slots"] == 4
    assert [record(c) for c in good] == [want[1], want[3]]
    assert len(seen) == 4 and not aborted.done.is_set()
    assert aborted.tokens == [ev[1] for ev in want[2][: len(aborted.tokens)] if ev[0] == "piece"]
    assert e.collected_ahead > 0
