"""Generated request bodies against a real `headstart serve`: only 2xx and 4xx ever come back.

Hypothesis builds bodies field by field, each field either a plausible value or an arbitrary
JSON value (wrong types, huge and tiny numbers, lone surrogates, control-token text, nesting).
Every answer must be a 2xx or a 4xx in the OpenAI shape, streams must never carry an error
chunk, the server must log no traceback, and afterwards it must still answer a greedy request
with the tokens it gave before.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_proc import serving


@pytest.fixture(scope="module")
def server():
    # --max-tokens keeps every generated request short, whatever it asks for.
    with serving(
        "--parallel",
        "4",
        "--context",
        "128",
        "--max-tokens",
        "4",
        "--max-queue",
        "16",
        "--max-body-mib",
        "1",
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


_odd_text = st.sampled_from(
    [
        "",
        "\ud800",
        "a\udfffb",
        "<|im_start|>system\n",
        "<think>",
        "</tool_call>",
        "\x00",
        "\u202e",
        "x" * 3000,
        "{{ 7*7 }}",
        "{% raw %}",
        "headstart-default",
    ]
)
_text = st.one_of(st.text(max_size=24), _odd_text)
_number = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, 1, -1, 2**63, 2**64, 2**64 - 1, -(2**63) - 1]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e-46, 5e-324, 1e308, -0.0, 2.0000001, 1e-5]),
)
_leaf = st.one_of(st.none(), st.booleans(), _number, _text)
_json = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=10,
)


def _field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(plausible, plausible, _json)


_COMMON = {
    "model": _field(st.sampled_from(["headstart-default", "other"])),
    "max_tokens": _field(st.integers(min_value=-2, max_value=10)),
    "temperature": _field(st.floats(min_value=0, max_value=2)),
    "top_p": _field(st.floats(min_value=0, max_value=1)),
    "top_k": _field(st.integers(min_value=-2, max_value=2**64)),
    "min_p": _field(st.floats(min_value=0, max_value=1)),
    "seed": _field(st.integers(min_value=-(2**64), max_value=2**65)),
    "stop": _field(st.lists(_text, max_size=3)),
    "stop_token_ids": _field(st.lists(st.integers(min_value=-1, max_value=2**40), max_size=3)),
    "n": _field(st.integers(min_value=0, max_value=20)),
    "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "ignore_eos": _field(st.booleans()),
    "return_tokens_as_token_ids": _field(st.booleans()),
    "draft": _field(st.booleans()),
}
_call = st.fixed_dictionaries(
    {
        "function": st.fixed_dictionaries(
            {"name": _text, "arguments": st.one_of(_text, st.dictionaries(_text, _leaf))}
        )
    }
)
_message = st.fixed_dictionaries(
    {
        "role": _field(st.sampled_from(["system", "user", "assistant", "tool", "developer"])),
        "content": _field(_text),
    },
    optional={
        "name": _field(_text),
        "tool_call_id": _field(_text),
        "reasoning_content": _field(_text),
        "tool_calls": _field(st.lists(_call, max_size=2)),
    },
)
_tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": _text}, optional={"description": _text, "parameters": _json}
        ),
    }
)

CHAT = st.fixed_dictionaries(
    {"messages": _field(st.lists(_message, min_size=1, max_size=3))},
    optional={
        **_COMMON,
        "tools": _field(st.lists(_tool, max_size=2)),
        "tool_choice": _json,
        "chat_template_kwargs": _field(
            st.dictionaries(
                st.sampled_from(["enable_thinking", "self", "x", "_y", "tools", "a b"]), _leaf
            )
        ),
        "logprobs": _field(st.booleans()),
        "top_logprobs": _field(st.integers(-1, 30)),
        "max_completion_tokens": _field(st.integers(-1, 8)),
    },
)
COMPLETION = st.fixed_dictionaries(
    {
        "prompt": _field(
            st.one_of(
                _text, st.lists(st.integers(-1, 300_000), max_size=6), st.lists(_text, max_size=3)
            )
        )
    },
    optional={**_COMMON, "logprobs": _field(st.integers(-1, 25)), "echo": _field(st.booleans())},
)


def _check(http, path: str, body: dict) -> None:
    raw = json.dumps(body)  # ensure_ascii: lone surrogates travel as \ud800 escapes
    with http.stream("POST", path, content=raw, headers={"Content-Type": "application/json"}) as r:
        text = r.read().decode()
    assert r.status_code < 500, (r.status_code, text[:500], raw[:500])
    if r.status_code >= 400:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"}
    elif text.startswith("data: "):
        assert '"error"' not in text, text[:500]
        assert text.rstrip().endswith("data: [DONE]")


def _greedy(http) -> list:
    r = http.post(
        "/v1/completions",
        json={"prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


_SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "path,bodies",
    [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)],
    ids=["chat", "completions"],
)
def test_generated_bodies(server, http, path, bodies):
    before = _greedy(http)

    @_SETTINGS
    @given(bodies)
    def run(body):
        _check(http, path, body)

    run()
    assert _greedy(http) == before
    assert "Traceback" not in server.output()


@_SETTINGS
@given(st.one_of(_json, st.binary(max_size=64)))
def test_generated_whole_bodies_never_break_the_parser(body):
    """The parser alone (no server): any JSON value or bytes is a request or a 400."""
    from headstart.server import protocol as P

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    for parse in (P.parse_chat_request, P.parse_completion_request):
        try:
            parse(raw)
        except P.APIError as e:
            assert e.status == 400
