"""A real `headstart serve` process, driven with the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import stat
import time

import httpx
import openai
import pytest
from server_proc import ServerProcess

pytestmark = pytest.mark.slow  # every test here talks to a real `headstart serve`

MODEL = "headstart-default"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("srv") / "requests.jsonl"
    srv = ServerProcess("--parallel", "16", "--context", "512", "--request-log", str(log))
    srv.request_log = log
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def token_ids(choice_logprobs) -> list[int]:
    return [int(t.token.split(":")[1]) for t in choice_logprobs.content]


def greedy_chat(client, text, max_tokens=12, **extra):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True, **extra},
    )


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = server.health()
    assert h["status"] == "ok" and h["slots"] == 16


def test_chat_thinking_on_goes_to_reasoning(client):
    r = greedy_chat(client, "hello", chat_template_kwargs={"enable_thinking": True})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # The template opened <think> and this random model never closes it.
    assert msg.model_extra["reasoning_content"] and not msg.content
    assert len(token_ids(r.choices[0].logprobs)) == 12


def test_the_default_model_chats_without_thinking(client):
    """Its folder's headstart.json turns thinking off unless a request turns it on."""
    r = greedy_chat(client, "hello")
    msg = r.choices[0].message
    assert msg.content and msg.model_extra.get("reasoning_content") is None
    assert (
        r.usage.prompt_tokens
        == greedy_chat(
            client, "hello", chat_template_kwargs={"enable_thinking": False}
        ).usage.prompt_tokens
    )


def test_chat_thinking_off_goes_to_content(client):
    r = greedy_chat(client, "hello", chat_template_kwargs={"enable_thinking": False})
    msg = r.choices[0].message
    assert msg.content and msg.model_extra.get("reasoning_content") is None


def test_chat_stream_matches_non_stream(client):
    full = greedy_chat(client, "stream me", chat_template_kwargs={"enable_thinking": False})
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream me"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completions_prompt_shapes(client, server):
    tok_prompt = [10, 20, 30, 40]
    a = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=5, temperature=0)
    assert a.choices[0].finish_reason in ("length", "stop") and a.usage.prompt_tokens > 0
    b = client.completions.create(
        model=MODEL, prompt=["one", "two"], max_tokens=3, temperature=0, n=2, seed=3
    )
    assert sorted(c.index for c in b.choices) == [0, 1, 2, 3]
    c = client.completions.create(
        model=MODEL,
        prompt=tok_prompt,
        max_tokens=3,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert c.usage.prompt_tokens == 4 and len(c.choices[0].logprobs.tokens) == 3
    assert all(len(t) == 2 for t in c.choices[0].logprobs.top_logprobs)
    s = client.completions.create(
        model=MODEL,
        prompt=tok_prompt,
        max_tokens=3,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(x.choices[0].text for x in s) == c.choices[0].text


def test_a_token_whose_text_is_held_back_gets_its_chunk_when_computed(client):
    """A streamed completions token whose text is held back (here byte 0xE4 alone, the start
    of a three-byte character, forced by logit_bias) still gets its chunk, with empty text, as
    vLLM sends it: a client sees its first token when it is computed, not a step later. The
    closing chunk carries the text that was held."""
    from headstart.loading import default_model_dir
    from headstart.tokenizer import Tokenizer

    lead = Tokenizer.from_dir(default_model_dir()).token_to_id("\u00e4")  # GPT-2 map: 0xE4
    assert lead is not None
    stream = client.completions.create(
        model=MODEL,
        prompt=[10, 20, 30],
        max_tokens=2,
        temperature=0,
        stream=True,
        logit_bias={str(lead): 100},
        extra_body={"ignore_eos": True},
    )
    choices = [c.choices[0] for c in stream if c.choices]
    assert [(c.text, c.finish_reason) for c in choices[:2]] == [("", None), ("", None)]
    assert choices[-1].finish_reason == "length" and "\ufffd" in choices[-1].text


def test_sixteen_concurrent_greedy_equal_alone(server):
    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        async def one(i):
            r = await aclient.completions.create(
                model=MODEL,
                prompt=f"item {i}: " + "x = y + 1\n" * (i % 5),
                max_tokens=16,
                temperature=0,
                logprobs=0,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
            )
            return r.choices[0].logprobs.tokens

        together = await asyncio.gather(*(one(i) for i in range(16)))
        alone = [await one(i) for i in range(16)]
        return together, alone

    together, alone = asyncio.run(run())
    assert together == alone and all(len(t) == 16 for t in together)


def test_penalties_through_the_server_equal_the_reference_loop(client):
    """frequency_penalty and presence_penalty (the openai client's own arguments) and
    repetition_penalty (vLLM's, in the body) give what the in-process reference gives."""
    from headstart.generate import Piece, generate
    from headstart.loading import load
    from headstart.sampling import SamplingParams

    loaded = load()
    prompt = loaded.tokenizer.encode("def parse(line):\n")
    knobs = {"frequency_penalty": 0.8, "presence_penalty": 0.4, "repetition_penalty": 1.2}
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        logprobs=0,
        frequency_penalty=knobs["frequency_penalty"],
        presence_penalty=knobs["presence_penalty"],
        extra_body={
            "repetition_penalty": knobs["repetition_penalty"],
            "return_tokens_as_token_ids": True,
            "ignore_eos": True,
        },
    )
    got = [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **knobs)
    events = generate(loaded.model, loaded.tokenizer, prompt, params, ())
    want = [e.token_id for e in events if isinstance(e, Piece)]
    plain = generate(
        loaded.model, loaded.tokenizer, prompt, SamplingParams(temperature=0, max_tokens=24), ()
    )
    assert got == want and want != [e.token_id for e in plain if isinstance(e, Piece)][:24]


def test_logit_bias_through_the_server(client):
    """The openai client's logit_bias: a token at +100 is every greedy token; an id outside
    the vocabulary is a 400 naming the field."""
    r = client.completions.create(
        model=MODEL,
        prompt="def f(x):",
        max_tokens=5,
        temperature=0,
        logprobs=0,
        logit_bias={"42": 100},
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    assert [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens] == [42] * 5
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias={"99999999": 1})
    assert info.value.body["param"] == "logit_bias"


def test_disconnects_free_slots(server):
    """Fill all slots with long streams, drop them mid-stream, then get served promptly;
    then 200 random disconnects leave no slot held and memory flat."""
    body = {
        "model": MODEL,
        "prompt": "go",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }

    def open_and_drop(n_chunks: int):
        with (
            httpx.Client(timeout=30) as c,
            c.stream("POST", server.url + "/v1/completions", json=body) as r,
        ):
            for i, _ in enumerate(r.iter_lines()):
                if i >= n_chunks:
                    break

    async def fill_and_drop():
        await asyncio.gather(*(asyncio.to_thread(open_and_drop, 3) for _ in range(16)))

    asyncio.run(fill_and_drop())
    t0 = time.monotonic()
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 200 and time.monotonic() - t0 < 10

    def rss_kb() -> int:
        with open(f"/proc/{server.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS"):
                    return int(line.split()[1])
        return 0

    rng = random.Random(0)
    before = rss_kb()

    async def random_drops():
        sem = asyncio.Semaphore(8)

        async def one():
            async with sem:
                await asyncio.to_thread(open_and_drop, rng.randint(0, 6))

        await asyncio.gather(*(one() for _ in range(200)))

    asyncio.run(random_drops())
    deadline = time.monotonic() + 10
    while server.health()["free_slots"] != 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    h = server.health()
    assert h["free_slots"] == 16 and h["running"] == 0 and h["waiting"] == 0
    assert rss_kb() - before < 100_000  # kB; leaking per-request buffers would show


BAD = [
    ("malformed json", "/v1/completions", b'{"prompt": "x", ', 400, None),
    ("wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("temperature range", "/v1/completions", {"prompt": "x", "temperature": 9}, 400, "temperature"),
    (
        "top_p range",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_p": 0},
        400,
        "top_p",
    ),
    ("unknown model", "/v1/completions", {"model": "gpt-5", "prompt": "x"}, 404, "model"),
    ("prompt over context", "/v1/completions", {"prompt": [5] * 600}, 400, "prompt"),
    (
        "max_tokens over context",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 5000},
        400,
        "max_tokens",
    ),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 999999]}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "bad role",
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "x"}]},
        400,
        None,
    ),
    ("n range", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    (
        "presence_penalty range",
        "/v1/completions",
        {"prompt": "x", "presence_penalty": 3},
        400,
        "presence_penalty",
    ),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(server, name, path, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    # The engine is unharmed.
    ok = httpx.post(
        server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30
    )
    assert ok.status_code == 200


def test_burst_with_request_log(server):
    before = server.request_log.read_text().count("\n") if server.request_log.exists() else 0

    async def burst():
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(
                *(
                    c.post(
                        server.url + "/v1/completions",
                        json={"prompt": f"burst {i}", "max_tokens": 3, "stream": i % 2 == 0},
                    )
                    for i in range(64)
                )
            )
        return [r.status_code for r in rs]

    assert asyncio.run(burst()) == [200] * 64
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = server.request_log.read_text().splitlines()[before:]
        if len(lines) >= 64:
            break
        time.sleep(0.05)
    records = [json.loads(line) for line in lines]
    assert len(records) == 64
    for rec in records:
        assert rec["status"] == 200 and rec["completion_tokens"] >= 1
        assert "prompt" not in rec and "text" not in rec


def test_metrics_exposed(server):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in (
        "headstart_requests_running",
        "headstart_requests_queued",
        "headstart_time_to_first_token_seconds",
        "headstart_generation_tokens_total",
    ):
        assert name in text


def test_full_queue_gets_429(servers):
    srv = servers("--parallel", "1", "--max-queue", "0", "--context", "1024").wait_ready()
    body = {"prompt": "hold", "max_tokens": 900, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(timeout=30) as c,
        c.stream("POST", srv.url + "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the stream
        next(lines)
        busy = httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "rate_limit_exceeded"
    assert srv.stop() == 0


def test_api_keys_mode_401_and_sighup(tmp_path, servers):
    keyfile = tmp_path / "keys"
    keyfile.write_text("first-key\n")
    os.chmod(keyfile, 0o644)
    refused = servers("--api-key-file", str(keyfile))
    assert refused.proc.wait(60) == 2 and "644" in refused.output()
    os.chmod(keyfile, stat.S_IRUSR | stat.S_IWUSR)
    srv = servers("--api-key-file", str(keyfile)).wait_ready()
    url = srv.url + "/v1/models"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer first-key"}).status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200  # no key needed
    keyfile.write_text("second-key\n")
    srv.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if httpx.get(url, headers={"Authorization": "Bearer second-key"}).status_code == 200:
            break
        time.sleep(0.1)
    assert httpx.get(url, headers={"Authorization": "Bearer second-key"}).status_code == 200
    assert httpx.get(url, headers={"Authorization": "Bearer first-key"}).status_code == 401
    assert srv.stop() == 0


def test_sigterm_ends_streams_with_a_final_chunk_and_exits_0(servers):
    srv = servers("--shutdown-timeout", "1", "--context", "4096").wait_ready()
    body = {"prompt": "long", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    lines = []
    with (
        httpx.Client(timeout=60) as c,
        c.stream("POST", srv.url + "/v1/completions", json=body) as r,
    ):
        for i, line in enumerate(r.iter_lines()):
            if i == 2:
                srv.proc.send_signal(signal.SIGTERM)
            if line:
                lines.append(line)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert srv.stop() == 0
