"""Prefill scenarios (``headstart bench --scenario NAME``): what each one sends, exactly.

Job: the scenario settings (:class:`Scenario`), the token-id prompts, and the requests of
every repeat in the order they are sent (:func:`repeat_steps`). Pure: the runner sends what
this module lists, and ``bench check`` rebuilds the same list from the receipt's config to
verify every request.

Prompts are lists of token ids sent to ``/v1/completions`` (OpenAI's API and vLLM accept
them), so a prompt's length is exact whatever the server's tokenizer. Ids come from
``[token_lo, token_hi)``, a range below any real vocabulary (the default, 1000..4000, also
fits the embedded default model's 4096 ordinary tokens). Each prompt starts with
:data:`SALT_TOKENS` ids drawn from a key naming the run, arm, order, repeat and request, so a
server that outlives a run (a URL arm) finds no cached prefix; the rest is a filler shared
by all prompts, so prompts of one length differ only in their salt.

The scenarios, per repeat (``repeats`` of them; ``burst`` sends one more, its first):

- ``long``: one new prompt of ``prompt_tokens``.
- ``burst``: ``streams`` new prompts of ``prompt_tokens``, sent together (rep 0 is the run's
  first burst on this arm and order, where a server may still compile shapes).
- ``turn``: a history of ``history_tokens`` (warms the prompt cache; not reported), then the
  same history plus ``turn_tokens`` new ones (the new turn), then a history plus the same
  new tokens under a fresh salt (the cold comparison).
- ``beside``: ``streams`` decoders (short prompts, ``decode_tokens`` each) start together;
  once each has streamed :data:`DECODING_DELTAS` deltas, a new prompt of ``prompt_tokens``
  arrives beside them.
- ``agent``: a growing conversation of ``turns`` turns, one after another. Turn 1 is a new
  prompt of ``prompt_tokens`` (the system prompt with its tools); turn k+1 is turn k's prompt,
  then the token ids the server generated for it, then a tool result of ``turn_tokens`` new
  ids. Then the last turn's prompt under a fresh salt (the cold reference). A turn's prompt
  depends on the previous answer, so the steps are not known in advance: :func:`agent_turn`
  and :func:`agent_cold` build each request from the previous one and its answer, and
  :func:`agent_steps` rebuilds a whole run from the answers (for ``bench check``).
- ``return``: a conversation's history of ``history_tokens`` (primes the prompt cache; not
  reported), then ``others`` other conversations, each a history of ``history_tokens`` under
  its own salt, sent one after another (so the server's cache sees them in a known order and
  the first conversation is the least recently used: a server whose device tier holds fewer
  than ``others + 1`` histories has moved it to a slower tier or dropped it; not reported),
  then the first conversation comes back: its history plus ``turn_tokens`` new ones (the
  return), then the same length under a fresh salt (the cold comparison).

Non-goals: sending (``scenario_run.py``) and summarising (``scenario_summary.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from headstart.bench.workload import Sampling
from headstart.errors import HeadstartError

SCENARIOS = ("long", "burst", "turn", "beside", "agent", "return")
#: Ids at the front of every prompt that come from its salt key (the rest is shared filler).
SALT_TOKENS = 8
#: Prompt length of each decoding stream of ``beside`` (short: their prefill is not measured).
DECODER_PROMPT_TOKENS = 32
#: Deltas every decoder of ``beside`` has streamed before the long prompt is sent: past its
#: own prefill and first steps, so it is decoding when the long prompt arrives.
DECODING_DELTAS = 4
#: Output tokens of the measured prompts unless ``--max-tokens`` says otherwise: TTFT needs
#: one, a few more show the stream went on.
SCENARIO_MAX_TOKENS = 8
#: ``agent``'s answer length per turn unless ``--max-tokens`` says otherwise: a short tool
#: call, long enough that the answer is a real part of the next prompt.
AGENT_MAX_TOKENS = 64

#: The sizes each scenario uses besides ``repeats`` and the token range, with its defaults
#: where they differ from :class:`Scenario`'s.
SIZES: dict[str, dict[str, int | None]] = {
    "long": {"prompt_tokens": 8192},
    "burst": {"prompt_tokens": 31, "streams": 16},
    "turn": {"history_tokens": None, "turn_tokens": None},
    "beside": {"prompt_tokens": 8192, "streams": 8, "decode_tokens": None},
    # One repeat by default: twenty turns of a growing prompt take long already.
    "agent": {"turns": 20, "prompt_tokens": 2000, "turn_tokens": 500, "repeats": 1},
    "return": {"history_tokens": 4000, "turn_tokens": None, "others": None},
}


@dataclass(frozen=True)
class Scenario:
    """One scenario and its sizes (see the module docstring for what each size means)."""

    name: str
    prompt_tokens: int = 8192
    streams: int = 1
    history_tokens: int = 2000
    turn_tokens: int = 30
    decode_tokens: int = 512
    turns: int = 20
    others: int = 30
    repeats: int = 3
    token_lo: int = 1000
    token_hi: int = 4000

    @property
    def reps(self) -> int:
        """Repeats sent: ``burst`` adds its first burst (rep 0) before the ``repeats``."""
        return self.repeats + 1 if self.name == "burst" else self.repeats

    @property
    def width(self) -> int:
        """Requests in flight at once, so connections to hold open."""
        return {"burst": self.streams, "beside": self.streams + 1}.get(self.name, 1)

    def as_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def default_max_tokens(name: str) -> int:
    """The output length of the measured prompts of scenario ``name`` without ``--max-tokens``."""
    return AGENT_MAX_TOKENS if name == "agent" else SCENARIO_MAX_TOKENS


def _flag(size: str) -> str:
    return "--" + size.replace("_", "-")


def make_scenario(name: str, **given: int | None) -> Scenario:
    """The scenario ``name`` with its defaults, overridden by the ``given`` sizes that are
    not None. Raises HeadstartError for a size the scenario does not use (so no option is
    silently ignored) and naming the first size out of range."""
    if name not in SCENARIOS:
        raise HeadstartError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    given = {k: v for k, v in given.items() if v is not None}
    common = ("repeats", "token_lo", "token_hi")
    unused = [_flag(k) for k in given if k not in SIZES[name] and k not in common]
    if unused:
        raise HeadstartError(f"{', '.join(unused)}: not used by --scenario {name}")
    defaults = {k: v for k, v in SIZES[name].items() if v is not None}
    sc = Scenario(name, **{**defaults, **given})
    floors = {
        "streams": 1,
        "turn_tokens": 1,
        "decode_tokens": DECODING_DELTAS + 1,
        # Turns 2.. are what agent measures (their TTFT, what they found cached).
        "turns": 2,
        # No others is a control: the return then restores from wherever a turn does.
        "others": 0,
        "repeats": 1,
        "token_lo": 0,
    }
    # Only the prompt sizes the scenario sends must hold a salt.
    if name in ("long", "burst", "beside", "agent"):
        floors["prompt_tokens"] = SALT_TOKENS
    if name in ("turn", "return"):
        floors["history_tokens"] = SALT_TOKENS
    for key, low in floors.items():
        if getattr(sc, key) < low:
            raise HeadstartError(f"{_flag(key)} must be at least {low} for --scenario {name}")
    if sc.token_hi - sc.token_lo < 16:
        raise HeadstartError("--token-range LO:HI needs HI - LO >= 16 so salts stay distinct")
    return sc


def token_stream(seed: str, n: int, lo: int, hi: int) -> list[int]:
    """``n`` token ids in ``[lo, hi)``, a pure function of ``seed``: sha256 in counter mode,
    so every machine and Python version (and ``bench check``) builds the same prompt."""
    out: list[int] = []
    block = 0
    while len(out) < n:
        digest = hashlib.sha256(f"{seed}#{block}".encode()).digest()
        out += [lo + int.from_bytes(digest[i : i + 4], "big") % (hi - lo) for i in range(0, 32, 4)]
        block += 1
    return out[:n]


def salted_prompt(key: str, n: int, lo: int, hi: int) -> list[int]:
    """A prompt of exactly ``n`` ids (``n >= SALT_TOKENS``): the salt of ``key`` first (so no
    cached prefix of another prompt can match past it), then the shared filler."""
    if n < SALT_TOKENS:
        raise ValueError(f"a salted prompt needs at least {SALT_TOKENS} tokens, not {n}")
    return token_stream("salt " + key, SALT_TOKENS, lo, hi) + token_stream(
        "filler", n - SALT_TOKENS, lo, hi
    )


def salt_base(run_id: str, arm: str, order: int, scenario: str) -> str:
    """The part of every salt key that names one arm in one order of one run. The arm is in
    it so that two arms that are secretly one server still see only new prompts."""
    return f"bench {run_id} {arm} o{order} {scenario}"


@dataclass(frozen=True)
class Request:
    """One request of a repeat. ``role``: long | burst | history | turn | cold | decoder |
    agent | other | return. ``stream``: the request's index within its step; for ``agent``
    turns, the turn (0-based); for ``return``'s others, the conversation (0-based).
    ``token_ids``: ask the server for the ids it generates (``agent``, whose next prompt
    appends them)."""

    rep: int
    role: str
    stream: int
    ids: tuple[int, ...]
    max_tokens: int
    token_ids: bool = False


def repeat_steps(sc: Scenario, max_tokens: int, base: str, rep: int) -> list[list[Request]]:
    """The requests of repeat ``rep``, as steps sent one after another; the requests of a
    step are sent together (in ``beside``, the ``long`` one once the decoders decode).
    ``max_tokens`` is the measured prompts' output length; ``base`` is :func:`salt_base`.
    Not for ``agent``, whose prompts depend on the answers (:func:`agent_steps`)."""
    if sc.name == "agent":
        raise ValueError("agent's steps depend on the answers: use agent_steps")
    lo, hi = sc.token_lo, sc.token_hi

    def prompt(role: str, stream: int, n: int) -> tuple[int, ...]:
        return tuple(salted_prompt(f"{base} r{rep} {role} {stream}", n, lo, hi))

    def req(role: str, stream: int, ids: tuple[int, ...], tokens: int = max_tokens) -> Request:
        return Request(rep, role, stream, ids, tokens)

    if sc.name == "long":
        return [[req("long", 0, prompt("long", 0, sc.prompt_tokens))]]
    if sc.name == "burst":
        return [[req("burst", s, prompt("burst", s, sc.prompt_tokens)) for s in range(sc.streams)]]
    if sc.name == "turn":
        # The turn extends the history by the filler that follows it, and the cold prompt is
        # the same tokens under another salt: the two differ only in what the cache holds.
        history = prompt("history", 0, sc.history_tokens)
        turn = prompt("history", 0, sc.history_tokens + sc.turn_tokens)
        assert turn[: len(history)] == history
        cold = prompt("cold", 0, sc.history_tokens + sc.turn_tokens)
        return [[req("history", 0, history)], [req("turn", 0, turn)], [req("cold", 0, cold)]]
    if sc.name == "return":
        return _return_steps(sc, prompt, req)
    assert sc.name == "beside", sc.name
    decoders = [
        req("decoder", s, prompt("decoder", s, DECODER_PROMPT_TOKENS), sc.decode_tokens)
        for s in range(sc.streams)
    ]
    return [[*decoders, req("long", 0, prompt("long", 0, sc.prompt_tokens))]]


def _return_steps(
    sc: Scenario,
    prompt: Callable[[str, int, int], tuple[int, ...]],
    req: Callable[[str, int, tuple[int, ...]], Request],
) -> list[list[Request]]:
    """``return``'s steps, one request each: the history, the others, the return, the cold
    prompt. As in ``turn``, the return extends the history by the filler that follows it and
    the cold prompt is the same tokens under another salt; every other conversation shares
    the filler too, behind its own salt, so none of it can serve the return."""
    history = prompt("history", 0, sc.history_tokens)
    back = prompt("history", 0, sc.history_tokens + sc.turn_tokens)
    assert back[: len(history)] == history
    cold = prompt("cold", 0, sc.history_tokens + sc.turn_tokens)
    others = [[req("other", k, prompt("other", k, sc.history_tokens))] for k in range(sc.others)]
    return [[req("history", 0, history)], *others, [req("return", 0, back)], [req("cold", 0, cold)]]


def all_steps(sc: Scenario, max_tokens: int, base: str) -> list[list[Request]]:
    """Every step of every repeat of one arm in one order, in sending order."""
    return [step for rep in range(sc.reps) for step in repeat_steps(sc, max_tokens, base, rep)]


def requests_per_arm(sc: Scenario) -> int:
    """Requests one arm gets in one order (the base does not change the count)."""
    if sc.name == "agent":
        return sc.reps * (sc.turns + 1)  # every turn and the cold reference
    return sum(len(step) for step in all_steps(sc, 1, ""))


def tool_result(turn: int, n: int, lo: int, hi: int) -> tuple[int, ...]:
    """The ``n`` new ids that end agent turn ``turn`` (>= 1): the same in every run, as the
    salt at the front of the conversation already makes the whole prompt new."""
    return tuple(token_stream(f"tool result {turn}", n, lo, hi))


def agent_turn(
    sc: Scenario,
    max_tokens: int,
    base: str,
    rep: int,
    previous: Request | None = None,
    answer: tuple[int, ...] = (),
) -> Request:
    """The next turn of ``agent`` repeat ``rep``: turn 0 (``previous`` None) is a salted
    prompt of ``sc.prompt_tokens``; after it, ``previous``'s prompt, ``answer`` (the ids the
    server generated for ``previous``) and the tool result of ``sc.turn_tokens`` ids, so the
    prompt grows by exactly ``len(answer) + sc.turn_tokens``."""
    lo, hi = sc.token_lo, sc.token_hi
    if previous is None:
        ids = tuple(salted_prompt(f"{base} r{rep} agent", sc.prompt_tokens, lo, hi))
        return Request(rep, "agent", 0, ids, max_tokens, token_ids=True)
    turn = previous.stream + 1
    ids = previous.ids + tuple(answer) + tool_result(turn, sc.turn_tokens, lo, hi)
    return Request(rep, "agent", turn, ids, max_tokens, token_ids=True)


def agent_cold(sc: Scenario, max_tokens: int, base: str, last: Request) -> Request:
    """The cold reference of ``last``'s repeat: ``last``'s prompt with a fresh salt in place
    of the conversation's, so nothing of it can be cached; token ids asked for as in every
    turn, so the two bodies differ only in their prompts."""
    salt = token_stream(
        f"salt {base} r{last.rep} agent cold", SALT_TOKENS, sc.token_lo, sc.token_hi
    )
    ids = tuple(salt) + last.ids[SALT_TOKENS:]
    return Request(last.rep, "cold", 0, ids, max_tokens, token_ids=True)


def agent_steps(
    sc: Scenario,
    max_tokens: int,
    base: str,
    answer_of: Callable[[Request], tuple[int, ...] | None],
) -> list[list[Request]]:
    """Every step (one request each) of every repeat of ``agent`` for one arm in one order,
    in sending order, given ``answer_of(turn)``: the ids the server generated for a turn, or
    None where it has none (the turn failed or is missing), which ends that repeat there,
    cold reference included, as it ended the run's."""
    steps: list[list[Request]] = []
    for rep in range(sc.reps):
        previous, answer = None, ()
        for _ in range(sc.turns):
            req = agent_turn(sc, max_tokens, base, rep, previous, answer)
            steps.append([req])
            got = answer_of(req)
            if got is None:
                break
            previous, answer = req, got
        else:
            assert previous is not None  # turns >= 1
            steps.append([agent_cold(sc, max_tokens, base, previous)])
    return steps


def token_body(req: Request, sampling: Sampling) -> dict[str, Any]:
    """The streamed ``/v1/completions`` request, without ``model`` (each arm adds its own):
    the token ids as ``prompt``, a fixed output length with ``ignore_eos``, a usage chunk,
    and with ``req.token_ids`` the generated ids as vLLM and headstart return them
    (``logprobs`` with ``return_tokens_as_token_ids``: each token as ``"token_id:N"``)."""
    body: dict[str, Any] = {
        "prompt": list(req.ids),
        "max_tokens": req.max_tokens,
        "temperature": sampling.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if req.token_ids:
        body.update(logprobs=0, return_tokens_as_token_ids=True)
    body.update(sampling.extra)
    return body
