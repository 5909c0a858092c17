"""Repetition, frequency and presence penalties: the rules against HF transformers and a token
loop, greedy generation against HF's, and a penalised stream in a batch against it alone."""

from __future__ import annotations

import pytest
import tiny
import torch
from engine_helpers import Collector

from headstart.engine.config import EngineConfig, SchedulingConfig
from headstart.engine.engine import EngineRequest, Finish
from headstart.generate import Piece, generate
from headstart.models.qwen35.model import Qwen35Model
from headstart.penalties import TokenHistory, apply_penalties
from headstart.sampling import Sampler, SamplingParams

VOCAB = 50


def _histories(rng: torch.Generator, rows: int) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=rng).tolist() for n in (3, 9, 1, 20)]
    outputs = [torch.randint(0, VOCAB, (int(n),), generator=rng).tolist() for n in (0, 7, 30, 4)]
    return prompts[:rows], outputs[:rows]


def _history(prompt: list[int], output: list[int]) -> TokenHistory:
    h = TokenHistory(prompt, VOCAB, "cpu")
    for t in output:
        h.add(t)
    return h


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    rng = torch.Generator().manual_seed(int(penalty * 10))
    prompts, outputs = _histories(rng, 4)
    logits = torch.randn(4, VOCAB, generator=rng) * 3
    params = [SamplingParams(temperature=0, repetition_penalty=penalty)] * 4
    histories = [_history(p, o) for p, o in zip(prompts, outputs, strict=True)]
    ours = apply_penalties(logits, params, histories)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        want = hf(torch.tensor([p + o]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(ours[i], want)


def _token_loop(logits: torch.Tensor, params, prompts, outputs) -> torch.Tensor:
    """The rules token by token, the slow way."""
    out = logits.clone()
    for i, (p, prompt, output) in enumerate(zip(params, prompts, outputs, strict=True)):
        for t in set(prompt) | set(output):
            x = float(out[i, t])
            out[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in output:
            out[i, t] -= p.frequency_penalty
        for t in set(output):
            out[i, t] -= p.presence_penalty
    return out


def test_penalties_match_a_token_loop_and_leave_other_rows():
    rng = torch.Generator().manual_seed(4)
    prompts, outputs = _histories(rng, 4)
    logits = torch.randn(4, VOCAB, generator=rng)
    params = [
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(),  # no penalty: untouched
        SamplingParams(repetition_penalty=1.5, frequency_penalty=-2.0, presence_penalty=2.0),
        SamplingParams(repetition_penalty=0.8, presence_penalty=0.3),
    ]
    histories = [_history(p, o) for p, o in zip(prompts, outputs, strict=True)]
    before = logits.clone()
    ours = apply_penalties(logits, params, histories)
    torch.testing.assert_close(ours, _token_loop(logits, params, prompts, outputs))
    assert torch.equal(logits, before)  # the input is left alone
    assert torch.equal(ours[1], logits[1])
    # A row without a history has said nothing: nothing to penalise.
    alone = apply_penalties(logits, params, [None, None, histories[2], None])
    assert torch.equal(alone[0], logits[0]) and torch.equal(alone[2], ours[2])


def test_sampler_penalises_greedy_rows_and_reports_raw_logprobs():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    history = TokenHistory([0], 4, "cpu")
    params = SamplingParams(temperature=0, repetition_penalty=1.2, logprobs=1)
    r = Sampler().sample(logits, [params], [None], [history])
    assert r.token_ids == [1]  # 3.0 / 1.2 < 2.9
    assert r.logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[0, 1]))
    # Without the history (or the penalty) the argmax is back.
    assert Sampler().sample(logits, [params], [None]).token_ids == [0]
    fork = history.fork()
    fork.add(2)
    assert int(history.output.sum()) == 0 and int(fork.output[2]) == 1


@pytest.mark.parametrize("penalty", [1e300, 1e-300, 1e-7])
def test_extreme_repetition_penalties_give_no_nan(penalty):
    """Valid however large or small (> 0), and a zero logit stays a number."""
    logits = torch.tensor([[0.0, 2.0, -3.0, 1.0]])
    history = TokenHistory([0, 1, 2], 4, "cpu")
    params = SamplingParams(temperature=0.8, repetition_penalty=penalty, seed=1)
    out = apply_penalties(logits, [params], [history])
    assert not out.isnan().any() and torch.isfinite(out).all()
    gen = torch.Generator().manual_seed(1)
    assert 0 <= Sampler().sample(logits, [params], [gen], [history]).token_ids[0] < 4


@pytest.mark.parametrize(
    "field,value",
    [
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("nan")),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
    ],
)
def test_bad_penalties_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    ref = tiny.causal_lm(seed=12, linear_num_value_heads=4, linear_value_head_dim=24)
    model = Qwen35Model.load(tiny.save_text_only(ref, tmp_path_factory.mktemp("pen")))
    return ref, model


PROMPTS = [[(5 * i + 11 * j) % 150 + 3 for j in range(n)] for i, n in enumerate([4, 13, 7, 26])]


def _reference(model, params, prompt) -> list[int]:
    tok = tiny.small_tokenizer()
    events = generate(model, tok, prompt, params, ())
    return [e.token_id for e in events if isinstance(e, Piece)]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_with_repetition_penalty_matches_transformers(tiny_pair, penalty):
    ref, model = tiny_pair
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=penalty
    )
    for prompt in PROMPTS[:2]:
        want = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=penalty,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert _reference(model, params, prompt) == want


def test_penalised_streams_in_a_batch_equal_each_alone(tiny_pair, engines):
    """Four streams at once, each with its own penalties (one with none), through the engine,
    against the reference loop one at a time."""
    _, model = tiny_pair
    kinds = [
        SamplingParams(temperature=0, repetition_penalty=1.4),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, frequency_penalty=1.0, presence_penalty=0.5),
        SamplingParams(temperature=0.9, seed=3, top_k=30, presence_penalty=1.5),
    ]
    params = [SamplingParams(**{**p.__dict__, "max_tokens": 20, "ignore_eos": True}) for p in kinds]
    config = EngineConfig(4, 128, scheduling=SchedulingConfig(16, 48))
    e = engines(model, tiny.small_tokenizer(), (), config)
    cs = []
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        c = Collector()
        e.submit(EngineRequest(f"p{i}", prompt, p, 20, c))
        cs.append(c)
    for c in cs:
        assert c.done.wait(120) and isinstance(c.events[-1], Finish)
    together = [c.tokens for c in cs]
    alone = [_reference(model, p, prompt) for prompt, p in zip(PROMPTS, params, strict=True)]
    assert together == alone
    plain = _reference(
        model, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), PROMPTS[0]
    )
    assert together[0] != plain  # the penalty did something


def test_logit_bias_forces_and_bans_tokens_per_row():
    logits = torch.tensor([[3.0, 0.0, 1.0, -1.0]] * 3)
    params = [
        SamplingParams(temperature=0, logit_bias={3: 100}),  # forced
        SamplingParams(temperature=0, logit_bias=[(0, -100.0), (2, 0.5)]),  # banned, nudged
        SamplingParams(temperature=0),  # untouched
    ]
    assert Sampler().sample(logits, params, [None] * 3).token_ids == [3, 2, 0]
    assert params[1].logit_bias == ((0, -100.0), (2, 0.5))
    sampled = SamplingParams(temperature=1.0, seed=0, logit_bias={1: 100})
    gen = torch.Generator().manual_seed(0)
    assert Sampler().sample(logits[:1], [sampled], [gen]).token_ids == [1]
    r = Sampler().sample(logits[:1], [replace_bias(params[0], logprobs=0)], [None])
    assert r.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[3]))  # raw


def replace_bias(p: SamplingParams, **kw) -> SamplingParams:
    from dataclasses import replace

    return replace(p, **kw)


@pytest.mark.parametrize(
    "bias", [{1: 101}, {-1: 1}, {1: float("inf")}, [(1, 2, 3)], dict.fromkeys(range(1025), 1)]
)
def test_bad_logit_bias_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
