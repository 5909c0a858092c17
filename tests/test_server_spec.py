"""`headstart serve --drafter --spec-mode chain`: same greedy answers as without, and spec
metrics."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
import tiny
from server_proc import ServerProcess

from headstart.loading import default_model_dir

pytestmark = pytest.mark.slow  # every test here talks to a real `headstart serve`


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    cfg = json.loads((default_model_dir() / "config.json").read_text())
    target = SimpleNamespace(
        hidden_size=cfg["hidden_size"],
        vocab_size=cfg["vocab_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
    )
    drafter = tiny.save_drafter(
        tmp_path_factory.mktemp("d") / "drafter",
        target,
        taps=[0, 2],
        block=5,
        mask_token_id=4096,
        heads=4,
        kv_heads=2,
        head_dim=32,
    )
    spec = ServerProcess(
        "--parallel", "4", "--context", "512", "--drafter", str(drafter), "--spec-mode", "chain"
    )
    plain = ServerProcess("--parallel", "4", "--context", "512")
    spec.wait_ready(), plain.wait_ready()
    yield spec, plain
    assert spec.stop() == 0 and plain.stop() == 0


def complete(url, prompt, **extra):
    r = httpx.post(
        url + "/v1/completions",
        timeout=60,
        json={"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, **extra},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("prompt", ["def f(x):", "import os\nimport sys\n", "x"])
def test_greedy_answers_equal_without_drafter(servers, prompt):
    spec, plain = servers
    want = complete(plain.url, prompt)
    assert complete(spec.url, prompt) == want
    assert complete(spec.url, prompt, draft=False) == want


def test_spec_metrics(servers):
    spec, _ = servers
    complete(spec.url, "while True:")
    text = httpx.get(spec.url + "/metrics").text
    rounds = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("headstart_spec_decode_rounds_total")
    ]
    assert rounds and rounds[0] > 0
    assert "headstart_spec_decode_mean_accepted_length" in text
