"""The model contract: a second family (tests/toy_family.py, a few lines with state groups of its
own shapes) is served end to end by the engine, the prompt cache and a real server process, and
nothing outside ``headstart.models`` names a family."""

from __future__ import annotations

import ast
import os
import threading
from pathlib import Path

import openai
import pytest
import toy_family
from server_proc import serving

from headstart.generate import greedy_tokens
from headstart.loading import default_model_dir, load
from headstart.models import family_for
from headstart.tokenizer import Tokenizer

SRC = Path(__file__).resolve().parent.parent / "src" / "headstart"
TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = Tokenizer.from_dir(default_model_dir())
    return toy_family.write_checkpoint(
        tmp_path_factory.mktemp("toy"), default_model_dir(), tok.vocab_size
    )


@pytest.fixture(scope="module")
def toy(checkpoint):
    return load(str(checkpoint))


@pytest.fixture(scope="module")
def server(checkpoint):
    env = {
        "HEADSTART_MODEL_FAMILIES": "toy_family",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    with serving(
        "--model",
        str(checkpoint),
        "--parallel",
        "4",
        "--context",
        "256",
        "--prompt-cache-interval",
        "16",
        env=env,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_the_registry_finds_each_family(checkpoint):
    assert family_for(checkpoint).name == "toy_mixer"
    assert family_for(default_model_dir()).name == "qwen35"


def _greedy(client, ids, n=12):
    r = client.completions.create(
        model="x",
        prompt=ids,
        max_tokens=n,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, "model": None},
    )
    choice = r.choices[0]
    return [int(t.split(":")[1]) for t in choice.logprobs.tokens], r.usage


PROMPTS = [[5 + i * 7 % 300 for i in range(n)] for n in (3, 20, 41)]


@pytest.mark.slow
def test_served_greedy_tokens_equal_the_model_alone(toy, client):
    for ids in PROMPTS:
        got, _ = _greedy(client, ids)
        assert got == greedy_tokens(toy.model, ids, 12)


@pytest.mark.slow
def test_concurrent_streams_equal_alone(toy, client):
    results: dict[int, list[int]] = {}

    def run(i):
        results[i] = _greedy(client, PROMPTS[i % 3] + [i], 16)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i in range(8):
        assert results[i] == greedy_tokens(toy.model, PROMPTS[i % 3] + [i], 16)


@pytest.mark.slow
def test_prompt_cache_hits_equal_misses(toy, client):
    ids = [9 + (i * 13) % 400 for i in range(50)]
    cold, usage = _greedy(client, ids)
    assert usage.prompt_tokens_details.cached_tokens == 0
    hit, usage = _greedy(client, ids)
    assert usage.prompt_tokens_details.cached_tokens == len(ids) and hit == cold
    longer = ids + [77, 78, 79, 80, 81]
    got, usage = _greedy(client, longer)
    assert usage.prompt_tokens_details.cached_tokens == len(ids)  # its state groups restored
    assert got == greedy_tokens(toy.model, longer, 12)


@pytest.mark.slow
def test_chat_is_served(client):
    r = client.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True, "model": None},
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.choices[0].message.content  # no reasoning split for a family that does not think


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_nothing_outside_models_imports_a_family():
    """Only ``headstart.models`` (the registry) may import a family's package."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if SRC / "models" in path.parents:
            continue
        for module in _imports(path):
            if module.startswith("headstart.models.") and module != "headstart.models.contract":
                offenders.append(f"{path.relative_to(SRC)}: {module}")
    assert not offenders, offenders
