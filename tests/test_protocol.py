"""Tests for headstart.server.protocol: parsing, validation, prompts, sampling, responses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headstart.sampling import SamplingParams
from headstart.server.protocol import (
    MAX_STOP,
    SSE_DONE,
    APIError,
    _load_object,
    chat_choice,
    chat_chunk,
    chat_completion_response,
    chat_logprobs,
    chat_prompt_text,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    completion_prompts,
    completion_response,
    new_request_id,
    parse_chat_request,
    parse_completion_request,
    sampling_params,
    sse,
    usage_chunk,
    usage_info,
)
from headstart.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[1] / "src" / "headstart" / "default_model"
USER = [{"role": "user", "content": "hi"}]
DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR)


def chat(**body):
    body.setdefault("messages", USER)
    return parse_chat_request(json.dumps(body).encode())


def completion(**body):
    return parse_completion_request(json.dumps(body).encode())


def error_of(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    return info.value


# --------------------------------------------------------------------------- APIError


def test_api_error_body_and_defaults():
    err = APIError(400, "bad thing", param="temperature")
    assert err.body() == {
        "error": {
            "message": "bad thing",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }
    assert APIError(401, "no").type == "authentication_error"
    assert APIError(404, "no").type == "not_found_error"
    limited = APIError(429, "busy", headers={"Retry-After": "1"})
    assert limited.type == "rate_limit_exceeded" and limited.headers == {"Retry-After": "1"}
    assert APIError(503, "x").type == "server_error"
    assert APIError(400, "x", type="custom", code="c").body()["error"]["code"] == "c"


# ------------------------------------------------------------------------ bad bodies


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"{'a': 1}",
        b"\xff\xfe\xfa",
        b'{"n": NaN}',
        b'{"temperature": Infinity}',
        b"[" * 100_000,
    ],
)
def test_malformed_json_is_400(raw):
    for parse in (parse_chat_request, parse_completion_request):
        err = error_of(parse, raw)
        assert err.status == 400 and "JSON" in err.message


@pytest.mark.parametrize("raw", [b"[]", b"1", b'"text"', b"null"])
def test_body_must_be_object(raw):
    err = error_of(parse_chat_request, raw)
    assert err.status == 400 and "object" in err.message


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_p", "1"),
        ("top_k", -2),
        ("top_k", 1.5),
        ("min_p", -0.1),
        ("min_p", 2),
        ("n", 0),
        ("n", 17),
        ("n", "2"),
        ("n", 1.0),
        ("max_tokens", 0),
        ("max_tokens", "10"),
        ("max_completion_tokens", -1),
        ("seed", 1.5),
        ("seed", "7"),
        ("stream", "yes"),
        ("stream", 1),
        ("stop", 5),
        ("stop", ["ok", 3]),
        ("stop", [""]),
        ("stop", ["s"] * (MAX_STOP + 1)),
        ("logprobs", 1),
        ("top_logprobs", 21),
        ("top_logprobs", -1),
        ("model", 5),
        ("messages", "hello"),
        ("messages", []),
        ("tools", "x"),
        ("chat_template_kwargs", [1]),
        ("stop_token_ids", [-1]),
        ("ignore_eos", "false"),
        ("return_tokens_as_token_ids", 0),
        ("draft", "no"),
    ],
)
def test_chat_wrong_type_or_range(field, value):
    err = error_of(chat, **{field: value})
    assert err.status == 400
    assert err.param == field or err.param.startswith(f"{field}[")  # e.g. stop_token_ids[0]
    assert err.type == "invalid_request_error"


def test_top_logprobs_needs_logprobs():
    err = error_of(chat, top_logprobs=2)
    assert err.param == "top_logprobs"
    assert chat(top_logprobs=2, logprobs=True).num_logprobs == 2
    assert chat(logprobs=True).num_logprobs == 0
    assert chat().num_logprobs is None
    assert chat(top_logprobs=0).num_logprobs is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("logprobs", 21),
        ("logprobs", -1),
        ("logprobs", True),
        ("echo", True),
        ("echo", "no"),
        ("temperature", 3),
        ("n", 100),
    ],
)
def test_completion_wrong_type_or_range(field, value):
    err = error_of(completion, prompt="x", **{field: value})
    assert err.status == 400 and err.param == field


def test_missing_required_fields():
    assert error_of(parse_chat_request, b"{}").param == "messages"
    err = error_of(parse_completion_request, b'{"model": "m"}')
    assert err.param == "prompt" and "required" in err.message


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content"),
        (["hello"], "messages[0]"),
        (
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b", "name": 3}],
            "messages[1].name",
        ),
        (
            [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}],
                }
            ],
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            "messages[0].tool_calls[0].function.name",
        ),
    ],
)
def test_bad_messages(messages, param):
    err = error_of(chat, messages=messages)
    assert err.status == 400 and err.param == param


def test_error_message_does_not_echo_input():
    secret = "my secret prompt text"
    err = error_of(chat, messages=[{"role": "nobody", "content": secret}])
    assert secret not in err.message
    err = error_of(completion, prompt=[secret, 1])
    assert secret not in err.message


def test_unknown_fields_ignored_and_defaults():
    req = chat(
        logit_bias={"1": 2},
        user="u",
        response_format={},
        stream_options={"include_usage": True, "unknown": 1},
    )
    assert req.n == 1 and req.stream is False and req.stop == []
    assert req.include_usage is False  # only meaningful when streaming
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert chat(chat_template_kwargs=None).chat_template_kwargs == {}
    assert chat(draft=True).draft is True


def test_null_means_default():
    req = chat(
        n=None,
        stream=None,
        logprobs=None,
        temperature=None,
        stop=None,
        stream_options=None,
        tools=None,
        max_tokens=None,
        messages=[
            {"role": "assistant", "content": None, "name": None},
            {"role": "user", "content": "hi", "tool_calls": None},
        ],
    )
    assert req.n == 1 and req.stream is False and req.logprobs is False
    assert req.stop == [] and req.chat_template_kwargs == {}
    assert error_of(chat, messages=None).param == "messages"
    assert (
        error_of(chat, messages=[{"role": "tool", "content": None}]).param == "messages[0].content"
    )
    assert completion(prompt="x", logprobs=None, echo=None).num_logprobs is None


def test_reserved_template_kwargs_rejected():
    err = error_of(chat, chat_template_kwargs={"add_generation_prompt": False})
    assert err.param == "chat_template_kwargs"


def test_stop_normalised():
    assert chat(stop="END").stop == ["END"]
    assert chat(stop=["a", "b"]).stop == ["a", "b"]
    assert chat(stop=None).stop == []
    assert len(chat(stop=["s"] * MAX_STOP).stop) == MAX_STOP


# --------------------------------------------------------------------------- prompts


def test_completion_prompt_shapes(tok):
    one = tok.encode("Hello world")
    two = tok.encode("Bye")
    assert completion_prompts(tok, completion(prompt="Hello world")) == [one]
    assert completion_prompts(tok, completion(prompt=["Hello world", "Bye"])) == [one, two]
    assert completion_prompts(tok, completion(prompt=[5, 6, 7])) == [[5, 6, 7]]
    assert completion_prompts(tok, completion(prompt=[[5, 6], [7]])) == [[5, 6], [7]]


@pytest.mark.parametrize("prompt", ["", [], [""], ["ok", ""], [[]], [[1], []]])
def test_empty_prompt_is_400(tok, prompt):
    err = error_of(completion_prompts, tok, completion(prompt=prompt))
    assert err.status == 400 and err.param == "prompt"


@pytest.mark.parametrize(
    "prompt", [5, None, {"a": 1}, [1, "a"], [[1], "a"], [[1, "a"]], [True, 1], [1.5], [[1], [2.0]]]
)
def test_prompt_of_wrong_shape_is_400(prompt):
    err = error_of(completion, prompt=prompt)
    assert err.status == 400 and err.param == "prompt"


@pytest.mark.parametrize(
    "prompt, bad", [([1, 4105], 4105), ([[1], [99999999]], 99999999), ([-1], -1)]
)
def test_token_id_outside_vocab_is_400(tok, prompt, bad):
    assert tok.vocab_size == 4105
    err = error_of(completion_prompts, tok, completion(prompt=prompt))
    assert err.status == 400 and err.param == "prompt" and str(bad) in err.message
    # The last valid id is fine.
    assert completion_prompts(tok, completion(prompt=[tok.vocab_size - 1]))


def test_chat_prompt_text_renders_template(tok):
    req = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
            },
        ]
    )
    text = chat_prompt_text(tok, req)
    assert text == tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    )
    assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_chat_template_kwargs_and_tools(tok):
    text = chat_prompt_text(tok, chat(chat_template_kwargs={"enable_thinking": False}))
    assert text.endswith("<think>\n\n</think>\n\n")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    text = chat_prompt_text(tok, chat(tools=[tool]))
    assert "get_weather" in text and "# Tools" in text


def test_chat_history_with_reasoning_and_tool_calls(tok):
    messages = [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "need a tool",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = chat_prompt_text(tok, chat(messages=messages))
    assert text.startswith("<|im_start|>system\nsys<|im_end|>")
    assert "<think>\nneed a tool\n</think>" in text
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "assistant", "content": "only an assistant"}],  # no user query
        [{"role": "user", "content": "a"}, {"role": "system", "content": "late system"}],
    ],
)
def test_template_error_is_400(tok, messages):
    err = error_of(chat_prompt_text, tok, chat(messages=messages))
    assert err.status == 400 and err.param == "messages"


def test_empty_messages_in_prompt_text_is_400(tok):
    req = chat().model_copy(update={"messages": []})
    assert error_of(chat_prompt_text, tok, req).param == "messages"


def test_no_chat_template_is_400():
    bare = Tokenizer(Tokenizer.from_dir(MODEL_DIR).backend)
    err = error_of(chat_prompt_text, bare, chat())
    assert err.status == 400 and "/v1/completions" in err.message


# ------------------------------------------------------------------------ sampling


def test_sampling_precedence():
    p = sampling_params(chat(), defaults=DEFAULTS, max_new_tokens=100)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 0.9, 20, 0.0)
    assert p.max_tokens == 100
    p = sampling_params(
        chat(temperature=0, top_k=5, min_p=0.1), defaults=DEFAULTS, max_new_tokens=100
    )
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 0.9, 5, 0.1)
    assert p.greedy
    p = sampling_params(chat(), defaults={}, max_new_tokens=10)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    p = sampling_params(chat(), defaults={"temperature": None}, max_new_tokens=10)
    assert p.temperature == 1.0


def test_penalties_from_the_request_then_the_checkpoint():
    p = sampling_params(chat(), defaults={"repetition_penalty": 1.1}, max_new_tokens=10)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.1, 0.0, 0.0)
    assert p.penalized
    req = chat(repetition_penalty=1, frequency_penalty=0.5, presence_penalty=-1.5)
    p = sampling_params(req, defaults={"repetition_penalty": 1.1}, max_new_tokens=10)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.5, -1.5)
    assert not sampling_params(chat(), defaults={}, max_new_tokens=10).penalized
    for field, bad in (
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("repetition_penalty", 0),
        ("frequency_penalty", "1"),
    ):
        err = error_of(completion, prompt="x", **{field: bad})
        assert err.status == 400 and err.param == field


def test_logit_bias_keys_are_token_ids_in_the_vocabulary():
    p = sampling_params(
        completion(prompt="x", logit_bias={"7": -100, "3": 5}), defaults={}, max_new_tokens=5,
        vocab_size=10,
    )  # fmt: skip
    assert p.logit_bias == ((3, 5.0), (7, -100.0))
    for bad in ({"x": 1}, {"-1": 1}, {"10": 1}, {"1": 101}, {"1": "2"}):
        err = error_of(
            lambda b=bad: sampling_params(
                completion(prompt="x", logit_bias=b), defaults={}, max_new_tokens=5, vocab_size=10
            )
        )
        assert err.status == 400 and err.param.startswith("logit_bias"), bad


def test_sampling_carries_request_fields():
    req = chat(
        seed=7,
        stop=["x"],
        stop_token_ids=[3],
        ignore_eos=True,
        logprobs=True,
        top_logprobs=4,
        max_tokens=50,
    )
    p = sampling_params(req, defaults=DEFAULTS, max_new_tokens=100, eos_ids=[4098])
    assert p == SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        seed=7,
        max_tokens=50,
        stop=("x",),
        stop_token_ids=(3,),
        ignore_eos=True,
        logprobs=4,
    )
    p = sampling_params(completion(prompt="x", logprobs=3), defaults={}, max_new_tokens=5)
    assert p.logprobs == 3


def test_max_completion_tokens_wins():
    req = chat(max_tokens=10, max_completion_tokens=20)
    assert sampling_params(req, defaults={}, max_new_tokens=100).max_tokens == 20
    err = error_of(sampling_params, req, defaults={}, max_new_tokens=15)
    assert err.param == "max_completion_tokens"


def test_max_tokens_over_limit_is_400():
    err = error_of(
        sampling_params, completion(prompt="x", max_tokens=101), defaults={}, max_new_tokens=100
    )
    assert err.status == 400 and err.param == "max_tokens" and "100" in err.message


def test_sampling_value_error_becomes_400():
    err = error_of(sampling_params, chat(seed=2**70), defaults={}, max_new_tokens=10)
    assert err.status == 400 and err.param == "seed"
    err = error_of(sampling_params, chat(), defaults={"top_p": 0.0}, max_new_tokens=10)
    assert err.param == "top_p"


# ------------------------------------------------------------------------ responses


def test_chat_response_shape():
    rid = new_request_id("chat")
    assert rid.startswith("chatcmpl-")
    resp = chat_completion_response(
        request_id=rid,
        model="m",
        created=123,
        choices=[chat_choice(0, content="42", reasoning="6*7", finish_reason="stop")],
        usage=usage_info(10, 3, cached_tokens=8),
    )
    assert resp == {
        "id": rid,
        "object": "chat.completion",
        "created": 123,
        "model": "m",
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "42",
                    "reasoning_content": "6*7",
                    "reasoning": "6*7",
                },
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "total_tokens": 13,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
    }


def test_chat_chunks():
    first = chat_chunk(request_id="c", model="m", index=0, role=True, created=1)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    think = chat_chunk(request_id="c", model="m", index=1, reasoning="hmm")
    assert think["choices"][0]["delta"] == {"reasoning_content": "hmm", "reasoning": "hmm"}
    both = chat_chunk(request_id="c", model="m", index=0, content="a", reasoning="b")
    assert both["choices"][0]["delta"] == {
        "content": "a",
        "reasoning_content": "b",
        "reasoning": "b",
    }
    last = chat_chunk(request_id="c", model="m", index=0, finish_reason="length")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert isinstance(last["created"], int)


def test_completion_response_and_chunks():
    rid = new_request_id("completion")
    assert rid.startswith("cmpl-")
    resp = completion_response(
        request_id=rid,
        model="m",
        created=5,
        choices=[
            completion_choice(0, text="hi", finish_reason="stop"),
            completion_choice(1, text="yo", finish_reason="length"),
        ],
        usage=usage_info(2, 4),
    )
    assert resp["object"] == "text_completion"
    assert [c["text"] for c in resp["choices"]] == ["hi", "yo"]
    assert resp["usage"]["total_tokens"] == 6
    assert resp["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    chunk = completion_chunk(request_id=rid, model="m", index=1, text="x")
    assert chunk["object"] == "text_completion"
    assert chunk["choices"] == [
        {"index": 1, "text": "x", "logprobs": None, "finish_reason": None, "stop_reason": None}
    ]


def test_usage_chunk_and_sse():
    u = usage_chunk(
        request_id="c",
        model="m",
        object_type="chat.completion.chunk",
        usage=usage_info(1, 2),
        created=9,
    )
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 3
    frame = sse(u)
    assert frame.startswith(b"data: {") and frame.endswith(b"}\n\n")
    assert frame.count(b"\n") == 2
    assert json.loads(frame[len(b"data: ") :]) == u
    assert sse({"t": "é\nx"}) == 'data: {"t":"é\\nx"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_openai_client_types_accept_shapes():
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    ChatCompletion.model_validate(
        chat_completion_response(
            request_id="c",
            model="m",
            choices=[chat_choice(0, content="x", finish_reason="stop")],
            usage=usage_info(1, 1),
        )
    )
    ChatCompletionChunk.model_validate(chat_chunk(request_id="c", model="m", index=0, role=True))
    ChatCompletionChunk.model_validate(
        usage_chunk(
            request_id="c", model="m", object_type="chat.completion.chunk", usage=usage_info(1, 1)
        )
    )
    Completion.model_validate(
        completion_response(
            request_id="c",
            model="m",
            choices=[completion_choice(0, text="x", finish_reason="stop")],
            usage=usage_info(1, 1),
        )
    )


# ------------------------------------------------------------------------- logprobs


def test_chat_logprobs(tok):
    ids = tok.encode("hé")  # "h", then two tokens each holding one byte of "é"
    assert len(ids) == 3
    entries = [(i, -0.5, [(i, -0.5), (ids[0], -2.0)]) for i in ids]
    out = chat_logprobs(tok, entries)
    content = out["content"]
    assert [c["token"] for c in content] == [tok.decode([i]) for i in ids]
    assert content[0]["bytes"] == [ord("h")]
    # The raw bytes of the two partial tokens join into the character.
    assert bytes(content[1]["bytes"] + content[2]["bytes"]).decode() == "é"
    assert content[1]["top_logprobs"][1] == {"token": "h", "logprob": -2.0, "bytes": [104]}
    added = tok.encode("<think>")[0]
    assert chat_logprobs(tok, [(added, 0.0, [])])["content"][0]["bytes"] == list(b"<think>")
    as_ids = chat_logprobs(tok, entries, as_token_ids=True)["content"]
    assert as_ids[0]["token"] == f"token_id:{ids[0]}"
    assert as_ids[0]["top_logprobs"][1]["token"] == f"token_id:{ids[0]}"


def test_logprobs_are_json_safe(tok):
    out = chat_logprobs(tok, [(5, float("-inf"), [(5, float("-inf"))])])
    json.dumps(out, allow_nan=False)
    assert out["content"][0]["logprob"] == -9999.0
    out = completion_logprobs(tok, [(5, float("-inf"), [])])
    json.dumps(out, allow_nan=False)


def test_completion_logprobs(tok):
    ids = tok.encode("Hello world")
    entries = [(i, -1.0 * k, [(i, -1.0 * k)]) for k, i in enumerate(ids)]
    out = completion_logprobs(tok, entries, text_offset=7)
    texts = [tok.decode([i]) for i in ids]
    assert out["tokens"] == texts
    assert out["token_logprobs"] == [-1.0 * k for k in range(len(ids))]
    assert out["top_logprobs"] == [{t: -1.0 * k} for k, t in enumerate(texts)]
    offsets = [7]
    for t in texts[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert out["text_offset"] == offsets
    as_ids = completion_logprobs(tok, entries, as_token_ids=True)
    assert as_ids["tokens"] == [f"token_id:{i}" for i in ids]
    assert as_ids["top_logprobs"][0] == {f"token_id:{ids[0]}": 0.0}


# --------------------------------------------------------------------- the fast parser

_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(), _JSON, max_size=6), st.booleans())
def test_bodies_parse_as_the_standard_library_reads_them(body, ascii_only):
    """The fast path (orjson) gives what json.loads gives, for any object: big integers (kept
    ints), floats, text with escapes or raw UTF-8, nesting."""
    raw = json.dumps(body, ensure_ascii=ascii_only).encode()
    assert _load_object(raw) == json.loads(raw)


@pytest.mark.parametrize(
    "raw",
    [b'{"seed": 123456789012345678901}', b'{"a": 18446744073709551616}', b'{"x": 1e400}'],
)
def test_numbers_beyond_64_bits_are_read_exactly(raw):
    assert _load_object(raw) == json.loads(raw)
