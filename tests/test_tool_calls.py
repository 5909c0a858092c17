"""Tool calls in Qwen3.5's output format -> OpenAI tool_calls (parser, template round trip,
and the response shapes of the server)."""

from __future__ import annotations

import asyncio
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from headstart.engine.config import EngineConfig
from headstart.engine.engine import Engine
from headstart.engine.output import Finish, Piece
from headstart.loading import load
from headstart.models.qwen35.tool_calls import ToolCallParser
from headstart.server import protocol as P
from headstart.server.api import ServerState, _Generation
from headstart.server.metrics import Metrics

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "limit": {"type": "integer"},
                    "flags": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    }
]

CALL = (
    "<tool_call>\n<function=read_file>\n<parameter=path>\n/tmp/a 1.txt\n</parameter>\n"
    '<parameter=limit>\n20\n</parameter>\n<parameter=flags>\n["x"]\n</parameter>\n'
    "</function>\n</tool_call>"
)
TEXT = "Let me look.\n\n" + CALL + "\n" + CALL.replace("a 1.txt", "b.txt")


def run(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list]:
    content, calls = "", []
    for piece in pieces:
        c, got = parser.push(piece)
        content += c
        calls += got
    return content + parser.flush(), calls


def test_calls_are_parsed_and_typed_by_schema():
    content, calls = run(ToolCallParser(TOOLS), [TEXT])
    assert content == "Let me look.\n\n"
    assert [c.name for c in calls] == ["read_file", "read_file"]
    assert calls[0].arguments == {"path": "/tmp/a 1.txt", "limit": 20, "flags": ["x"]}
    assert calls[1].arguments["path"] == "/tmp/b.txt"
    assert json.loads(calls[0].openai()["function"]["arguments"])["limit"] == 20


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(TEXT)), max_size=12))
def test_any_split_into_deltas_gives_the_same_result(cuts):
    bounds = sorted(set(cuts)) + [len(TEXT)]
    pieces, last = [], 0
    for b in bounds:
        pieces.append(TEXT[last:b])
        last = b
    content, calls = run(ToolCallParser(TOOLS), pieces)
    whole, whole_calls = run(ToolCallParser(TOOLS), [TEXT])
    assert content == whole
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_unfinished_or_empty_blocks_stay_text():
    content, calls = run(ToolCallParser(TOOLS), ["a <tool_call>\n<function=read_"])
    assert calls == [] and content == "a <tool_call>\n<function=read_"
    content, calls = run(ToolCallParser(TOOLS), ["<tool_call>nothing</tool_call> ok"])
    assert calls == [] and content == "<tool_call>nothing</tool_call> ok"


def test_the_templates_own_history_rendering_parses_back():
    """What the chat template writes for an assistant tool call is what the parser reads."""
    tok = load().tokenizer
    args = {"path": "/tmp/x.py", "limit": 5}
    messages = [
        {"role": "user", "content": "read it"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "read_file", "arguments": args}}
            ],
        },
        {"role": "tool", "content": "data"},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=False)
    # The last block: the system prompt shows an example call first.
    block = text[text.rindex("<tool_call>") : text.rindex("</tool_call>") + len("</tool_call>")]
    _, calls = run(ToolCallParser(TOOLS), [block])
    assert len(calls) == 1 and calls[0].name == "read_file" and calls[0].arguments == args


def generation(stream: bool, tools=TOOLS):
    loaded = load()
    engine = Engine(
        loaded.model, loaded.tokenizer, loaded.eos_token_ids, EngineConfig(1, 256)
    )  # not started: the test feeds the events itself
    state = ServerState(
        engine=engine,
        tokenizer=loaded.tokenizer,
        model_name="m",
        context=256,
        generation_defaults={},
        metrics=Metrics(slots=1),
        chat=loaded.family.chat,
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if tools is not None:
        body["tools"] = tools
    req = P.parse_chat_request(json.dumps(body).encode())
    return _Generation(state, "chat", req, [[1, 2, 3]], "<|im_start|>assistant\n")


def test_response_shapes_with_tool_calls():
    async def go():
        gen = generation(stream=True)
        chunks = []
        for i, piece in enumerate([TEXT[:20], TEXT[20:70], TEXT[70:]]):
            chunks += gen.take(0, Piece(i, piece))
        chunks += gen.take(0, Finish("stop", "", 3))
        full = gen.full_response()
        return chunks, full

    chunks, full = asyncio.run(go())
    deltas = [c["choices"][0]["delta"] for c in chunks]
    streamed = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [tc["index"] for tc in streamed] == [0, 1]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look.\n\n"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    message = full["choices"][0]["message"]
    assert full["choices"][0]["finish_reason"] == "tool_calls"
    assert [tc["function"]["name"] for tc in message["tool_calls"]] == ["read_file"] * 2
    assert message["content"] == "Let me look.\n\n"


def test_no_tools_means_no_parsing():
    async def go():
        gen = generation(stream=False, tools=None)
        gen.take(0, Piece(0, TEXT))
        gen.take(0, Finish("stop", "", 1))
        return gen.full_response()

    full = asyncio.run(go())
    assert full["choices"][0]["message"]["content"] == TEXT
    assert "tool_calls" not in full["choices"][0]["message"]
    assert full["choices"][0]["finish_reason"] == "stop"
