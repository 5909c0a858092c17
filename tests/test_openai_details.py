"""OpenAI details and a user's first commands: stop_reason, /openapi.json, the positional model,
the device chosen by default (through a real `headstart serve`)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from server_proc import serving

from headstart.loading import default_model_dir, resolve_device

PROMPT = "def read_lines(filename):"


def test_auto_device_is_cuda_only_when_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda:1") == "cuda:1" and resolve_device("cpu") == "cpu"


@pytest.fixture(scope="module")
def server():
    # The model as a positional argument, no --device: auto.
    with serving(str(default_model_dir()), "--parallel", "2", "--context", "256") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _greedy(client, **kw):
    return client.completions.create(
        model="default_model",
        prompt=PROMPT,
        temperature=0,
        max_tokens=24,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True, **kw.pop("extra", {})},
        **kw,
    )


@pytest.mark.slow
def test_positional_model_and_auto_device(server, client):
    assert [m.id for m in client.models.list().data] == ["default_model"]
    lines = server.output().splitlines()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert lines[0].endswith(f"device: {expected} (auto)"), lines[0]
    # Start-up says what it is doing and how long each phase took.
    assert any(" loaded default_model (qwen35) in " in line for line in lines)
    assert any(" engine ready in " in line and "start-up" in line for line in lines)


@pytest.mark.slow
def test_stop_reason_names_what_stopped(client):
    plain = _greedy(client).choices[0]
    assert plain.finish_reason == "length" and plain.model_extra["stop_reason"] is None
    ids = [int(t.split(":")[1]) for t in plain.logprobs.tokens]
    text = plain.text
    word = next(w for w in ("return", "(", ":", "\n") if w in text[1:])
    by_string = _greedy(client, stop=[word]).choices[0]
    assert by_string.finish_reason == "stop" and by_string.model_extra["stop_reason"] == word
    by_id = _greedy(client, extra={"stop_token_ids": [ids[3]]}).choices[0]
    assert by_id.finish_reason == "stop" and by_id.model_extra["stop_reason"] == ids[3]
    stream = client.completions.create(
        model="default_model", prompt=PROMPT, temperature=0, max_tokens=24, stop=[word], stream=True
    )
    last = [chunk.choices[0] for chunk in stream][-1]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == word


@pytest.mark.slow
def test_openapi_schema_describes_the_request_bodies(server):
    schema = httpx.get(server.url + "/openapi.json", timeout=10).json()
    for path, model in (
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/v1/completions", "CompletionRequest"),
    ):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert "messages" in schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]


def test_serving_defaults_are_read_and_checked(tmp_path):
    from headstart.errors import CheckpointError
    from headstart.loading import serving_defaults

    assert serving_defaults(default_model_dir()) == {
        "chat_template_kwargs": {"enable_thinking": False}
    }
    assert serving_defaults(tmp_path) == {}  # no headstart.json
    (tmp_path / "headstart.json").write_text('{"serving": {"chat_template_kwargs": [1]}}')
    with pytest.raises(CheckpointError, match="headstart.json"):
        serving_defaults(tmp_path)
