"""Prompt-state cache: bookkeeping (torch-free) and the engine restoring snapshots exactly."""

from __future__ import annotations

import math
import random
import time

import pytest
from engine_helpers import Collector

from headstart.engine.config import CacheConfig, EngineConfig, SchedulingConfig
from headstart.engine.engine import EngineRequest, Finish, wait_idle
from headstart.engine.prompt_cache import PrefixHashes, PromptCacheIndex
from headstart.loading import load
from headstart.sampling import SamplingParams

# -- bookkeeping ---------------------------------------------------------------------------


def test_longest_prefix_is_confirmed_token_by_token():
    idx = PromptCacheIndex(budget_bytes=1000)
    idx.insert([1, 2, 3], 10, "a")
    idx.insert([1, 2, 3, 4, 5], 10, "b")
    idx.insert([9, 9], 10, "c")
    assert idx.lookup([1, 2, 3, 4, 5, 6]).payload == "b"
    assert idx.lookup([1, 2, 3, 4, 7]).payload == "a"
    assert idx.lookup([1, 2, 3, 4, 5], max_length=4).payload == "a"
    assert idx.lookup([1, 2, 4]) is None and idx.lookup([9]) is None
    assert (idx.stats.hits, idx.stats.misses) == (3, 2)


def test_budget_evicts_least_recently_used():
    idx = PromptCacheIndex(budget_bytes=100)
    for i in range(4):
        idx.insert([i], 30, i)  # 4 x 30 > 100: the first goes
    assert not idx.contains([0]) and idx.bytes_held == 90
    idx.lookup([1])  # 1 is now the most recently used
    idx.insert([7], 30, 7)
    assert idx.contains([1]) and not idx.contains([2]) and idx.bytes_held <= 100
    assert idx.stats.evictions == 2
    assert idx.insert([8], 101, 8) == [] and not idx.contains([8])  # larger than the budget


def test_lookup_passes_over_unusable_entries_and_counts_once():
    idx = PromptCacheIndex(budget_bytes=1000)
    idx.insert([1, 2], 10, "short")
    idx.insert([1, 2, 3], 10, "whole")
    assert idx.lookup([1, 2, 3], usable=lambda e: e.payload != "whole").payload == "short"
    assert (idx.stats.hits, idx.stats.misses) == (1, 0)
    assert idx.lookup([1, 2, 3], usable=lambda e: False) is None
    assert (idx.stats.hits, idx.stats.misses) == (1, 1)


def test_superseded_entries_are_evicted_first():
    """An entry that is a strict prefix of another (an earlier turn of a conversation) goes
    before any conversation's newest entry, least recently used first among them; the newest
    goes only when nothing superseded is left. Counts follow entries as they come and go."""
    idx = PromptCacheIndex(budget_bytes=50)
    idx.insert([1, 2], 10, "a1")
    idx.insert([5], 10, "b1")
    idx.insert([1, 2, 3], 10, "a2")  # supersedes a1
    idx.insert([5, 6], 10, "b2")  # supersedes b1
    idx.lookup([1, 2])  # a1 is now more recent than b1, a2 and b2
    idx.insert([9], 10, "c")  # full: 50 bytes
    assert idx.insert([8], 10, "d")[0].payload == "b1"  # superseded, least recently used
    assert idx.insert([7], 10, "e")[0].payload == "a1"  # the other superseded one
    assert [e.payload for e in idx.insert([4], 10, "f")] == ["a2"]  # then plain LRU
    assert not idx.superseded
    idx.insert([4, 4], 10, "g")  # supersedes f; evicts b2 (LRU, nothing superseded before)
    idx.insert([3, 3, 3], 10, "h")
    assert idx.contains([4, 4]) and not idx.contains([4])
    # A prefix stored after the entry that extends it is superseded from the start.
    idx2 = PromptCacheIndex(budget_bytes=30)
    idx2.insert([1, 2, 3], 10, "long")
    idx2.insert([1], 10, "short")
    idx2.insert([9], 10, "x")
    assert idx2.insert([8], 10, "y")[0].payload == "short"


def test_prefix_hashes_equal_exactly_for_equal_prefixes():
    rng = random.Random(0)
    tokens = tuple(rng.randrange(50) for _ in range(300))
    h = PrefixHashes(tokens)
    for n in [0, 1, 63, 64, 65, 128, 200, 300]:
        assert h.at(n) == PrefixHashes(tokens[:n]).at(n)  # the same prefix, any source
        other = (*tokens[: n - 1], tokens[n - 1] + 1) if n else (7,)
        assert PrefixHashes(other).at(len(other)) != h.at(n)
    assert len({h.at(n) for n in range(301)}) == 301


@pytest.mark.parametrize("seed", range(6))
def test_prefix_hashes_extended_from_a_base_equal_those_made_afresh(seed):
    """Hashes extended from a base (the state a slot holds) equal fresh ones at every length,
    whether the base is a prefix (at a link's end or inside one, or all of it) or is not."""
    rng = random.Random(seed)
    tokens = tuple(rng.randrange(50) for _ in range(rng.randrange(1, 400)))
    cut = rng.choice([0, len(tokens), rng.randrange(len(tokens) + 1), 64 * (len(tokens) // 128)])
    bases = [tokens[:cut], (*tokens[:cut], 51), tokens[: max(cut - 1, 0)] + (52,) * 9]
    if len(tokens) > 1:
        bases.append((*tokens[: len(tokens) - 1], tokens[-1] + 1) + tokens)
    fresh = PrefixHashes(tokens)
    for base in bases:
        extended = PrefixHashes(tokens, base=PrefixHashes(base))
        assert extended.tokens == tokens
        assert [extended.at(n) for n in range(len(tokens) + 1)] == [
            fresh.at(n) for n in range(len(tokens) + 1)
        ]


@pytest.mark.parametrize("seed", range(4))
def test_index_against_a_brute_force_model(seed):
    """Random conversations that share and extend prefixes, under a budget: every lookup
    finds the longest stored prefix, and the superseded count is that of a brute-force scan."""
    rng = random.Random(seed)
    idx = PromptCacheIndex(budget_bytes=12)
    stems = [tuple(rng.randrange(4) for _ in range(rng.randrange(1, 150))) for _ in range(5)]
    for _ in range(120):
        stem = rng.choice(stems)
        key = stem[: rng.randrange(1, len(stem) + 1)] + tuple(
            rng.randrange(4) for _ in range(rng.randrange(0, 80))
        )
        if rng.random() < 0.5:
            idx.insert(key, 1, None)
        probe = key + tuple(rng.randrange(4) for _ in range(rng.randrange(0, 5)))
        stored = list(idx.entries)
        want = max((k for k in stored if probe[: len(k)] == k), key=len, default=None)
        got = idx.lookup(probe)
        assert (got.tokens if got else None) == want
        superseded = sum(
            1 for k in stored if any(len(o) > len(k) and o[: len(k)] == k for o in stored)
        )
        assert idx.superseded == superseded
        assert sum(e.extensions > 0 for e in idx.entries.values()) == superseded


def test_token_cap_and_disabled():
    idx = PromptCacheIndex(budget_bytes=100, max_tokens=3)
    idx.insert([1, 2, 3, 4], 1, "x")
    assert not idx.contains([1, 2, 3, 4])
    off = PromptCacheIndex(budget_bytes=0)
    off.insert([1], 1, "x")
    assert not off.enabled and not off.contains([1])


# -- the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded():
    return load()


def make_engine(engines, loaded, cache_mib=64, cache_bytes=None, **cache):
    """A started engine from the ``engines`` fixture; ``cache``: CacheConfig fields besides the
    budget."""
    budget = cache_mib << 20 if cache_bytes is None else cache_bytes
    config = EngineConfig(
        4, 512, scheduling=SchedulingConfig(32, 64), cache=CacheConfig(bytes=budget, **cache)
    )
    return engines(loaded.model, loaded.tokenizer, loaded.eos_token_ids, config)


def ask(engine, ids, params, rid, snapshot_at=()):
    c = Collector()
    engine.submit(EngineRequest(rid, list(ids), params, params.max_tokens, c, snapshot_at))
    assert c.done.wait(60)
    assert isinstance(c.finish, Finish)
    return c


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompt(loaded, text):
    return loaded.tokenizer.encode(text)


def test_exact_repeat_restores_everything_and_skips_the_forward(loaded, engines):
    ids = prompt(loaded, "def fibonacci(n):\n    '''Return the n-th number.'''\n")
    cold = make_engine(engines, loaded, cache_mib=0)
    want = ask(cold, ids, GREEDY, "cold").tokens
    e = make_engine(engines, loaded)
    first = ask(e, ids, GREEDY, "a")
    assert first.tokens == want and first.finish.cached_tokens == 0
    steps = e.steps
    one = ask(e, ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), "b")
    assert one.finish.cached_tokens == len(ids) and one.tokens == want[:1]
    assert e.steps == steps  # the first token came from cached logits: no forward
    again = ask(e, ids, GREEDY, "c")
    assert again.tokens == want and again.finish.cached_tokens == len(ids)


def test_partial_hit_from_a_boundary_snapshot(loaded, engines):
    head = prompt(loaded, "<|im_start|>user\nWrite a sort.<|im_end|>\n<|im_start|>assistant\n")
    ids = head + prompt(loaded, "<think>\n")
    other = head + prompt(loaded, "Sure, here it is")
    cold = make_engine(engines, loaded, cache_mib=0)
    want = ask(cold, other, GREEDY, "cold").tokens
    e = make_engine(engines, loaded)
    ask(e, ids, GREEDY, "turn1", snapshot_at=(len(head),))
    got = ask(e, other, GREEDY, "turn2")
    assert got.finish.cached_tokens == len(head) and got.tokens == want


@pytest.mark.parametrize("with_drafter", [False, True])
def test_agent_loop_restores_prompt_and_answer(engines, tmp_path, with_drafter):
    """Each turn sends the last prompt, its answer and 40 new tokens (a tool result): every
    turn restores at least the last prompt and all but the last answer token (the end of
    generation snapshot), and answers token for token as an engine without the cache; with a
    drafter too (its verify rounds leave a settled slot, whichever token ends the answer)."""
    import tiny

    from headstart.engine.spec.drafter import DFlashDrafter

    target = tiny.target_with_drafter(tmp_path, seed=7, block=4)
    tok = tiny.small_tokenizer()

    def engine(cache_mib):
        config = EngineConfig(
            2,
            512,
            scheduling=SchedulingConfig(32, 64),
            cache=CacheConfig(bytes=cache_mib << 20, interval=0),
        )
        drafter = DFlashDrafter.load(target.drafter_dir, target) if with_drafter else None
        return engines(target, tok, (), config, drafter=drafter)

    cached, cold = engine(64), engine(0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    answered = 0
    ids = [(7 * i) % 150 + 5 for i in range(60)]
    for turn in range(4):
        got = ask(cached, ids, params, f"t{turn}")
        want = ask(cold, ids, params, f"c{turn}")
        assert got.tokens == want.tokens, turn
        if turn:
            assert got.finish.cached_tokens >= answered, turn
        answered = len(ids) + len(got.tokens) - 1  # prompt and answer, but the last token
        ids = ids + got.tokens + [(11 * i + turn) % 150 + 5 for i in range(40)]
    # Each later turn got the slot of the one before (freed slots are reused first), which
    # still held that turn's end-of-generation state: restored without a copy.
    assert cached.stats()["cache_restores_in_place"] == 3


def test_a_slot_written_since_its_snapshot_is_restored_by_copy(loaded, engines):
    """A conversation's next turn whose slot served another stream since (a whole request,
    or one aborted at its first token) gets its state copied back, never the slot's leftovers;
    the one that finds its slot untouched restores in place; all answer as without a cache."""
    e, cold = make_engine(engines, loaded, interval=0), make_engine(engines, loaded, cache_mib=0)
    ids = prompt(loaded, "def mean(xs):\n")
    answer = ask(e, ids, GREEDY, "a1").tokens
    turn = ids + answer[:-1] + prompt(loaded, "\n# and the median\n")
    other = prompt(loaded, "class Tree:\n    def insert(self, key):\n")
    ask(e, other, GREEDY, "b")  # the same slot, another stream (nothing to restore)
    got = ask(e, turn, GREEDY, "a2")
    assert got.finish.cached_tokens == len(ids) + len(answer) - 1
    assert got.tokens == ask(cold, turn, GREEDY, "cold2").tokens
    assert e.stats()["cache_restores_in_place"] == 0
    nxt = turn + got.tokens[:-1] + prompt(loaded, "\n# and the mode\n")
    # Aborted at its first token: its prompt went through the slot, no answer was snapshot.
    c = Collector(on_first=lambda: e.abort("x"))
    e.submit(EngineRequest("x", other + prompt(loaded, " pass\n") * 20, GREEDY, 12, c))
    assert wait_idle(e) and c.tokens and not c.done.is_set()
    again = ask(e, nxt, GREEDY, "a3")
    assert again.tokens == ask(cold, nxt, GREEDY, "cold3").tokens
    last = nxt + again.tokens[:-1] + prompt(loaded, "\n# done\n")
    final = ask(e, last, GREEDY, "a4")  # its slot untouched since a3's answer
    assert final.finish.cached_tokens == len(nxt) + len(again.tokens) - 1
    assert final.tokens == ask(cold, last, GREEDY, "cold4").tokens
    assert e.stats()["cache_restores_in_place"] == 1


def test_a_seam_in_the_answer_is_counted_and_restores_only_what_matches(loaded, engines):
    """The next prompt carries the answer with one token changed (as when re-encoding the
    answer's text gives other tokens than the model produced): the restore stops before the
    answer, the seam is counted, and the tokens are those of an engine without the cache."""
    e, cold = make_engine(engines, loaded, interval=0), make_engine(engines, loaded, cache_mib=0)
    ids = prompt(loaded, "def add(a, b):\n")
    answer = ask(e, ids, GREEDY, "t1").tokens
    changed = [*answer[:3], (answer[3] + 1) % 4000 + 5, *answer[4:]]
    nxt = ids + changed + prompt(loaded, "\n# now subtract\n")
    got = ask(e, nxt, GREEDY, "t2")
    assert len(ids) <= got.finish.cached_tokens < len(ids) + 4  # never past the changed token
    assert got.tokens == ask(cold, nxt, GREEDY, "cold").tokens
    assert e.stats()["cache_seams"] == 1
    same = ids + answer[:-1] + prompt(loaded, "\n# again\n")  # the answer as generated
    assert ask(e, same, GREEDY, "t3").finish.cached_tokens == len(ids) + len(answer) - 1
    assert e.stats()["cache_seams"] == 1


def test_long_prompt_snapshots_at_fixed_interval(loaded, engines):
    ids = prompt(loaded, "x = [i * i for i in range(10)]\n" * 20)
    assert len(ids) > 100
    e = make_engine(engines, loaded, interval=40)
    ask(e, ids, GREEDY, "long")
    lengths = sorted(len(k) for k in e.cache.device.entries)
    # ... and the end of the generation: the prompt and the answer tokens fed back (all but
    # the last, which was sampled and never went through the model).
    end = len(ids) + GREEDY.max_tokens - 1
    assert lengths == [*range(40, len(ids), 40), len(ids), end]
    variant = ids[:-3] + prompt(loaded, "pass")
    cold = make_engine(engines, loaded, cache_mib=0)
    want = ask(cold, variant, GREEDY, "cold").tokens
    got = ask(e, variant, GREEDY, "variant")
    assert got.finish.cached_tokens == (len(ids) - 3) // 40 * 40 and got.tokens == want


def test_a_short_new_turn_is_not_cut_at_interval_positions(loaded, engines):
    """A prompt restored up to P with fewer than ``interval`` tokens left prefills the rest in
    one step even where it crosses a multiple of the interval (no snapshot cut there), and
    answers as an engine without the cache; a cold prompt is still cut at every interval."""
    e, cold = make_engine(engines, loaded, interval=40), make_engine(engines, loaded, cache_mib=0)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = prompt(loaded, "def square(x):\n    return x * x\n" * 2)[:30]
    answer = ask(e, ids, params, "t1").tokens
    restored = len(ids) + len(answer) - 1  # the end-of-generation snapshot
    nxt = ids + answer + prompt(loaded, "\n# and a cube, with a docstring and a test\n")[:20]
    assert any(restored < p < len(nxt) for p in range(40, len(nxt), 40))  # crosses 40
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    before = e.steps
    got = ask(e, nxt, one, "t2")
    assert got.finish.cached_tokens == restored and e.steps - before == 1
    assert got.tokens == ask(cold, nxt, one, "cold").tokens
    assert e.cache.boundaries(100, (), 0) == (40, 80)  # cold: every interval
    assert e.cache.boundaries(100, (90,), 70) == (90,)  # 30 left: requested positions only
    assert e.cache.boundaries(130, (), 50) == (80, 120)  # an interval or more left: as cold


def test_concurrent_restores_leave_the_snapshot_unchanged(loaded, engines):
    ids = prompt(loaded, "import json\n\ndef load(path):\n")
    e = make_engine(engines, loaded)
    ask(e, ids, GREEDY, "seed")
    (entry,) = [v for k, v in e.cache.device.entries.items() if len(k) == len(ids)]
    before = entry.payload.fingerprint()
    cs = []
    for i, params in enumerate(
        [
            SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.7, top_k=5, seed=2, max_tokens=20, ignore_eos=True),
        ]
    ):
        c = Collector()
        e.submit(EngineRequest(f"r{i}", ids, params, 20, c))
        cs.append(c)
    for c in cs:
        assert c.done.wait(60) and c.finish.cached_tokens == len(ids)
    assert entry.payload.fingerprint() == before


def test_restore_overwrites_poisoned_buffers(loaded, engines):
    ids = prompt(loaded, "class Stack:\n    def push(self, x):\n")
    e = make_engine(engines, loaded)
    want = ask(e, ids, GREEDY, "warm").tokens
    assert wait_idle(e)
    pool = e.runner.pool
    for t in (pool.conv, pool.recurrent, pool.keys, pool.values):
        t.fill_(math.nan)
    got = ask(e, ids, GREEDY, "poisoned")
    assert got.finish.cached_tokens == len(ids) and got.tokens == want


def test_failed_restore_falls_back_to_prefill(loaded, engines):
    ids = prompt(loaded, "for item in items:\n    print(item)\n")
    e = make_engine(engines, loaded)
    want = ask(e, ids, GREEDY, "warm").tokens
    pool = e.runner.pool
    for t in (pool.conv, pool.recurrent, pool.keys, pool.values):
        t.fill_(math.nan)
    e.cache.fail_restores = 1
    got = ask(e, ids, GREEDY, "failing")
    assert got.tokens == want and got.finish.cached_tokens == 0
    assert e.cache.device.stats.failed_restores == 1


def test_filling_past_the_budget_keeps_bytes_within_it(loaded, engines):
    prompts = [prompt(loaded, f"value_{i} = compute({i})\n") for i in range(10)]
    probe = make_engine(engines, loaded, interval=0)
    ask(probe, prompts[0], SamplingParams(temperature=0, max_tokens=1), "probe")
    one = probe.cache.device.bytes_held
    e = make_engine(engines, loaded, cache_bytes=int(3.5 * one), interval=0)
    for i, ids in enumerate(prompts):
        ask(e, ids, SamplingParams(temperature=0, max_tokens=1), f"r{i}")
        assert e.cache.device.bytes_held <= e.cache.device.budget_bytes
        if i == 2:  # touch the first prompt: it becomes the most recently used
            assert ask(
                e, prompts[0], SamplingParams(temperature=0, max_tokens=1), "touch"
            ).finish.cached_tokens == len(prompts[0])
        if i == 3:  # least recently used went first: prompt 1, not the older prompt 0
            device = e.cache.device
            assert device.contains(prompts[0]) and not device.contains(prompts[1])
    assert len(e.cache.device.entries) == 3 and e.cache.device.stats.evictions == 7
    assert [e.cache.device.contains(p) for p in prompts] == [False] * 7 + [True] * 3


def test_snapshot_rows_are_reused_from_a_fixed_store(loaded, engines):
    """The GDN part of snapshots lives in preallocated rows: filling past the row count evicts
    the least recently used and recycles its row, without new storage."""
    e = make_engine(engines, loaded, interval=0, max_snapshots=3)
    store = e.cache.store
    assert store is not None and store.capacity == 3
    ptr = store.fixed["recurrent"].data_ptr()
    prompts = [prompt(loaded, f"item_{i} = [{i}] * {i}\n") for i in range(7)]
    for i, ids in enumerate(prompts):
        ask(e, ids, SamplingParams(temperature=0, max_tokens=1), f"s{i}")
        assert len(e.cache.device.entries) == min(i + 1, 3)
        assert len(store.free) == 3 - len(e.cache.device.entries)
    assert store.fixed["recurrent"].data_ptr() == ptr
    rows = sorted(entry.payload.row for entry in e.cache.device.entries.values())
    assert rows == [0, 1, 2]
    assert [e.cache.device.contains(p) for p in prompts] == [False] * 4 + [True] * 3
    # A recycled row holds the new snapshot: an exact hit still answers like a miss.
    again = ask(e, prompts[-1], GREEDY, "again")
    cold = make_engine(engines, loaded, cache_mib=0)
    assert again.tokens == ask(cold, prompts[-1], GREEDY, "cold").tokens


@pytest.mark.parametrize("copier", [False, True], ids=["inline", "copier"])
def test_host_tier_keeps_what_the_device_tier_evicts(loaded, engines, copier):
    """With one device row, older prompts move to the host tier and still hit from there;
    the same whether demotions are copied on the engine thread or by the copier thread."""
    e = make_engine(
        engines,
        loaded,
        interval=0,
        max_snapshots=1,
        host_bytes=64 << 20,
        async_demotion=copier,
    )
    assert (e.cache.copies is not None) == copier
    prompts = [prompt(loaded, f"config_{i} = load({i!r})\n") for i in range(3)]
    first = [ask(e, ids, GREEDY, f"p{i}").tokens for i, ids in enumerate(prompts)]
    assert wait_idle(e)
    e.cache.flush()
    # Each request leaves its prompt's snapshot and its generation's (prompt + answer): the
    # newest generation on the device, the five before it demoted to the host tier.
    assert len(e.cache.device.entries) == 1 and len(e.cache.host.entries) == 5
    assert e.cache.device.contains(prompts[2] + first[2][:-1])
    assert all(e.cache.host.contains(p) for p in prompts)
    again = ask(e, prompts[0], GREEDY, "again")
    assert again.finish.cached_tokens == len(prompts[0]) and again.tokens == first[0]
    assert e.stats()["cache_host_hits"] == 1


def test_an_idle_engine_takes_in_finished_demotions_before_the_next_lookup(loaded, engines):
    """Demotions copied by the copier thread while the engine is idle join the host tier
    then, without a request: the next lookup finds nothing left to take in."""
    probe = make_engine(engines, loaded, interval=0)
    fixed = probe.cache.pool.fixed_bytes()
    # Two store rows, bytes for one snapshot: the device tier evicts by bytes, so a
    # demotion is left in flight after the last request (not waited for to free a row).
    e = make_engine(
        engines,
        loaded,
        cache_bytes=2 * fixed + 50_000,
        interval=0,
        host_bytes=64 << 20,
        async_demotion=True,
    )
    assert e.cache.store.capacity == 2
    prompts = [prompt(loaded, f"idle_{i} = settle({i!r})\n") for i in range(3)]
    for i, ids in enumerate(prompts):
        ask(e, ids, GREEDY, f"p{i}")
    assert wait_idle(e)
    deadline = time.monotonic() + 10
    while (e.cache.copies.pending or len(e.cache.host.entries) < 5) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert e.cache.copies.pending == 0 and len(e.cache.host.entries) == 5
    assert all(e.cache.host.contains(p) for p in prompts)


@pytest.mark.parametrize("copier", [False, True], ids=["inline", "copier"])
def test_a_return_from_the_host_tier_is_exact_and_its_copies_are_counted(loaded, engines, copier):
    """A conversation comes back after others overflowed the device tier into the host tier:
    its restore is a host hit, answers with the logits of an engine without the cache, and
    the transfer counters grow by exactly the snapshot's bytes (demotions: the host copies');
    the same with demotions copied by the copier thread."""
    e = make_engine(
        engines,
        loaded,
        interval=0,
        max_snapshots=2,
        host_bytes=64 << 20,
        async_demotion=copier,
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    first = prompt(loaded, "def first_conversation(x):\n    return x\n")
    ask(e, first, params, "first")
    for i in range(3):  # each leaves two snapshots: its prompt and prompt + answer
        ask(e, prompt(loaded, f"other_{i} = compute({i}) + {i}\n"), params, f"other{i}")
    assert wait_idle(e)
    e.cache.flush()
    cache = e.cache
    assert not cache.device.contains(first) and cache.host.contains(first)
    before = e.stats()
    # Nothing left the host tier (its budget is ample): every host byte came by demotion.
    assert before["cache_demoted_bytes"] == cache.host.bytes_held > 0
    assert before["cache_demote_seconds"] > 0
    assert before["cache_host_restored_bytes"] == before["cache_host_restore_seconds"] == 0
    snapshot_bytes = cache.host.entries[tuple(first)].nbytes
    got = ask(e, first, params, "return")  # exact: its first token from the cached logits
    after = e.stats()
    assert got.finish.cached_tokens == len(first)
    assert after["cache_host_hits"] == before["cache_host_hits"] + 1
    assert after["cache_host_restored_bytes"] == snapshot_bytes
    assert after["cache_host_restore_seconds"] > 0
    cold = make_engine(engines, loaded, cache_mib=0)
    want = ask(cold, first, params, "cold")

    def logprobs(c):
        return [(p.token_id, p.logprob, p.top_logprobs) for p in c.events[:-1]]

    assert len(logprobs(got)) == 6 and all(lp[2] for lp in logprobs(got))
    assert logprobs(got) == logprobs(want)  # the same computation: bit for bit


@pytest.mark.parametrize("copier", [False, True], ids=["inline", "copier"])
def test_a_tight_host_tier_reuses_its_arena_without_leaking(loaded, engines, copier):
    """A host budget of about three snapshots under many demotions: every host entry lives in
    a block of the arena allocated at start, the blocks held and the free bytes add up to the
    arena, the oldest entries went for good, and the newest demoted prompt still restores to
    the answer of an engine without the cache."""
    probe = make_engine(engines, loaded, interval=0, max_snapshots=1)
    one = probe.cache.snapshot_bytes(16, True)
    e = make_engine(
        engines,
        loaded,
        interval=0,
        max_snapshots=1,
        host_bytes=3 * one + one // 2,
        async_demotion=copier,
    )
    cache = e.cache
    assert cache.arena is not None and cache.arena.capacity == cache.host.budget_bytes
    regions = [(r.data_ptr(), r.data_ptr() + r.numel()) for r in cache.arena.regions]
    prompts = [prompt(loaded, f"value_{i} = fetch({i}) * {i}\n") for i in range(6)]
    for i, ids in enumerate(prompts):
        ask(e, ids, GREEDY, f"p{i}")
    assert wait_idle(e)
    cache.flush()
    host = cache.host
    assert 0 < len(host.entries) < 2 * len(prompts) - 1  # some were dropped for good
    blocks = [e.payload.block for e in host.entries.values()]
    assert None not in blocks and len(set(blocks)) == len(blocks)
    held = sum(b.nbytes for b in blocks)
    assert held == host.bytes_held and held + cache.arena.free_bytes == cache.arena.capacity
    for entry in host.entries.values():
        for t in entry.payload._tensors():
            assert any(lo <= t.data_ptr() < hi for lo, hi in regions)  # no tensor of its own
    assert not any(k[: len(prompts[0])] == tuple(prompts[0]) for k in host.entries)  # oldest
    newest = list(host.entries)[-1]  # a generation: prompt + answer; continued by a next turn
    turn = [*newest, *prompt(loaded, "# next\n")]
    again = ask(e, turn, GREEDY, "again")
    assert again.finish.cached_tokens == len(newest)
    cold = make_engine(engines, loaded, cache_mib=0)
    assert again.tokens == ask(cold, turn, GREEDY, "cold").tokens
