"""The CUDA-graph paths' bookkeeping, on any device: static buffers, scratch-slot padding and
state copies, outputs laid out as the eager forward's. ``capture=False`` runs the very forwards
the graphs would capture, eagerly; the capture itself is checked on the GPU
(tests/test_gpu_model.py)."""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import replace

import pytest
import tiny
import torch
from engine_helpers import Collector, PartOracle

from headstart.batch import ForwardBatch, SeqChunk
from headstart.engine.config import (
    CacheConfig,
    EngineConfig,
    GraphConfig,
    SchedulingConfig,
    SpecConfig,
)
from headstart.engine.cuda_graph import PromptGraphs
from headstart.engine.engine import EngineRequest, Finish, wait_idle
from headstart.engine.runner import chunk_of
from headstart.engine.spec.drafter import DFlashDrafter
from headstart.sampling import SamplingParams


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny.target_with_drafter(tmp_path_factory.mktemp("graphs"), seed=43, block=5)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.small_tokenizer()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_prompt_graphs_leave_each_slot_as_its_prompt_alone(target):
    """New prompts padded into one replay (1, 3 and 4 streams; lengths 1 to 24; slots that
    held NaN and other streams' state) against each prompt prefilled alone, eagerly: logits,
    taps and each slot's whole state; the slots of no prompt keep what they held."""
    gen = torch.Generator().manual_seed(0)
    graph_pool = target.new_state_pool(6, 64)
    eager_pool = target.new_state_pool(6, 64)
    for pool in (graph_pool, eager_pool):  # whatever the slots held before
        pool.recurrent.normal_(generator=gen)
        pool.conv.fill_(float("nan"))
        pool.keys.fill_(float("nan"))
    eager_pool.recurrent.copy_(graph_pool.recurrent)
    graphs = PromptGraphs(target, graph_pool, 4, 24, 64, scratch_slot=5, taps=(0, 2), capture=False)
    assert graphs.widths == [16, 24] and graphs.shape_for([24, 24, 3]) is None  # 4 x 24 > 64
    assert graphs.shape_for([1, 16]) == (2, 16) and graphs.groups([24, 3, 9, 24]) == [
        [0, 3],
        [2, 1],
    ]
    before = graph_pool.recurrent[:, 4].clone()
    for lengths, slots in (((24,), (1,)), ((7, 1, 16), (0, 2, 3)), ((2, 9, 5, 13), (3, 1, 0, 2))):
        prompts = [torch.randint(5, 150, (n,), generator=gen).tolist() for n in lengths]
        out = graphs.run(prompts, slots)
        row = 0
        for r, (tokens, slot) in enumerate(zip(prompts, slots, strict=True)):
            ref = target.forward_ex(
                ForwardBatch.build([SeqChunk(slot, 0, tokens, 1)]), eager_pool, (0, 2)
            )
            n = len(tokens)
            assert close(out.logits[r : r + 1], ref.logits)
            assert close(out.taps[row : row + n], ref.taps)
            row += n
            for name in ("conv", "recurrent"):
                got, want = getattr(graph_pool, name)[:, slot], getattr(eager_pool, name)[:, slot]
                assert close(got, want), name
            for name in ("keys", "values"):
                got, want = getattr(graph_pool, name), getattr(eager_pool, name)
                assert close(got[:, slot, :, :n], want[:, slot, :, :n]), name
        assert row == out.taps.shape[0]
    assert torch.equal(graph_pool.recurrent[:, 4], before)  # no prompt's slot: untouched


PROMPTS = [
    [(11 * i + 5 * j) % 150 + 5 for j in range(n)]
    for i, n in enumerate([3, 9, 17, 30, 5, 41, 12, 2, 1, 24])
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run_all(engine, prompts=PROMPTS):
    cs = []
    for i, ids in enumerate(prompts):
        c = Collector()
        engine.submit(EngineRequest(f"r{i}", ids, GREEDY, GREEDY.max_tokens, c))
        cs.append(c)
    for c in cs:
        assert c.done.wait(120) and isinstance(c.events[-1], Finish)
    assert wait_idle(engine)
    return [c.tokens for c in cs]


def counting(engine):
    counts = {"prefill": 0, "decode": 0}
    for name, obj in (
        ("prefill", engine.runner.prompt_graphs),
        ("decode", engine.runner.decode_graphs),
    ):
        real = obj.run

        def run(*a, _real=real, _name=name, **k):
            counts[_name] += 1
            return _real(*a, **k)

        obj.run = run
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("with_drafter", [False, True])
@pytest.mark.parametrize("cache", [0, 1 << 24])
def test_engine_with_graph_paths_equals_eager(target, tokenizer, engines, with_drafter, cache):
    """The same requests, greedy, through an engine that replays (emulated) graphs for decode
    steps and fresh prefills, and through one that never does: the same tokens. Prompts of 1
    to 41 tokens (chunks of 16) cover fresh chunks inside and outside the captured lengths,
    several fresh prefills in one step, and prefills next to decode rows."""

    def make(graphs):
        drafter = DFlashDrafter.load(target.drafter_dir, target) if with_drafter else None
        config = EngineConfig(
            4,
            128,
            scheduling=SchedulingConfig(16, 48),
            cache=CacheConfig(bytes=cache),
            graphs=GraphConfig(enabled=graphs, capture=False, prefill_tokens=20),
        )
        return engines(target, tokenizer, (), config, drafter=drafter)

    plain = make(False)
    expected = run_all(plain)
    e = make(True)
    counts = counting(e)
    assert run_all(e) == expected
    assert e.stats()["free_slots"] == 4
    if cache:  # the second time every prompt is a cache hit
        assert run_all(e) == expected and e.stats()["cache_hits"] >= len(PROMPTS)
    assert counts["prefill"] > 0
    if not with_drafter:  # with a drafter, decode steps are verify windows (eager)
        assert counts["decode"] > 0


def emulated(
    engines,
    target,
    tokenizer,
    drafter=None,
    *,
    num_slots: int = 4,
    context: int = 128,
    spec: SpecConfig | None = None,
    cache: CacheConfig | None = None,
    **graphs,
):
    """A started engine from the ``engines`` fixture whose graphs run with capture off (prefill
    graphs up to 20 tokens); ``graphs``: further GraphConfig fields."""
    config = EngineConfig(
        num_slots,
        context,
        scheduling=SchedulingConfig(16, 48),
        cache=cache or CacheConfig(),
        spec=spec or SpecConfig(),
        graphs=GraphConfig(enabled=True, capture=False, prefill_tokens=20, **graphs),
    )
    return engines(target, tokenizer, (), config, drafter=drafter)


def test_window_batch_equals_recorded_spans_and_rolls_back_the_same(target):
    """Verify windows built from tensors (W one-row GDN steps, attention as decode rows) against
    the same windows as recorded spans (chunked GDN, span attention): logits, taps, and the
    state after rolling back to any prefix, then a decode step."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 150, (n,), generator=gen).tolist() for n in (5, 9, 13)]
    pools = [target.new_state_pool(4, 64) for _ in range(2)]
    for pool in pools:
        target.forward(ForwardBatch.build([SeqChunk(s, 0, p) for s, p in enumerate(prompts)]), pool)
    W = 4
    windows = [torch.randint(5, 150, (W,), generator=gen).tolist() for _ in prompts]
    starts = [len(p) for p in prompts]
    spans = target.forward_ex(
        ForwardBatch.build(
            [SeqChunk(s, starts[s], w, W, record=True) for s, w in enumerate(windows)]
        ),
        pools[0],
        (0, 2),
    )
    batch = ForwardBatch.windows_of(
        torch.tensor(functools.reduce(operator.iadd, windows, [])),
        torch.tensor([0, 1, 2]),
        torch.tensor(starts),
        W,
    )
    win = target.forward_ex(batch, pools[1], (0, 2))
    torch.testing.assert_close(win.logits, spans.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(win.taps, spans.taps, atol=1e-4, rtol=1e-4)
    for s, keep in enumerate((1, 2, 4)):
        if keep < W:
            target.rollback(pools[0], s, spans.records[s], keep)
            target.rollback(pools[1], s, win.records[s], keep)
        for a, b in ((pools[0].recurrent, pools[1].recurrent), (pools[0].conv, pools[1].conv)):
            torch.testing.assert_close(b[:, s], a[:, s], atol=1e-5, rtol=1e-4)
        steps = [
            target.forward(ForwardBatch.build([SeqChunk(s, starts[s] + keep, (7,))]), p)
            for p in pools
        ]
        torch.testing.assert_close(steps[1], steps[0], atol=1e-4, rtol=1e-4)


def count_runs(graphs, calls: dict, key: str) -> None:
    """Wrap ``graphs.run`` so that every replay adds one to ``calls[key]``."""
    real = graphs.run

    def run(*a):
        calls[key] += 1
        return real(*a)

    graphs.run = run


@pytest.mark.slow
def test_engine_with_window_graphs_equals_plain_greedy(target, tokenizer, engines):
    """Proposals, chain verify windows and rollbacks replayed from (emulated) graphs, several
    streams at once and windows of different widths padded to one: greedy output equals
    decoding without a drafter, and every graph path was taken."""

    def make(drafter, **kw):
        return emulated(engines, target, tokenizer, drafter, spec=SpecConfig(mode="chain"), **kw)

    plain = make(None)
    expected = run_all(plain)
    # Rounds judged on the host (whole device rounds have tests of their own below).
    e = make(DFlashDrafter.load(target.drafter_dir, target), windows=True, rounds=False)
    assert e.runner.round_graphs is None
    calls = {"windows": 0, "drafts": 0, "rollbacks": 0}
    for key, graphs in (
        ("windows", e.runner.window_graphs),
        ("drafts", e.spec.graphs),
        ("rollbacks", e.runner.rollback_graphs),
    ):
        count_runs(graphs, calls, key)
    assert run_all(e) == expected
    assert e.stats()["free_slots"] == 4 and e.stats()["spec_rounds"] > 0
    assert calls["windows"] > 0 and calls["drafts"] > 0 and calls["rollbacks"] > 0


@pytest.mark.slow
def test_window_graphs_at_the_context_edge(target, tokenizer, engines):
    """A stream whose last windows end at the context's end, next to a stream with wider
    windows: padding it to their width would write past the pool, so that step runs eagerly;
    greedy output still equals decoding without a drafter."""

    def make(drafter, **kw):
        return emulated(
            engines,
            target,
            tokenizer,
            drafter,
            num_slots=2,
            context=40,
            spec=SpecConfig(mode="chain"),
            **kw,
        )

    cases = [(PROMPTS[5][:24], 16), (PROMPTS[1][:6], 30)]  # ends at 40 (the context), and 36

    def run(e):
        cs = []
        for i, (ids, n) in enumerate(cases):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            c = Collector()
            e.submit(EngineRequest(f"e{i}", ids, params, n, c))
            cs.append(c)
        for c in cs:
            assert c.done.wait(120) and isinstance(c.events[-1], Finish)
        return [c.tokens for c in cs]

    plain = make(None)
    expected = run(plain)
    e = make(DFlashDrafter.load(target.drafter_dir, target), windows=True)
    assert run(e) == expected


def test_rolling_back_a_window_batch_by_device_lengths_equals_each_rollback(target):
    """Three graphed windows rolled back at once to kept lengths held in a device tensor
    against each window's own recorded rollback: every kept length 1 .. W, the same state;
    padding rows on a scratch slot leave the other slots alone. Both forms of the records:
    inputs (the whole window replayed, rows past the kept ones without decay or update) and
    the state after each row (the kept row's copied), which give the same states; records
    wider than the windows, as the window graphs share them."""
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(5, 150, (n,), generator=gen).tolist() for n in (4, 11, 7)]
    W = 5
    for keeps in ((1, 3, 5), (2, 5, 4), (5, 1, 1)):
        windows = [torch.randint(5, 150, (W,), generator=gen).tolist() for _ in prompts]
        starts = torch.tensor([len(p) for p in prompts] + [1])
        slots = torch.tensor([0, 1, 2, 4])  # the last: a padding window on the scratch slot
        ids = torch.tensor(functools.reduce(operator.iadd, windows, []) + [0] * W)
        by_form = {}
        for row_states in (False, True):
            pools = [target.new_state_pool(5, 64) for _ in range(3)]
            for pool in pools:
                target.forward(
                    ForwardBatch.build([SeqChunk(s, 0, p) for s, p in enumerate(prompts)]), pool
                )
            # As wide as the widest window graph, wider than these windows.
            records = target.new_window_records(4, W + 2, row_states=row_states)
            assert (records.row_state is not None) == row_states
            outs = [
                target.forward_ex(ForwardBatch.windows_of(ids, slots, starts, W, records), pool)
                for pool in pools
            ]
            for j, keep in enumerate(keeps):
                if keep < W:
                    target.rollback(pools[0], j, outs[0].records[j], keep)
                    # The host-length form the rollback graphs capture, window by window.
                    window = torch.tensor([j])
                    target.rollback_window(pools[2], slots[j : j + 1], records, window, keep)
            before = pools[1].recurrent[:, 3].clone()
            target.rollback_windows(pools[1], slots, records, torch.tensor([*keeps, 1]), W)
            for name, other in itertools.product(("recurrent", "conv"), (1, 2)):
                torch.testing.assert_close(
                    getattr(pools[other], name)[:, :3],
                    getattr(pools[0], name)[:, :3],
                    atol=1e-5,
                    rtol=1e-4,
                )
            assert torch.equal(pools[1].recurrent[:, 3], before)
            by_form[row_states] = pools[1]
        for name in ("recurrent", "conv"):
            torch.testing.assert_close(
                getattr(by_form[True], name)[:, :3],
                getattr(by_form[False], name)[:, :3],
                atol=1e-5,
                rtol=1e-4,
            )


def test_ring_rows_from_device_counts_equal_adding_them_one_stream_at_a_time(target):
    """The drafter's context rows for several streams at once, each writing only its first
    ``count`` rows (device tensors), against :meth:`add_context` of those rows stream by
    stream: the same keys, values and positions, the unwritten rows as they were (a ring that
    wraps included)."""
    drafter = DFlashDrafter.load(target.drafter_dir, target)
    gen = torch.Generator().manual_seed(3)
    width = len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size
    rings = [drafter.new_pool(4, 8) for _ in range(2)]
    history = torch.randn(6, width, generator=gen)
    for ring in rings:
        for slot in range(3):
            drafter.add_context(ring, slot, history, 0)
    B = 5
    features = torch.randn(4, B, width, generator=gen)
    starts, counts = [6, 2, 9, 1], [3, 5, 1, 0]
    for j in range(3):
        drafter.add_context(rings[0], j, features[j, : counts[j]], starts[j])
    drafter.add_context_rows(
        rings[1], torch.tensor([0, 1, 2, 3]), features, torch.tensor(starts), torch.tensor(counts)
    )
    for name in ("keys", "values", "positions"):
        torch.testing.assert_close(getattr(rings[1], name), getattr(rings[0], name))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "auto"])
def test_engine_with_whole_round_graphs_equals_plain_greedy(target, tokenizer, engines, mode):
    """Whole device rounds (proposal, window, verdict, rollback and ring in one emulated
    replay) for several streams at once, with a drafter that is right for every length of
    prefix: greedy output equals decoding without a drafter, every round length happens, and
    a penalised stream beside them (judged on the host) decodes as it does alone."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    params = [greedy] * 4 + [replace(greedy, repetition_penalty=1.3)]

    def run(e):
        cs = []
        for i, (ids, p) in enumerate(zip(PROMPTS[:5], params, strict=True)):
            c = Collector()
            e.submit(EngineRequest(f"w{i}", ids, p, p.max_tokens, c))
            cs.append(c)
        for c in cs:
            assert c.done.wait(120) and isinstance(c.events[-1], Finish)
        assert wait_idle(e)
        return [c.tokens for c in cs]

    plain = emulated(engines, target, tokenizer)
    expected = run(plain)
    drafter = PartOracle(DFlashDrafter.load(target.drafter_dir, target))
    e = emulated(engines, target, tokenizer, drafter, spec=SpecConfig(mode=mode), windows=True)
    drafter.engine = e
    lengths: list[int] = []
    real = e.runner.round_graphs.collect

    def counted():
        said = real()
        lengths.extend(map(len, said))
        return said

    e.runner.round_graphs.collect = counted
    assert run(e) == expected
    assert e.stats()["free_slots"] == 4 and e.stats()["spec_rounds"] > 0
    if mode == "chain":  # ("auto" drafts when its measured costs say it pays)
        assert set(lengths) == set(range(1, e.spec.block + 1))


@pytest.mark.slow
def test_rounds_launched_ahead_end_and_cache_streams_as_plain_decoding(target, tokenizer, engines):
    """Whole rounds launched before the last round's tokens are delivered (the device works
    while the host delivers): streams that end on their length, on a stop token met inside a
    round, and on an abort sent from their own sink, next to one that runs on, give what plain
    decoding gives; rounds were launched ahead; and the prompt cache's final snapshots,
    taken with rounds in flight, serve grown prompts as plain decoding does."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS[:4]

    class AbortAfter(Collector):
        """Aborts its own request from its sink once it holds ``n`` tokens."""

        def __init__(self, engine, rid, n):
            super().__init__()
            self.engine, self.rid, self.n = engine, rid, n

        def __call__(self, ev):
            super().__call__(ev)
            if len(self.tokens) == self.n:
                self.engine.abort(self.rid)

    def run(e, prompts, params, abort_after=None):
        cs = []
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            aborts = abort_after is not None and i == 0
            c = AbortAfter(e, f"a{i}", abort_after) if aborts else Collector()
            e.submit(EngineRequest(f"a{i}", ids, p, p.max_tokens, c))
            cs.append(c)
        for c in cs[1 if abort_after is not None else 0 :]:
            assert c.done.wait(120) and isinstance(c.events[-1], Finish)
        assert wait_idle(e)
        return [c.tokens for c in cs]

    cache = CacheConfig(bytes=1 << 24)
    plain = emulated(engines, target, tokenizer, cache=cache)
    reference = run(plain, prompts, [greedy] * 4)
    stop = reference[1][17]  # met inside a round, past the first rounds
    params = [greedy, replace(greedy, stop_token_ids=(stop,)), greedy, greedy]
    expected = run(plain, prompts, params)
    assert len(expected[1]) <= 18 and expected[1][-1] != stop  # (the stop token is not shown)
    drafter = PartOracle(DFlashDrafter.load(target.drafter_dir, target))
    e = emulated(engines, target, tokenizer, drafter, spec=SpecConfig(mode="chain"), cache=cache)
    drafter.engine = e
    ahead = []
    real = e._launch_next

    def launch_next(*a):
        got = real(*a)
        ahead.append(got is not None)
        return got

    e._launch_next = launch_next
    assert run(e, prompts, params) == expected
    assert any(ahead)
    aborted = run(e, prompts, params, abort_after=9)
    assert aborted[1:] == expected[1:] and aborted[0] == expected[0][: len(aborted[0])]
    assert 9 <= len(aborted[0]) < 40
    grown = [p + out + [7, 9] for p, out in zip(prompts, expected, strict=True)]
    hits = e.stats()["cache_hits"]
    assert run(e, grown, [greedy] * 4) == run(plain, grown, [greedy] * 4)
    assert e.stats()["cache_hits"] > hits


@pytest.mark.parametrize("width", [11, 12, 16, 29])
def test_span_batch_equals_a_continued_chunk(target, width):
    """A continued prefill chunk built from tensors (decode-style attention, the span GDN by
    slot tensor) against the same chunk as an ordinary span; padded to ``width`` rows
    (garbage ids after its 11 real rows) where ``width`` > 11. The logits of its last real
    row, the real rows' taps, and the slot's conv tail, recurrent state and KV rows agree."""
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(5, 150, (19,), generator=gen).tolist()
    chunk = torch.randint(5, 150, (11,), generator=gen).tolist()
    padding = torch.randint(5, 150, (width - 11,), generator=gen).tolist()
    pools = [target.new_state_pool(3, 64) for _ in range(2)]
    for pool in pools:
        target.forward(ForwardBatch.build([SeqChunk(1, 0, prompt)]), pool)
    ref = target.forward_ex(ForwardBatch.build([SeqChunk(1, 19, chunk)]), pools[0], (0, 2))
    got = target.forward_ex(
        ForwardBatch.windows_of(
            torch.tensor(chunk + padding),
            torch.tensor([1]),
            torch.tensor([19]),
            width,
            span=True,
            length=torch.tensor([11]) if width > 11 else None,
        ),
        pools[1],
        (0, 2),
    )
    assert got.records == {}
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.taps[:11], ref.taps, atol=1e-4, rtol=1e-4)
    for name in ("conv", "recurrent"):
        torch.testing.assert_close(
            getattr(pools[1], name)[:, 1], getattr(pools[0], name)[:, 1], atol=1e-5, rtol=1e-4
        )
    torch.testing.assert_close(pools[1].keys[:, 1, :, :30], pools[0].keys[:, 1, :, :30])


def test_continuation_widths():
    from headstart.engine.cuda_graph import continuation_widths

    assert continuation_widths(64) == [2, 4, 8, 16, 32, 64]
    assert continuation_widths(100) == [2, 4, 8, 16, 32, 64, 100]
    assert continuation_widths(2) == [2]
    assert continuation_widths(3) == [2, 3]
    # Past 256, every 128 tokens: long tool results pad by at most 128 rows.
    assert continuation_widths(1024) == [
        2,
        4,
        8,
        16,
        32,
        64,
        128,
        256,
        384,
        512,
        640,
        768,
        896,
        1024,
    ]
    assert continuation_widths(300)[-3:] == [128, 256, 300]


def test_engine_with_continuation_graphs_equals_eager(target, tokenizer, engines):
    """Long prompts in chunks of 16 and growing conversations served from the prompt cache
    (a hit, then the new turn as a continued chunk), through an engine that replays continued
    chunks from (emulated) graphs and one that does not: the same greedy tokens."""
    first = PROMPTS[:6]
    grown = [p + [(7 * i) % 150 + 5 for i in range(9)] for p in first]

    def make(graphs):
        if graphs:
            return emulated(
                engines, target, tokenizer, continuations=True, cache=CacheConfig(bytes=1 << 24)
            )
        return engines(
            target,
            tokenizer,
            (),
            EngineConfig(
                4,
                128,
                scheduling=SchedulingConfig(16, 48),
                cache=CacheConfig(bytes=1 << 24),
                graphs=GraphConfig(enabled=False),
            ),
        )

    outputs = []
    counts = None
    for graphs in (False, True):
        e = make(graphs)
        if graphs:
            counts = {"n": 0}
            real = e.runner.continuation_graphs.run

            def run(*a, _real=real, _counts=counts):
                _counts["n"] += 1
                return _real(*a)

            e.runner.continuation_graphs.run = run
        outputs.append((run_all(e, first), run_all(e, grown)))
        assert e.stats()["cache_hits"] >= len(grown)
    assert outputs[1] == outputs[0]
    assert counts["n"] > 0


def test_every_step_of_new_prompts_and_decode_rows_replays_from_graphs(target, tokenizer, engines):
    """The shapes a burst can take at run time are all captured at start-up, so no first burst
    pays compilation: the scheduler's steps, enumerated for up to four streams, each a new
    prompt of 1 .. 20 tokens (the captured lengths) or a decode row, in any mix and order,
    within the step budget, replay from graphs (prompt groups, decode rows, continued chunks);
    only what is outside the captured sizes runs eagerly."""
    import itertools

    from headstart.engine.scheduler import Scheduler
    from headstart.engine.scheduler import Sequence as Seq

    e = emulated(engines, target, tokenizer, num_slots=4)
    runner = e.runner
    steps = 0
    for n in range(1, 5):
        for kinds in itertools.product([1, 2, 7, 16, 20, "decode"], repeat=n):
            s = Scheduler(4, 4, 48, 48)
            for i, k in enumerate(kinds):
                prompt = [5] * (3 if k == "decode" else k)
                seq = Seq(f"r{i}", prompt, 8)
                s.add(seq)
            for seq in s.admit():
                if seq.id in {f"r{i}" for i, k in enumerate(kinds) if k == "decode"}:
                    s.restored(seq, len(seq.prompt))  # as after its prefill: decoding
                    s.append_token(seq, 7)
            work = s.plan()
            chunks = [chunk_of(w) for w in work]
            assert runner._graph_plan(chunks) is not None, kinds
            steps += 1
    assert steps == sum(6**n for n in range(1, 5))
    # Outside the captured sizes: eager (a prompt longer than the prompt graphs, a 1-token
    # chunk that continues a prompt).
    assert runner._graph_plan([SeqChunk(0, 0, (5,) * 21, 1)]) is None
    assert runner._graph_plan([SeqChunk(0, 3, (5,), 0)]) is None


def test_warm_shards_deal_out_every_graph_once(engines, target, tokenizer):
    """A compile-ahead process of shard (i, n) captures every n-th graph from the i-th, in the
    order the start-up takes them across its phases: the shards together capture each graph
    of an unsharded start-up exactly once."""
    from headstart.engine.cuda_graph import Shard

    deal = [Shard(i, 3) for i in range(3)]
    assert [[s.mine() for _ in range(7)] for s in deal] == [
        [j % 3 == i for j in range(7)] for i in range(3)
    ]

    def graphs(shard):
        runner = emulated(engines, target, tokenizer, shard=shard).runner
        phases = (runner.decode_graphs, runner.prompt_graphs, runner.continuation_graphs)
        return {(k, key) for k, g in enumerate(phases) for key in g.graphs}

    every = graphs(None)
    shards = [graphs((i, 2)) for i in range(2)]
    assert len(every) >= 4 and all(shards)
    assert shards[0] | shards[1] == every and not shards[0] & shards[1]


def test_decode_steps_launched_ahead_from_graphs_end_and_cache_as_planned(
    target, tokenizer, engines
):
    """Plain decode steps launched before the last one's tokens are delivered, from the
    decode graphs (whose outputs the next replay overwrites): streams that end on different
    lengths and on a stop token met mid-stream give what steps planned one by one give, and
    the prompt cache's final snapshots, taken with a step in flight, serve grown prompts the
    same."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = PROMPTS[:4]

    def run(e, prompts, params):
        cs = [Collector() for _ in prompts]
        for i, (ids, p, c) in enumerate(zip(prompts, params, cs, strict=True)):
            e.submit(EngineRequest(f"d{i}", ids, p, p.max_tokens, c))
        for c in cs:
            assert c.done.wait(120) and isinstance(c.events[-1], Finish)
        assert wait_idle(e)
        return [(c.tokens, c.events[-1].reason) for c in cs]

    cache = CacheConfig(bytes=1 << 24)
    plain = emulated(engines, target, tokenizer, cache=cache)
    plain.decode_ahead = False
    stop = run(plain, prompts[1:2], [greedy])[0][0][13]
    params = [
        greedy,
        replace(greedy, stop_token_ids=(stop,)),
        replace(greedy, max_tokens=7),
        replace(greedy, max_tokens=19),
    ]
    expected = run(plain, prompts, params)
    assert expected[1][1] == "stop"
    e = emulated(engines, target, tokenizer, cache=cache)
    e.decode_ahead = True
    collected = []
    real = e._collect_decodes
    e._collect_decodes = lambda *a: collected.append(1) or real(*a)
    assert run(e, prompts, params) == expected
    assert len(collected) > 5
    grown = [p + out + [7, 9] for p, (out, _) in zip(prompts, expected, strict=True)]
    hits = e.stats()["cache_hits"]
    assert run(e, grown, [greedy] * 4) == run(plain, grown, [greedy] * 4)
    assert e.stats()["cache_hits"] > hits
