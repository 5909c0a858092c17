"""Token sampling: turn a batch of next-token logits into chosen token ids.

This module owns the per-request decoding knobs (:class:`SamplingParams`) and the
:class:`Sampler` that applies them. The processing order is the one HF transformers and
vLLM use: temperature scaling, then top-k, top-p and min-p masking, then one random draw
per row (greedy rows take the argmax and draw nothing). Each row's randomness comes only
from that row's own ``torch.Generator``, so a seeded request yields the same tokens
whatever other requests share its batch. The sampler also reports log-probabilities
under the *raw* model distribution (``log_softmax`` of the unmodified logits, vLLM's
default). Repetition, frequency and presence penalties come first, on the raw logits, from
each row's :class:`~headstart.penalties.TokenHistory` (``penalties.py``). Non-goals: stop
handling (``stops.py`` and the engine; ``max_tokens``, ``stop``, ``stop_token_ids`` and
``ignore_eos`` are only carried and validated here), constrained decoding, beam search and
speculative decoding. A request's ``logit_bias`` is added to the raw logits before anything.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from headstart.penalties import TokenHistory, apply_penalties

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "SAMPLING_EPS",
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "apply_logit_bias",
    "apply_min_p",
    "apply_temperature",
    "apply_top_k",
    "apply_top_k_top_p_min_p",
    "apply_top_p",
    "derived_seed",
    "make_generator",
    "sampling_probs",
]

#: Largest number of top logprobs a request may ask for per token (the OpenAI API's limit).
MAX_LOGPROBS = 20
#: Most tokens one request's ``logit_bias`` may name (a bound on its per-step work).
MAX_LOGIT_BIAS = 1024

# The range torch.Generator.manual_seed accepts (negative seeds are remapped by torch).
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1
#: Temperatures below this decode greedily (vLLM's rule): dividing by them would round to
#: 0 or overflow in float32, and the distribution they ask for is the argmax anyway.
SAMPLING_EPS = 1e-5
# top_k values above this are stored as this: any k >= the vocabulary keeps every token, and
# the kernels take k as a 64-bit integer.
_TOP_K_MAX = 2**31 - 1

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- parameters


def _as_real(name: str, value: Any) -> float:
    # bool is an Integral, but `temperature=True` is a caller bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters, validated on construction.

    ``temperature == 0`` means greedy decoding (argmax, ties to the lowest token id);
    ``top_k == 1`` is treated the same way. ``top_k`` of 0 or -1 disables top-k,
    ``top_p == 1`` disables top-p and ``min_p == 0`` disables min-p. ``seed`` seeds the
    request's own generator (see :func:`make_generator`); ``None`` means unseeded.
    ``logprobs`` is the number of top alternatives to report per token (0..20); ``None``
    means no logprobs at all, 0 means only the chosen token's logprob.
    ``repetition_penalty`` (> 0, 1 = off), ``frequency_penalty`` and ``presence_penalty``
    (each in [-2, 2], 0 = off) follow vLLM (``penalties.py``). ``logit_bias`` (a mapping or
    pairs of token id and bias in [-100, 100], at most :data:`MAX_LOGIT_BIAS`; stored as sorted
    pairs) is added to the raw logits first, as OpenAI's. ``stop`` and
    ``stop_token_ids`` accept any sequence (a bare string counts as one stop string) and
    are stored as tuples. Any invalid value raises ``ValueError`` naming the parameter.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        # Frozen dataclass: normalised values are written back with object.__setattr__.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        temperature = _as_real("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        put("temperature", temperature)

        top_p = _as_real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        put("top_p", top_p)

        top_k = _as_int("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {top_k}")
        put("top_k", min(top_k, _TOP_K_MAX))

        min_p = _as_real("min_p", self.min_p)
        if not 0 <= min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        put("min_p", min_p)

        if self.seed is not None:
            seed = _as_int("seed", self.seed)
            if not _SEED_MIN <= seed <= _SEED_MAX:
                raise ValueError(f"seed must be in [{_SEED_MIN}, {_SEED_MAX}], got {seed}")
            put("seed", seed)

        if self.max_tokens is not None:
            max_tokens = _as_int("max_tokens", self.max_tokens)
            if max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
            put("max_tokens", max_tokens)

        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Sequence):
            raise ValueError(f"stop must be a string or a sequence of strings, got {stop!r}")
        for s in stop:
            if not isinstance(s, str) or not s:
                # An empty stop string would match before the first token.
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        put("stop", tuple(stop))

        stop_ids = self.stop_token_ids
        if not isinstance(stop_ids, Sequence) or isinstance(stop_ids, str):
            raise ValueError(f"stop_token_ids must be a sequence of integers, got {stop_ids!r}")
        ids = tuple(_as_int("stop_token_ids", t) for t in stop_ids)
        if any(t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {list(ids)}")
        put("stop_token_ids", ids)

        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

        if self.logprobs is not None:
            logprobs = _as_int("logprobs", self.logprobs)
            if not 0 <= logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
            put("logprobs", logprobs)

        repetition = _as_real("repetition_penalty", self.repetition_penalty)
        if repetition <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        put("repetition_penalty", repetition)
        for name in ("frequency_penalty", "presence_penalty"):
            value = _as_real(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
            put(name, value)

        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, dict) else list(bias)
        if len(pairs) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}"
            )
        checked = {}
        for pair in pairs:
            if not isinstance(pair, Sequence) or len(pair) != 2:
                raise ValueError(f"logit_bias must map token ids to biases, got {pair!r}")
            token = _as_int("logit_bias", pair[0])
            value = _as_real("logit_bias", pair[1])
            if token < 0 or not -100 <= value <= 100:
                raise ValueError(
                    f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {pair!r}"
                )
            checked[token] = value
        put("logit_bias", tuple(sorted(checked.items())))

    @property
    def greedy(self) -> bool:
        """True when the request decodes by argmax and so consumes no randomness
        (temperature below :data:`SAMPLING_EPS`, or ``top_k == 1``)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """True when a penalty is on: the row's draws depend on what it has said."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def derived_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed`` (``n`` > 1): distinct
    per choice, reproducible, and always in the range ``manual_seed`` takes (it wraps)."""
    return (seed + index) % 2**64 if index else seed


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """Return a ``torch.Generator`` on ``device`` seeded with ``seed``, or None if unseeded.

    ``None`` tells :meth:`Sampler.sample` to draw that row from torch's global RNG. The
    stream of a seed depends on the device type (CPU and CUDA generators differ), so a
    seeded request is reproducible for a given device, not across devices.
    """
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


# --------------------------------------------------------------------- pure helpers
#
# All helpers take a [B, V] float tensor and per-row settings (a tensor or a sequence of
# length B) and never modify their input: they return a new tensor, or the input itself
# when no row uses the filter. "Masked" means set to -inf, so that softmax gives the
# token probability exactly 0.


def _per_row(
    values: torch.Tensor | Sequence[float] | Sequence[int], like: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    out = torch.as_tensor(values, dtype=dtype, device=like.device).reshape(-1)
    if out.numel() != like.shape[0]:
        raise ValueError(f"expected {like.shape[0]} per-row values, got {out.numel()}")
    return out


def apply_temperature(
    logits: torch.Tensor, temperature: torch.Tensor | Sequence[float]
) -> torch.Tensor:
    """Divide each row by its temperature (all must be > 0) after subtracting the row max.

    Subtracting the max first leaves the distribution unchanged but keeps a tiny
    temperature from overflowing to ``inf - inf = nan``: the top logit becomes 0 and
    the rest at worst ``-inf``.
    """
    t = _per_row(temperature, logits, torch.float32)
    if bool((t <= 0).any()):
        raise ValueError("apply_temperature needs temperatures > 0 (greedy rows are argmax)")
    logits = logits.float()
    return (logits - logits.amax(dim=-1, keepdim=True)) / t.unsqueeze(1)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Mask every entry below its row's k-th largest value.

    Rows with ``k <= 0`` or ``k >= V`` are untouched. Entries tied with the k-th value
    are kept (as HF and vLLM do), so a row may keep more than k tokens.
    """
    vocab = logits.shape[-1]
    k = _per_row(top_k, logits, torch.long)
    active = (k > 0) & (k < vocab)
    if not bool(active.any()):
        return logits
    kmax = int(k[active].max())
    top_values = logits.topk(kmax, dim=-1).values  # sorted descending
    kth = top_values.gather(1, (k.clamp(1, kmax) - 1).unsqueeze(1))
    # Inactive rows get a -inf threshold, which masks nothing.
    kth = torch.where(active.unsqueeze(1), kth, torch.full_like(kth, _NEG_INF))
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of most likely tokens whose mass >= p.

    Walking the row's softmax in descending order, a token is kept while the mass of
    the tokens before it is < p (so the most likely token always survives). Tokens tied
    in probability with the last kept token are kept too, which makes the result
    independent of sort order. Rows with ``p >= 1`` are untouched (a float cumsum can
    fall short of 1, which would otherwise drop the tail).
    """
    p = _per_row(top_p, logits, torch.float32)
    active = p < 1
    if not bool(active.any()):
        return logits
    probs = logits.float().softmax(dim=-1)
    # Only unmasked entries carry mass. After top-k (the common case: Qwen's defaults set
    # both) that is a handful per row, and a top-n over them gives the same sorted prefix
    # as a full sort of the vocabulary at a fraction of the cost.
    live = int((torch.isfinite(logits).sum(dim=-1) * active).max())
    if live < logits.shape[-1] // 2:
        sorted_probs = probs.topk(max(live, 1), dim=-1).values
    else:
        sorted_probs = probs.sort(dim=-1, descending=True).values
    cumulative = sorted_probs.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    keep_count = (mass_before < p.unsqueeze(1)).sum(dim=-1).clamp_min(1)
    threshold = sorted_probs.gather(1, (keep_count - 1).unsqueeze(1))
    mask = (probs < threshold) & active.unsqueeze(1)
    return logits.masked_fill(mask, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability.

    Computed as ``exp(logit - max_logit) < min_p``, which equals the probability ratio
    and does not need a softmax. Because it is a ratio to the top token (which no filter
    removes), it does not matter whether earlier filters renormalised. Rows with
    ``min_p == 0`` are untouched.
    """
    m = _per_row(min_p, logits, torch.float32)
    active = m > 0
    if not bool(active.any()):
        return logits
    relative = torch.exp(logits.float() - logits.float().amax(dim=-1, keepdim=True))
    return logits.masked_fill(relative < m.unsqueeze(1), _NEG_INF)


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` with each row's ``logit_bias`` added (the input itself when no row has one).

    Ids past the row's width are the caller's to refuse (the server checks them against the
    vocabulary); here they raise IndexError, failing that row's draw alone."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    r = [i for i in rows for _ in params[i].logit_bias]
    ids = [t for i in rows for t, _ in params[i].logit_bias]
    if max(ids) >= logits.shape[-1]:
        raise IndexError(f"logit_bias names token {max(ids)} of {logits.shape[-1]} logits")
    values = [v for i in rows for _, v in params[i].logit_bias]
    out = logits.clone()
    dev = logits.device
    out.index_put_(
        (torch.tensor(r, device=dev), torch.tensor(ids, device=dev)),
        torch.tensor(values, dtype=out.dtype, device=dev),
        accumulate=True,
    )
    return out


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | Sequence[int] | None = None,
    top_p: torch.Tensor | Sequence[float] | None = None,
    min_p: torch.Tensor | Sequence[float] | None = None,
) -> torch.Tensor:
    """Apply top-k, then top-p, then min-p masking (``None`` skips a filter).

    ``logits`` should already be temperature-scaled: top-p looks at the softmax of what
    it is given, so the order matters (top-p after top-k sees the top-k renormalised
    distribution).
    """
    if top_k is not None:
        logits = apply_top_k(logits, top_k)
    if top_p is not None:
        logits = apply_top_p(logits, top_p)
    if min_p is not None:
        logits = apply_min_p(logits, min_p)
    return logits


def _processed_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled, filtered float32 logits for rows that are all non-greedy."""
    scaled = apply_temperature(logits, [p.temperature for p in params])
    # Passing None for a filter no row uses skips its work (top-p needs a full sort).
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    return apply_top_k_top_p_min_p(
        scaled,
        top_k if any(k > 0 for k in top_k) else None,
        top_p if any(x < 1 for x in top_p) else None,
        min_p if any(x > 0 for x in min_p) else None,
    )


def _adjusted(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None] | None,
) -> torch.Tensor:
    """The raw float32 logits with each row's logit_bias, then its penalties (with a history)."""
    logits = apply_logit_bias(logits, params)
    return logits if histories is None else apply_penalties(logits, params, histories)


def sampling_probs(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None] | None = None,
) -> torch.Tensor:
    """The distribution :meth:`Sampler.sample` draws each row from, as float32 ``[B, V]``.

    Greedy rows are one-hot at their argmax (lowest id among ties). Meant for tests,
    debugging and analysis; the sampler itself never materialises the greedy one-hots.
    """
    if logits.dim() != 2 or len(params) != logits.shape[0]:
        raise ValueError("sampling_probs needs [B, V] logits and B params")
    logits = _adjusted(logits.float(), params, histories)
    out = torch.zeros_like(logits)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        out[rows, logits[rows].argmax(dim=-1)] = 1.0
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        sub = _processed_logits(logits.index_select(0, rows), [params[i] for i in sampled])
        out[rows] = sub.softmax(dim=-1)
    return out


# -------------------------------------------------------------------------- sampler


@dataclass
class SampleResult:
    """What :meth:`Sampler.sample` chose for each row of the batch.

    ``token_ids[i]`` is row i's token; ``token_ids_tensor`` holds the same ids as an
    int64 ``[B]`` tensor on the logits' device (to feed the next step without a host
    round trip). ``logprobs`` is None unless some row asked for logprobs; then it holds,
    for every row, the chosen token's log-probability under the *raw* model
    distribution (``log_softmax`` of the unmodified logits, before temperature and
    filters). ``top_logprobs`` is likewise None unless some row asked; then row i holds
    its ``params[i].logprobs`` most likely ``(token_id, raw_logprob)`` pairs, sorted by
    descending logprob (ties by ascending id), and is empty for rows that asked for none.
    """

    token_ids: list[int]
    token_ids_tensor: torch.Tensor
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


class Sampler:
    """Chooses one token per row from ``[B, V]`` logits under per-row SamplingParams.

    Holds no state between calls; all randomness comes from the generators passed in.
    Non-greedy rows draw with the exponential race: ``argmax(probs / E)`` with
    ``E ~ Exp(1)`` i.i.d. per token, which picks token j with probability exactly
    ``probs[j] / sum(probs)`` (so renormalisation after masking is implicit). Every
    non-greedy row consumes exactly V exponential draws per call from its own generator
    and greedy rows consume none, so a request's draws depend only on its own seed and
    step count, not on the batch it shares.
    """

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        histories: Sequence[TokenHistory | None] | None = None,
    ) -> SampleResult:
        """Sample one token per row.

        ``logits`` is ``[B, V]`` in any float dtype (upcast to float32 internally);
        ``params[i]``, ``generators[i]`` and ``histories[i]`` belong to row i. A generator
        may live on a different device from the logits (its noise is then copied over);
        ``None`` draws from torch's global RNG for the logits' device. A row's penalties
        apply only with its history (None: the row has said nothing). Rows whose logits are
        all -inf or contain NaN are the caller's bug and give an unspecified token.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
        batch, vocab = logits.shape
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"got {batch} logit rows, {len(params)} params and {len(generators)} generators"
            )
        if histories is not None and len(histories) != batch:
            raise ValueError(f"got {batch} logit rows and {len(histories)} histories")
        raw = logits.float()  # logprobs are reported under the raw distribution
        logits = _adjusted(raw, params, histories)

        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled) == batch:
            # All rows sample (the common case): no gather/scatter copies needed.
            probs = _processed_logits(logits, params).softmax(dim=-1)
            noise = _exponential_noise(generators, vocab, logits.device)
            token_ids = (probs / noise).argmax(dim=-1)
        else:
            # Argmax for every row answers the greedy ones (torch.argmax returns the
            # first maximal index); sampled rows are overwritten.
            token_ids = logits.argmax(dim=-1)
            if sampled:
                rows = torch.tensor(sampled, device=logits.device)
                sub = logits.index_select(0, rows)
                probs = _processed_logits(sub, [params[i] for i in sampled]).softmax(dim=-1)
                noise = _exponential_noise([generators[i] for i in sampled], vocab, logits.device)
                token_ids[rows] = (probs / noise).argmax(dim=-1)

        result = SampleResult(token_ids=token_ids.tolist(), token_ids_tensor=token_ids)
        if any(p.logprobs is not None for p in params):
            raw = torch.log_softmax(raw, dim=-1)
            result.logprobs = raw.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
            result.top_logprobs = _top_logprobs(raw, params)
        return result


def _exponential_noise(
    generators: Sequence[torch.Generator | None], vocab: int, device: torch.device
) -> torch.Tensor:
    """One row of Exp(1) noise per generator, each row drawn only from its generator."""
    noise = torch.empty((len(generators), vocab), dtype=torch.float32, device=device)
    unseeded = []
    for j, gen in enumerate(generators):
        if gen is None:
            unseeded.append(j)
            continue
        # The same number of draws every step, so the request's stream advances
        # identically whatever the batch. Generators are device-bound: one on another
        # device than the logits draws there and the row is copied over.
        if gen.device == device:
            noise[j].exponential_(generator=gen)
        else:
            row = torch.empty(vocab, dtype=torch.float32, device=gen.device)
            noise[j].copy_(row.exponential_(generator=gen))
    if unseeded:
        rows = torch.tensor(unseeded, device=device)
        noise[rows] = torch.empty(
            (len(unseeded), vocab), dtype=torch.float32, device=device
        ).exponential_()
    # Exp(1) samplers can return exactly 0 on some backends; 0/0 would be NaN and
    # argmax picks NaN, i.e. possibly a masked token. Clamping keeps masked tokens at 0.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def _top_logprobs(
    raw: torch.Tensor, params: Sequence[SamplingParams]
) -> list[list[tuple[int, float]]]:
    """Top ``params[i].logprobs`` (id, logprob) pairs per row; [] for rows asking none."""
    out: list[list[tuple[int, float]]] = [[] for _ in params]
    wanted = [i for i, p in enumerate(params) if p.logprobs]
    if not wanted:
        return out
    n = min(max(params[i].logprobs or 0 for i in wanted), raw.shape[-1])
    rows = torch.tensor(wanted, device=raw.device)
    values, ids = raw.index_select(0, rows).topk(n, dim=-1)
    for r, vals, toks in zip(wanted, values.tolist(), ids.tolist(), strict=True):
        # topk's order among equal values is unspecified; make it lowest id first.
        pairs = sorted(zip(toks, vals, strict=True), key=lambda t: (-t[1], t[0]))
        out[r] = pairs[: params[r].logprobs]
    return out
