"""Speculative decoding with a DFlash drafter: exactness, rollback, lossless sampling, ordering."""

from __future__ import annotations

import pytest
import tiny
import torch
from engine_helpers import Collector

from headstart.batch import ForwardBatch, SeqChunk
from headstart.engine.config import CacheConfig, EngineConfig, SchedulingConfig, SpecConfig
from headstart.engine.engine import EngineRequest, Finish, wait_idle
from headstart.engine.spec.drafter import DFlashDrafter
from headstart.engine.spec.verification import verify
from headstart.generate import greedy_tokens
from headstart.sampling import Sampler, SamplingParams, sampling_probs


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny.target_with_drafter(tmp_path_factory.mktemp("spec"), seed=31, block=6)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.small_tokenizer()


class OracleDrafter(DFlashDrafter):
    """Proposes exactly the target's greedy continuation (every draft should be accepted)."""

    def __init__(self, real: DFlashDrafter):
        self.__dict__.update(real.__dict__)
        self.engine = None

    def propose_logits(self, pool, slots, anchors, positions, block):
        self.forwards += 1
        seqs = {s.slot: s for s in self.engine.scheduler.running}
        out = torch.full((len(slots), block - 1, self.target.cfg.vocab_size), -1e9)
        for n, slot in enumerate(slots):
            seq = seqs[slot]
            history = seq.prompt + seq.output
            cont = greedy_tokens(self.target, history, block - 1)
            for j, t in enumerate(cont):
                out[n, j, t] = 0.0
        return out


def engine_for(engines, target, tokenizer, drafter=None, **parts):
    """A started engine from ``engines`` (the fixture); ``parts``: EngineConfig's composed
    settings (spec=, cache=)."""
    config = EngineConfig(4, 256, scheduling=SchedulingConfig(16, 48), **parts)
    return engines(target, tokenizer, (), config, drafter=drafter)


def drafting_engine(engines, target, tokenizer, kind: str, mode: str):
    """A started engine with the target's random drafter (``kind`` "random") or the oracle
    that proposes the target's own greedy continuation ("oracle"), in spec ``mode``."""
    drafter = DFlashDrafter.load(target.drafter_dir, target)
    if kind == "oracle":
        drafter = OracleDrafter(drafter)
    e = engine_for(engines, target, tokenizer, drafter, spec=SpecConfig(mode=mode))
    if kind == "oracle":
        drafter.engine = e
    return e


PROMPTS = [
    [(7 * i + 3 * j) % 150 + 5 for j in range(n)]
    for i, n in enumerate([3, 9, 17, 30, 5, 41, 12, 24])
]


def run_all(engine, params, prompts=PROMPTS, draft=True):
    cs = []
    for i, ids in enumerate(prompts):
        c = Collector()
        engine.submit(EngineRequest(f"r{i}", ids, params, params.max_tokens, c, draft=draft))
        cs.append(c)
    for c in cs:
        assert c.done.wait(120) and isinstance(c.events[-1], Finish)
    return [c.tokens for c in cs]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=16, ignore_eos=True)
    for i in range(3)
]


@pytest.fixture(scope="module")
def plain_greedy(target, tokenizer, module_engines):
    e = engine_for(module_engines, target, tokenizer)
    return run_all(e, GREEDY)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree", "auto"])
@pytest.mark.parametrize("kind", ["random", "oracle"])
def test_greedy_with_drafter_equals_without(target, tokenizer, engines, plain_greedy, kind, mode):
    e = drafting_engine(engines, target, tokenizer, kind, mode)
    assert run_all(e, GREEDY) == plain_greedy
    spec = e.stats()
    assert spec["spec_rounds"] > 0
    if mode == "tree":
        assert spec["spec_tree_rounds"] == spec["spec_rounds"]
    if mode == "chain":
        assert spec["spec_tree_rounds"] == 0
    if mode == "auto":  # the engine timed its decode steps for the planner
        planner = e.spec.planner
        assert planner is not None and planner.overhead > 0 and planner.step_cost > 0
    if kind == "oracle" and mode == "chain":
        assert spec["spec_accepted"] == spec["spec_drafted"]
    elif kind == "oracle" and mode == "tree":  # the greedy spine is accepted whole
        per_round = spec["spec_accepted"] / spec["spec_rounds"]
        assert per_round >= (6 - 1) * 0.8
    elif kind == "oracle":
        # auto: the planner mixes chains and trees by measured (timed) cost, so the share of
        # drafts accepted varies with the machine's load (a tree's side branches are drafted
        # and rejected); what cannot vary is that every round's first draft lands.
        assert spec["spec_accepted"] >= spec["spec_rounds"]
    else:
        assert spec["spec_accepted"] < spec["spec_drafted"] / 2


PENALISED = SamplingParams(
    temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5
)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("kind", ["random", "oracle"])
def test_penalised_greedy_with_drafter_equals_without(target, tokenizer, engines, kind, mode):
    """A verify round judges each window row after the rows before it, as plain decoding
    would: the drafts (unpenalised proposals) change nothing in what is emitted."""
    plain = run_all(engine_for(engines, target, tokenizer), PENALISED)
    assert plain != run_all(engine_for(engines, target, tokenizer), GREEDY)
    e = drafting_engine(engines, target, tokenizer, kind, mode)
    assert run_all(e, PENALISED) == plain
    spec = e.stats()
    assert spec["spec_rounds"] > 0
    if kind == "oracle":  # the unpenalised continuation is accepted in part
        assert 0 < spec["spec_accepted"] < spec["spec_drafted"]


def test_draft_opt_out(target, tokenizer, engines, plain_greedy):
    drafter = DFlashDrafter.load(target.drafter_dir, target)
    e = engine_for(engines, target, tokenizer, drafter)
    assert run_all(e, GREEDY, draft=False) == plain_greedy
    assert drafter.forwards == 0


def test_rollback_equals_plain_steps(target):
    """A recorded verify window rolled back to k rows == prefilling only those k rows."""
    ids = PROMPTS[5]
    window = [11, 22, 33, 44, 55, 66]
    for keep in range(1, len(window) + 1):
        a = target.new_state_pool(1, 128)
        target.forward(ForwardBatch.build([SeqChunk(0, 0, ids)]), a)
        out = target.forward_ex(
            ForwardBatch.build([SeqChunk(0, len(ids), window, len(window), record=True)]), a
        )
        target.rollback(a, 0, out.records[0], keep)
        b = target.new_state_pool(1, 128)
        target.forward(ForwardBatch.build([SeqChunk(0, 0, ids)]), b)
        for t in range(keep):
            target.forward(ForwardBatch.build([SeqChunk(0, len(ids) + t, (window[t],))]), b)
        assert (a.conv - b.conv).abs().max() <= 1e-5
        assert (a.recurrent - b.recurrent).abs().max() <= 1e-4
        # And decoding on from there agrees.
        nxt = len(ids) + keep
        la = target.forward(ForwardBatch.build([SeqChunk(0, nxt, (99,))]), a)
        lb = target.forward(ForwardBatch.build([SeqChunk(0, nxt, (99,))]), b)
        assert (la - lb).abs().max() <= 1e-4


def test_first_token_is_delivered_before_any_draft(target, tokenizer, engines):
    drafter = DFlashDrafter.load(target.drafter_dir, target)
    # chain: always drafts
    e = engine_for(engines, target, tokenizer, drafter, spec=SpecConfig(mode="chain"))
    c = Collector(drafter)
    e.submit(EngineRequest("a", PROMPTS[3], GREEDY, 24, c))
    assert c.done.wait(60)
    assert c.forwards_at_first == 0 and drafter.forwards > 0
    # Cancelled on its first token: the slot is freed and no draft is ever computed.
    before = drafter.forwards
    c2 = Collector(drafter, on_first=lambda: e.abort("b"))
    e.submit(EngineRequest("b", PROMPTS[4], GREEDY, 24, c2))
    assert wait_idle(e)
    assert len(c2.events) == 1 and drafter.forwards == before
    assert e.stats()["free_slots"] == 4


@pytest.mark.slow
def test_sampling_with_drafts_is_lossless():
    """Emitted tokens follow the target distribution whatever the drafts: the first token is
    distributed as p_0, and the second (given the first equals d_1) as p_1."""
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7], [0.1, 1.5, 0.3, -1.0], [0.0, 0.0, 0.0, 2.0]])
    params = SamplingParams(temperature=0.8, top_k=3, seed=None, max_tokens=3)
    p = sampling_probs(logits, [params] * 3)
    drafts = [0, 1]
    sampler = Sampler()
    gen = torch.Generator().manual_seed(5)
    first = torch.zeros(4)
    second = torch.zeros(4)
    n = 20000
    for _ in range(n):
        v = verify(logits.clone(), drafts, params, gen, sampler)
        first[v.tokens[0]] += 1
        if v.tokens[0] == drafts[0]:
            second[v.tokens[1]] += 1
    for counts, probs in ((first, p[0]), (second, p[1])):
        total = counts.sum()
        expected = probs * total
        live = expected > 0
        assert counts[~live].sum() == 0
        chi2 = ((counts[live] - expected[live]) ** 2 / expected[live]).sum()
        assert chi2 < 16.3  # chi-square, 3 degrees of freedom, p = 0.001


@pytest.mark.slow
def test_prompt_cache_keeps_drafter_features(target, tokenizer, engines, plain_greedy):
    drafter = DFlashDrafter.load(target.drafter_dir, target)
    e = engine_for(engines, target, tokenizer, drafter, cache=CacheConfig(bytes=16 << 20))
    first = run_all(e, GREEDY, prompts=PROMPTS[:2])
    again = run_all(e, GREEDY, prompts=PROMPTS[:2])
    assert first == again == plain_greedy[:2]
    snaps = [entry.payload for entry in e.cache.device.entries.values()]
    assert snaps and all(s.draft_features is not None for s in snaps)
    assert e.cache.device.stats.hits >= 2


def test_tree_window_rows_equal_their_paths_and_commit_equals_steps(target):
    """Each tree row's logits == running its root-to-node path as a plain sequence; committing
    a path leaves the slot exactly as plain steps through that path would."""
    ids = PROMPTS[3]
    s = len(ids)
    #        0(anchor)
    #       /    \\
    #      1      2
    #     / \\     |
    #    3   4    5
    #    |
    #    6
    tokens = [17, 40, 41, 50, 51, 52, 60]
    parents = [-1, 0, 0, 1, 1, 2, 3]
    pool = target.new_state_pool(2, 128)
    target.forward(ForwardBatch.build([SeqChunk(0, 0, ids)]), pool)
    out = target.forward_ex(
        ForwardBatch.build([SeqChunk(0, s, tokens, len(tokens), parents=parents)]), pool
    )

    def path_to(node):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        return path[::-1]

    for node in range(len(tokens)):
        path = path_to(node)
        ref = target.new_state_pool(1, 128)
        target.forward(ForwardBatch.build([SeqChunk(0, 0, ids)]), ref)
        logits = target.forward(
            ForwardBatch.build([SeqChunk(0, s, [tokens[j] for j in path], len(path))]), ref
        )
        assert (out.logits[node] - logits[-1]).abs().max() <= 1e-4
    # Commit the path 0-1-3-6 and compare with plain steps through it.
    path = path_to(6)
    target.commit_tree(pool, 0, s, out.records[0], path)
    ref = target.new_state_pool(2, 128)
    target.forward(ForwardBatch.build([SeqChunk(0, 0, ids)]), ref)
    for j, node in enumerate(path):
        target.forward(ForwardBatch.build([SeqChunk(0, s + j, (tokens[node],))]), ref)
    assert (pool.recurrent[:, 0] - ref.recurrent[:, 0]).abs().max() <= 1e-4
    assert (pool.conv[:, 0] - ref.conv[:, 0]).abs().max() <= 1e-5
    n = s + len(path)
    assert (pool.keys[:, 0, :, :n] - ref.keys[:, 0, :, :n]).abs().max() <= 1e-5
    la = target.forward(ForwardBatch.build([SeqChunk(0, n, (99,))]), pool)
    lb = target.forward(ForwardBatch.build([SeqChunk(0, n, (99,))]), ref)
    assert (la - lb).abs().max() <= 1e-4


def test_tree_building_keeps_the_greedy_spine_and_the_budget():
    from headstart.engine.spec.verification import build_tree

    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randn(5, 50, generator=g), -1)
    d = build_tree(lp, width=3, budget=12)
    assert len(d.tokens) == 12 and all(p < i + 1 for i, p in enumerate(d.parents))
    spine = [int(t) for t in lp.argmax(-1)]
    assert list(d.tokens[:5]) == spine and list(d.parents[:5]) == [0, 1, 2, 3, 4]
    # Siblings are distinct tokens.
    seen = {}
    for tok, parent in zip(d.tokens, d.parents, strict=False):
        assert tok not in seen.setdefault(parent, set())
        seen[parent].add(tok)


@pytest.mark.slow
def test_tree_sampling_is_lossless():
    """Tree walk with sampling: the first emitted token follows p_0 whatever the children."""
    from headstart.engine.spec.verification import Draft, verify_tree

    logits = torch.tensor(
        [[1.0, 0.2, -0.5, 0.7], [0.1, 1.5, 0.3, -1.0], [0.0, 0.0, 0.0, 2.0], [0.5, 0.5, 0.5, 0.5]]
    )
    params = SamplingParams(temperature=0.9, max_tokens=4)
    p = sampling_probs(logits, [params] * 4)
    draft = Draft((0, 3, 1), (0, 0, 1))  # rows 1 and 2 children of the anchor, row 3 of row 1
    gen = torch.Generator().manual_seed(11)
    counts = torch.zeros(4)
    n = 20000
    for _ in range(n):
        v, path = verify_tree(logits.clone(), draft, params, gen, Sampler())
        counts[v.tokens[0]] += 1
        assert len(path) == len(v.tokens)
    expected = p[0] * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 16.3


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_seeded_sampling_with_drafter_is_reproducible(target, tokenizer, engines, mode):
    drafter = DFlashDrafter.load(target.drafter_dir, target)
    e = engine_for(engines, target, tokenizer, drafter, spec=SpecConfig(mode=mode))
    a = [run_all(e, params, prompts=PROMPTS[:2]) for params in SEEDED]
    b = [run_all(e, params, prompts=PROMPTS[:2]) for params in SEEDED]
    assert a == b and all(len(t) == 16 for r in a for t in r)


def test_planner_drafts_only_while_rounds_beat_plain_steps():
    """Costs: a plain step 1.0, windows a little more, the drafter 0.1. With the optimistic
    start drafting pays; once nothing is accepted it does not, and the planner declines except
    for rechecks after 4, then 8 steps (the doubling alone: no recheck budget); when drafts are
    accepted again, it drafts every step."""
    from headstart.engine.spec.planner import SpecPlanner

    costs = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}
    p = SpecPlanner(4, costs, None, draft_cost=0.1, recheck=4, recheck_budget=0)
    assert p.worth_drafting()
    for _ in range(30):
        p.observe_chain(3, 0)
    answers = [p.worth_drafting() for _ in range(12)]
    assert answers == [False] * 3 + [True] + [False] * 7 + [True]
    for _ in range(30):
        p.observe_chain(3, 3)
    assert all(p.worth_drafting() for _ in range(5))


@pytest.mark.parametrize("round_cost", [None, 6.0])
def test_planner_rechecks_within_its_budget_of_decode_time(round_cost):
    """Rounds far from paying (a CPU's: windows of 2 to 8 rows at 1.5 to 4.5 plain steps, the
    drafter 2, a round's extra 1.5; about 2.5 tokens a round): over 20,000 declined steps the
    rechecks' expected loss (each round's cost beyond the plain steps of its expected tokens)
    stays within the 1% budget, and a recheck still comes (the first after the budget's wait,
    not the 32 steps of the doubling). A zero budget rechecks as the doubling says."""
    from headstart.engine.spec.planner import SpecPlanner

    costs = {1: 1.0, **{r: 1.5 + 0.5 * (r - 2) for r in range(2, 9)}}

    def run(budget: float) -> tuple[list[int], float]:
        p = SpecPlanner(
            8, costs, None, draft_cost=2.0, recheck_budget=budget, round_cost=round_cost
        )
        for _ in range(40):
            p.observe_chain(7, 1)  # one or two drafts accepted, alternately
            p.observe_chain(7, 2)
        p.overhead = 1.5
        rechecks, lost = [], 0.0
        for i in range(20_000):
            if p.worth_drafting():
                depth = p.choose(8)[1]
                loss = p._chain_cost(depth) + p.overhead - p.expected_chain(depth) * 1.0
                assert loss > 0
                rechecks.append(i)
                lost += loss
                p.observe_step(p._modelled + p.overhead, drafted=True)
            else:
                p.observe_step(1.0, drafted=False)
        return rechecks, lost

    rechecks, lost = run(0.01)
    assert rechecks and rechecks[0] > 32
    assert lost <= 0.01 * 20_000
    doubling, lost_doubling = run(0.0)
    assert doubling[0] == 31 and len(doubling) > len(rechecks)
    assert lost_doubling > 0.01 * 20_000  # the doubling alone spends more than the budget


def test_planner_weighs_a_full_chain_at_the_whole_round_cost():
    """With whole device rounds measured (a full chain of 3 drafts for 1.5, against host rounds
    of a window of 2 to 4 rows at 2.6 to 3.0 plus the drafter's 0.5), the full chain is weighed
    at the round's cost: at 3 expected tokens a round it beats a plain step of 1.0 and every
    host chain; its modelled cost is the round's. Without the round cost the same acceptance
    does not pay."""
    from headstart.engine.spec.planner import SpecPlanner

    costs = {1: 1.0, 2: 2.6, 3: 2.8, 4: 3.0}
    whole = SpecPlanner(4, costs, None, draft_cost=0.5, recheck=1000, round_cost=1.5)
    host = SpecPlanner(4, costs, None, draft_cost=0.5, recheck=1000)
    for p in (whole, host):
        for _ in range(60):
            p.observe_chain(3, 2)  # two of three drafts accepted, every round
    assert abs(whole.expected_chain(3) - 3.0) < 0.01
    assert whole.worth_drafting() and whole.choose(4) == ("chain", 3)
    assert whole._modelled == 1.5
    assert not host.worth_drafting()


def test_planner_counts_what_a_round_costs_beyond_its_windows():
    """Windows and the drafter measured cheap (a two-draft round modelled at 1.3 against a plain
    step of 1.0, three tokens a round): drafting pays on paper. When drafting steps take 4.0 on
    the engine's clock, it does not; when plain steps then turn out to take 5.0, it does again."""
    from headstart.engine.spec.planner import SpecPlanner

    p = SpecPlanner(4, {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}, None, draft_cost=0.1, recheck=1000)
    for _ in range(30):
        p.observe_chain(3, 2)
    assert p.choose(4) == ("chain", 2) and p.worth_drafting()
    for _ in range(40):
        p.choose(4)
        p.observe_step(4.0, drafted=True)
    assert 2.5 < p.overhead < 2.7
    assert not p.worth_drafting()
    for _ in range(40):
        p.observe_step(5.0, drafted=False)
    assert p.worth_drafting()
    # A drafted step the engine did not time (prompt rows in it) leaves nothing behind.
    overhead = p.overhead
    p.choose(4)
    assert p.worth_drafting()
    p.observe_step(9.0, drafted=True)
    assert p.overhead == overhead
