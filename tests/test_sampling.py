"""Tests for headstart.sampling: parameter validation, filters, sampler statistics,
per-request reproducibility and logprobs."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headstart.sampling import (
    MAX_LOGPROBS,
    Sampler,
    SamplingParams,
    apply_min_p,
    apply_temperature,
    apply_top_k,
    apply_top_k_top_p_min_p,
    apply_top_p,
    make_generator,
    sampling_probs,
)

SAMPLER = Sampler()

# Upper 0.1% points of the chi-square distribution by degrees of freedom (standard table
# values). With fixed seeds the tests are deterministic; the small alpha only matters if
# torch's RNG stream changes between versions.
CHI2_CRIT_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458}

SMALL_LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0]


# ------------------------------------------------------------------ reference model


def _softmax(x: np.ndarray) -> np.ndarray:
    finite = np.isfinite(x)
    out = np.zeros_like(x)
    z = x[finite] - x[finite].max()
    out[finite] = np.exp(z) / np.exp(z).sum()
    return out


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Float64 re-derivation of the documented pipeline, written independently of the
    implementation: temperature, top-k, top-p, min-p, renormalise."""
    x = np.asarray(logits, dtype=np.float64)
    if temperature == 0 or top_k == 1:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out
    x = x / temperature
    if 0 < top_k < len(x):
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x >= kth, x, -np.inf)
    if top_p < 1:
        probs = _softmax(x)
        order = np.argsort(-probs, kind="stable")
        kept, mass = [], 0.0
        for j in order:
            if mass >= top_p:
                break
            kept.append(j)
            mass += probs[j]
        threshold = probs[kept[-1]]
        x = np.where(probs >= threshold, x, -np.inf)
    if min_p > 0:
        probs = _softmax(x)
        x = np.where(probs >= min_p * probs.max(), x, -np.inf)
    return _softmax(x)


def _renormalised(probs: np.ndarray, keep: np.ndarray) -> np.ndarray:
    masked = np.where(keep, probs, 0.0)
    return masked / masked.sum()


def draw_counts(logits_row, params: SamplingParams, n: int, seed: int) -> np.ndarray:
    """n independent draws (as n batch rows sharing one seeded generator)."""
    logits = torch.tensor([logits_row], dtype=torch.float32).repeat(n, 1)
    gen = make_generator(seed)
    result = SAMPLER.sample(logits, [params] * n, [gen] * n)
    counts = np.zeros(len(logits_row), dtype=np.int64)
    for tok, c in Counter(result.token_ids).items():
        counts[tok] = c
    return counts


def chi_square(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson's statistic; a positive count where the expected probability is 0 is inf."""
    n = counts.sum()
    stat = 0.0
    for c, p in zip(counts, expected_probs, strict=True):
        if p == 0:
            if c:
                return math.inf
            continue
        e = n * p
        stat += (c - e) ** 2 / e
    return stat


# ------------------------------------------------------------------------ params


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert p.stop == () and p.stop_token_ids == () and p.logprobs is None
    assert not p.greedy
    q = SamplingParams(temperature=0, stop=["a", "bc"], stop_token_ids=[1, 2], logprobs=20)
    assert q.stop == ("a", "bc") and q.stop_token_ids == (1, 2)
    assert isinstance(q.temperature, float) and q.greedy
    assert SamplingParams(stop="</s>").stop == ("</s>",)
    assert SamplingParams(top_k=1).greedy
    assert SamplingParams(top_k=-1, seed=-5, max_tokens=1, logprobs=0).top_k == -1
    hash(q)  # frozen and hashable after list -> tuple conversion
    with pytest.raises(AttributeError):
        q.temperature = 1.0  # type: ignore[misc]


_bad_float = st.sampled_from([math.nan, math.inf, -math.inf, "1.0", None, True])

BAD_VALUES = {
    "temperature": st.one_of(st.floats(max_value=-1e-12), _bad_float),
    "top_p": st.one_of(
        st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True), _bad_float
    ),
    "top_k": st.one_of(st.integers(max_value=-2), st.sampled_from([1.5, 2.0, "3", True, None])),
    "min_p": st.one_of(
        st.floats(max_value=-1e-12), st.floats(min_value=1.0, exclude_min=True), _bad_float
    ),
    "seed": st.one_of(
        st.integers(max_value=-(2**63) - 1),
        st.integers(min_value=2**64),
        st.sampled_from([1.0, "7", True]),
    ),
    "max_tokens": st.one_of(st.integers(max_value=0), st.sampled_from([1.0, "5", True])),
    "logprobs": st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=MAX_LOGPROBS + 1),
        st.sampled_from([1.0, "5", False]),
    ),
    "stop": st.one_of(
        st.lists(st.text(max_size=3), max_size=3).map(lambda xs: [*xs, ""]),
        st.sampled_from([[1], ["a", None], 5, None]),
    ),
    "stop_token_ids": st.one_of(
        st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
        st.sampled_from([[1.5], ["2"], "12", 3, [True]]),
    ),
    "ignore_eos": st.sampled_from([1, 0, "yes", None]),
}


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_invalid_params_raise_value_error_naming_the_parameter(data):
    name = data.draw(st.sampled_from(sorted(BAD_VALUES)))
    value = data.draw(BAD_VALUES[name])
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


@settings(max_examples=200, deadline=None)
@given(
    temperature=st.floats(min_value=0, max_value=100),
    top_p=st.floats(min_value=0, max_value=1, exclude_min=True),
    top_k=st.integers(min_value=-1, max_value=10**6),
    min_p=st.floats(min_value=0, max_value=1),
    logprobs=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
)
def test_valid_params_accepted(temperature, top_p, top_k, min_p, logprobs):
    p = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, logprobs=logprobs
    )
    assert p.temperature == temperature and p.logprobs == logprobs


# ----------------------------------------------------------------------- helpers


def test_make_generator():
    assert make_generator(None) is None
    a, b = make_generator(42), make_generator(42)
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))


def test_apply_temperature_handles_tiny_temperature():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    for t in [1e-30, 1e-40]:  # the second overflows float32 to -inf
        out = apply_temperature(logits, [t])
        assert not torch.isnan(out).any() and out[0, 1] == 0
        assert out.softmax(dim=-1).tolist() == [[0.0, 1.0, 0.0]]
    with pytest.raises(ValueError):
        apply_temperature(logits, [0.0])


def test_apply_top_k_keeps_k_and_ties_and_skips_disabled_rows():
    logits = torch.tensor(
        [
            [0.0, 5.0, 3.0, 4.0, 1.0],
            [0.0, 5.0, 3.0, 3.0, 1.0],  # tie at the 2nd value: both kept
            [0.0, 5.0, 3.0, 4.0, 1.0],  # k = 0: off
            [0.0, 5.0, 3.0, 4.0, 1.0],  # k = -1: off
            [0.0, 5.0, 3.0, 4.0, 1.0],  # k >= V: off
        ]
    )
    before = logits.clone()
    out = apply_top_k(logits, [2, 2, 0, -1, 9])
    assert torch.equal(logits, before)  # input untouched
    kept = torch.isfinite(out)
    assert kept[0].tolist() == [False, True, False, True, False]
    assert kept[1].tolist() == [False, True, True, True, False]
    assert kept[2:].all()
    assert torch.equal(out[kept], logits[kept])


def test_apply_top_p():
    # probs 0.5, 0.25, 0.125, 0.125 (descending after sort of ids 2, 0, 1, 3)
    logits = torch.log(torch.tensor([[0.25, 0.125, 0.5, 0.125]])).repeat(4, 1)
    out = apply_top_p(logits, [0.5, 0.6, 0.8, 1.0])
    kept = torch.isfinite(out).tolist()
    assert kept[0] == [False, False, True, False]  # mass before 2nd token is 0.5, not < 0.5
    assert kept[1] == [True, False, True, False]
    assert kept[2] == [True, True, True, True]  # 3rd token needed; 4th ties with it
    assert kept[3] == [True] * 4
    # A minuscule p still keeps the most likely token.
    assert torch.isfinite(apply_top_p(logits[:1], [1e-9])).sum() == 1


def test_apply_min_p_masks_by_ratio_to_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]])
    logits = torch.log(probs) + 7.0  # a shift must not matter
    for min_p, expect in [(0.0, 5), (0.1, 4), (0.15, 3), (0.5, 2), (0.61, 1), (1.0, 1)]:
        out = apply_min_p(logits, [min_p])
        kept = torch.isfinite(out)[0]
        assert int(kept.sum()) == expect, min_p
        assert torch.equal(kept, probs[0] >= min_p * probs[0].max())


def test_combined_filters_match_reference_on_random_rows():
    rng = np.random.default_rng(0)
    rows, params = [], []
    for _ in range(200):
        vocab = int(rng.integers(2, 40))
        rows.append(rng.normal(0, 3, size=vocab).astype(np.float32))
        params.append(
            SamplingParams(
                temperature=float(rng.choice([0.0, 0.3, 1.0, 1.7])),
                top_k=int(rng.choice([0, -1, 1, 2, 5, 50])),
                top_p=float(rng.choice([1.0, 0.95, 0.7, 0.3, 0.01])),
                min_p=float(rng.choice([0.0, 0.05, 0.3])),
            )
        )
    for logits, p in zip(rows, params, strict=True):
        got = sampling_probs(torch.from_numpy(logits)[None], [p])[0].numpy()
        want = reference_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)
        assert np.array_equal(got > 0, want > 0), p
        np.testing.assert_allclose(got, want, atol=1e-5)
    # Same answer when the rows are processed as one padded batch with mixed settings.
    vocab = 40
    batch = torch.full((len(rows), vocab), -math.inf)
    for i, r in enumerate(rows):
        batch[i, : len(r)] = torch.from_numpy(r)
    batched = sampling_probs(batch, params)
    for i, (r, p) in enumerate(zip(rows, params, strict=True)):
        want = reference_probs(r, p.temperature, p.top_k, p.top_p, p.min_p)
        np.testing.assert_allclose(batched[i, : len(r)].numpy(), want, atol=1e-5)


def test_filter_order_is_top_k_then_top_p():
    # After top-k=2 the distribution is renormalised to (0.545, 0.455), so top-p 0.5
    # keeps only the best token; top-p on the full distribution would keep two.
    logits = torch.log(torch.tensor([[0.3, 0.25, 0.2, 0.15, 0.1]]))
    out = apply_top_k_top_p_min_p(logits, top_k=[2], top_p=[0.5])
    assert torch.isfinite(out).sum() == 1
    assert torch.isfinite(apply_top_k_top_p_min_p(logits, top_p=[0.5])).sum() == 2


# ------------------------------------------------------------------------ greedy


def test_greedy_is_argmax_with_lowest_id_on_ties():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 100, generator=gen)
    logits[3, 7] = logits[3, 42] = 50.0  # tie: id 7 wins
    params = [SamplingParams(temperature=0.0)] * 8
    out = SAMPLER.sample(logits, params, [None] * 8)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[3] == 7
    assert out.token_ids_tensor.dtype == torch.long
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_rows_consume_no_randomness():
    gen = make_generator(123)
    state = gen.get_state()
    logits = torch.randn(3, 50)
    SAMPLER.sample(
        logits,
        [
            SamplingParams(temperature=0),
            SamplingParams(top_k=1),
            SamplingParams(temperature=0, top_p=0.5),
        ],
        [gen, gen, gen],
    )
    assert torch.equal(gen.get_state(), state)
    SAMPLER.sample(logits[:1], [SamplingParams()], [gen])
    assert not torch.equal(gen.get_state(), state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_degenerate_settings_equal_greedy(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(64, 300, generator=gen) * 4).to(dtype)
    greedy = logits.float().argmax(dim=-1).tolist()
    # bf16/fp16 rounding can create ties at the top, which only greedy breaks by id, so
    # use rows without a tie at the top for the stochastic settings.
    top2 = logits.float().topk(2, dim=-1).values
    untied = [i for i in range(64) if top2[i, 0] > top2[i, 1]]
    for params in [
        SamplingParams(temperature=1e-4),
        SamplingParams(top_k=1),
        SamplingParams(top_k=1, temperature=3.0),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0, temperature=2.0),
    ]:
        for seed in range(3):
            gens = [make_generator(seed * 1000 + i) for i in range(64)]
            out = SAMPLER.sample(logits, [params] * 64, gens).token_ids
            assert [out[i] for i in untied] == [greedy[i] for i in untied], params


# ------------------------------------------------------------------ distribution


def test_masked_tokens_are_never_sampled():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 32, generator=gen) * 2
    cases = [
        SamplingParams(top_k=4, temperature=5.0),
        SamplingParams(top_p=0.5, temperature=3.0),
        SamplingParams(min_p=0.2, temperature=4.0),
        SamplingParams(top_k=10, top_p=0.8, min_p=0.05, temperature=2.0),
    ]
    n = 4000
    for params in cases:
        allowed = sampling_probs(logits, [params])[0] > 0
        assert 1 < int(allowed.sum()) < 32, params  # the filter actually bites
        out = SAMPLER.sample(logits.repeat(n, 1), [params] * n, [make_generator(9)] * n)
        drawn = torch.tensor(out.token_ids)
        assert allowed[drawn].all(), params
        # A large temperature flattens the kept set, so every kept token shows up.
        assert set(drawn.tolist()) == set(torch.nonzero(allowed).flatten().tolist())


@pytest.mark.parametrize(
    ("params", "wrong"),
    [
        # Plain temperature; the classic bug is to forget it or invert it.
        (
            SamplingParams(temperature=0.7),
            [reference_probs(SMALL_LOGITS, 1.0), reference_probs(SMALL_LOGITS, 1 / 0.7)],
        ),
        # Top-k must renormalise the *temperature-scaled* probabilities of the kept set.
        (
            SamplingParams(temperature=1.5, top_k=4),
            [reference_probs(SMALL_LOGITS, 1.0, top_k=4), reference_probs(SMALL_LOGITS, 1.5)],
        ),
        # At T=2, top-p 0.8 keeps 4 tokens; applying top-p before temperature (on the
        # T=1 distribution) keeps only 3, so token 3 would never be drawn. Ignoring top-p
        # altogether is the other bug.
        (
            SamplingParams(temperature=2.0, top_p=0.8),
            [
                _renormalised(
                    reference_probs(SMALL_LOGITS, 2.0),
                    reference_probs(SMALL_LOGITS, 1.0, top_p=0.8) > 0,
                ),
                reference_probs(SMALL_LOGITS, 2.0),
            ],
        ),
        # All filters together; min-p bites after top-k and top-p.
        (
            SamplingParams(temperature=1.2, top_k=5, top_p=0.95, min_p=0.25),
            [
                reference_probs(SMALL_LOGITS, 1.2, top_k=5, top_p=0.95),
                reference_probs(SMALL_LOGITS, 1.0, top_k=5, top_p=0.95, min_p=0.25),
            ],
        ),
    ],
)
def test_chi_square_goodness_of_fit(params, wrong):
    expected = reference_probs(
        SMALL_LOGITS, params.temperature, params.top_k, params.top_p, params.min_p
    )
    counts = draw_counts(SMALL_LOGITS, params, n=20_000, seed=2024)
    assert counts.sum() == 20_000
    assert counts[expected == 0].sum() == 0, "drew a filtered-out token"
    dof = int((expected > 0).sum()) - 1
    stat = chi_square(counts, expected)
    assert stat < CHI2_CRIT_999[dof], (stat, counts, expected)
    # The same draws must clearly reject each plausible buggy distribution, which shows
    # the test has the power to catch that bug.
    for bad in wrong:
        bad = np.asarray(bad, dtype=np.float64)
        assert not np.allclose(bad, expected)
        assert chi_square(counts, bad) > 5 * CHI2_CRIT_999[max(dof, 1)], bad


def test_unseeded_rows_use_the_global_rng():
    logits = torch.tensor([SMALL_LOGITS]).repeat(5000, 1)
    params = [SamplingParams(temperature=1.0)] * 5000
    with torch.random.fork_rng():
        torch.manual_seed(5)
        a = SAMPLER.sample(logits, params, [None] * 5000).token_ids
        torch.manual_seed(5)
        b = SAMPLER.sample(logits, params, [None] * 5000).token_ids
    assert a == b
    counts = np.bincount(a, minlength=6)
    assert chi_square(counts, reference_probs(SMALL_LOGITS)) < CHI2_CRIT_999[5]


# --------------------------------------------------------------- reproducibility


def _step_logits(step: int, batch: int, vocab: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(batch, vocab, generator=gen) * 2


def test_same_seed_same_sequence():
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=77)

    def run(seed: int) -> list[int]:
        gen = make_generator(seed)
        return [SAMPLER.sample(_step_logits(s, 1), [params], [gen]).token_ids[0] for s in range(40)]

    assert run(77) == run(77)
    assert run(77) != run(78)


@pytest.mark.slow
def test_request_tokens_do_not_depend_on_batch_composition():
    target = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=1234, logprobs=3)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3, seed=5),
        SamplingParams(top_p=0.5),  # unseeded: global RNG
        SamplingParams(top_k=3, temperature=0.5, seed=6),
        SamplingParams(min_p=0.3, seed=7),
    ]
    steps = 30
    target_logits = [_step_logits(s, 1)[0] for s in range(steps)]

    gen = make_generator(target.seed)
    alone = [
        SAMPLER.sample(target_logits[s][None], [target], [gen]).token_ids[0] for s in range(steps)
    ]

    rng = np.random.default_rng(3)
    for _trial in range(3):
        gen = make_generator(target.seed)
        other_gens = [make_generator(p.seed) for p in others]
        batched = []
        for s in range(steps):
            # Different companions, sizes and positions every step.
            chosen = sorted(rng.choice(len(others), size=int(rng.integers(0, 6)), replace=False))
            pos = int(rng.integers(0, len(chosen) + 1))
            rows = [others[c] for c in chosen]
            gens = [other_gens[c] for c in chosen]
            logits = _step_logits(1000 + s * 7 + _trial, len(rows) + 1)
            rows.insert(pos, target)
            gens.insert(pos, gen)
            logits[pos] = target_logits[s]
            batched.append(SAMPLER.sample(logits, rows, gens).token_ids[pos])
        assert batched == alone


# ---------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_top_logprobs_sorted():
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(4, 200, generator=gen) * 3).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.5, top_k=10, logprobs=5),
        SamplingParams(temperature=0, logprobs=MAX_LOGPROBS),
        SamplingParams(temperature=1.5, top_p=0.9),  # no logprobs asked
        SamplingParams(temperature=2.0, logprobs=0),
    ]
    before = logits.clone()
    out = SAMPLER.sample(logits, params, [make_generator(i) for i in range(4)])
    assert torch.equal(logits, before)  # the sampler never writes to its input
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, tok in enumerate(out.token_ids):
        # Raw model distribution, not the temperature-scaled/filtered one.
        assert out.logprobs[i] == pytest.approx(raw[i, tok].item(), abs=1e-6)
    assert [len(t) for t in out.top_logprobs] == [5, MAX_LOGPROBS, 0, 0]
    for i, top in enumerate(out.top_logprobs):
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        for tok, v in top:
            assert v == pytest.approx(raw[i, tok].item(), abs=1e-6)
        if top:
            assert top[0][1] == pytest.approx(raw[i].max().item(), abs=1e-6)
            cutoff = values[-1]
            listed = {t for t, _ in top}
            assert all(raw[i, t] <= cutoff + 1e-6 for t in range(200) if t not in listed)
    # The greedy row's chosen token is its top logprob.
    assert out.top_logprobs[1][0][0] == out.token_ids[1]


def test_top_logprobs_ties_by_lowest_id_and_capped_by_vocab():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    out = SAMPLER.sample(logits, [SamplingParams(temperature=0, logprobs=20)], [None])
    assert [t for t, _ in out.top_logprobs[0]] == [1, 2, 3, 0]
    assert out.token_ids == [1]


def test_sample_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        SAMPLER.sample(torch.zeros(2, 5), [SamplingParams()], [None, None])
    with pytest.raises(ValueError):
        SAMPLER.sample(torch.zeros(5), [SamplingParams()], [None])
