"""The prompt cache seen through the HTTP API: cached_tokens, and answers equal a fresh server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_proc import ServerProcess

from headstart.loading import load
from headstart.server.protocol import parse_chat_request

pytestmark = pytest.mark.slow  # every test here talks to a real `headstart serve`

MODEL = "headstart-default"


@pytest.fixture(scope="module")
def servers():
    cached = ServerProcess("--parallel", "4", "--context", "1024")
    fresh = ServerProcess("--parallel", "4", "--context", "1024", "--prompt-cache-mib", "0")
    cached.wait_ready(), fresh.wait_ready()
    yield cached, fresh
    assert cached.stop() == 0 and fresh.stop() == 0


def chat(url, messages, **extra):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )


def test_exact_repeat_reports_the_whole_prompt_cached(servers):
    cached, fresh = servers
    messages = [{"role": "user", "content": "Explain recursion in one line."}]
    first = chat(cached.url, messages)
    again = chat(cached.url, messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    assert again.choices[0].message == first.choices[0].message
    assert chat(fresh.url, messages).choices[0].message == first.choices[0].message


@pytest.mark.parametrize("thinking", [True, False])
def test_second_turn_reuses_the_first_turn_up_to_its_assistant_header(servers, thinking):
    cached, fresh = servers
    kwargs = {"chat_template_kwargs": {"enable_thinking": thinking}}
    turn1 = [
        {"role": "system", "content": f"You write Python. thinking={thinking}"},
        {"role": "user", "content": "A function that reverses a list?"},
    ]
    r1 = chat(cached.url, turn1, **kwargs)
    answer = r1.choices[0].message.content or "def rev(xs): return xs[::-1]"
    turn2 = turn1 + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Now for a string."},
    ]
    r2 = chat(cached.url, turn2, **kwargs)
    # Where the first turn's prompt and the second's part: right after the assistant header.
    tok = load().tokenizer
    text1 = tok.apply_chat_template(turn1, add_generation_prompt=True, enable_thinking=thinking)
    header = text1[: text1.rfind("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")]
    assert r2.usage.prompt_tokens_details.cached_tokens == len(tok.encode(header))
    want = chat(fresh.url, turn2, **kwargs)
    assert want.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.choices[0].message == want.choices[0].message


def test_cache_metrics(servers):
    cached, _ = servers
    text = httpx.get(cached.url + "/metrics").text
    for name in (
        "headstart_prompt_cache_hits_total",
        "headstart_prompt_cache_misses_total",
        "headstart_prompt_cache_bytes",
        "headstart_prompt_cache_evictions_total",
        "headstart_prompt_cache_restored_tokens_total",
        "headstart_prompt_cache_host_restored_bytes_total",
        "headstart_prompt_cache_host_restore_seconds_total",
        "headstart_prompt_cache_demoted_bytes_total",
        "headstart_prompt_cache_demote_seconds_total",
    ):
        assert name in text
    hits = [
        line for line in text.splitlines() if line.startswith("headstart_prompt_cache_hits_total")
    ]
    assert float(hits[0].split()[-1]) >= 1


def test_tool_call_loop_reuses_every_turn(servers):
    """A chat agent loop: each turn appends the model's answer as an assistant message with a
    tool call, then the tool's result, and asks again (tools declared). Every turn restores at
    least what the previous prompt shares with it and answers as a server without the cache;
    the raw-completion loop is tests/test_prompt_cache.py's agent loop."""
    cached, fresh = servers
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file.",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]
    tok = load().tokenizer
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the bug in app.py."},
    ]
    previous = None
    for turn in range(4):
        got = chat(cached.url, messages, tools=tools)
        want = chat(fresh.url, messages, tools=tools)
        assert got.choices[0].message == want.choices[0].message, turn
        # The prompt as the server renders it (tool-call arguments parsed into objects).
        body = json.dumps({"model": MODEL, "messages": messages, "tools": tools}).encode()
        req = parse_chat_request(body)
        prompt = tok.apply_chat_template([m.template_dict() for m in req.messages], tools=tools)
        if previous is not None:
            shared = 0
            while shared < min(len(prompt), len(previous)) and prompt[shared] == previous[shared]:
                shared += 1
            assert got.usage.prompt_tokens_details.cached_tokens > 0, turn
            assert (
                len(tok.encode(prompt[:shared])) - 2
                <= got.usage.prompt_tokens_details.cached_tokens
            )
        previous = prompt
        call = {
            "id": f"call_{turn}",
            "type": "function",
            "function": {"name": "read_file", "arguments": f'{{"path": "file_{turn}.py"}}'},
        }
        messages = [
            *messages,
            {
                "role": "assistant",
                "content": got.choices[0].message.content or "",
                "tool_calls": [call],
            },
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"line {turn}\n" * 8},
        ]
