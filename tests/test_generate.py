"""Single-stream generation and `headstart run` on the embedded default model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from headstart.generate import Finish, Piece, generate, greedy_tokens
from headstart.loading import default_model_dir, load
from headstart.sampling import SamplingParams


@pytest.fixture(scope="module")
def default():
    return load()


def run_all(loaded, prompt_ids, params):
    events = list(generate(loaded.model, loaded.tokenizer, prompt_ids, params, ()))
    pieces = [e for e in events if isinstance(e, Piece)]
    finish = events[-1]
    assert isinstance(finish, Finish) and all(not isinstance(e, Finish) for e in events[:-1])
    return pieces, finish


def test_default_model_is_a_real_checkpoint(default):
    assert (default_model_dir() / "model.safetensors").exists()
    text = default.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], enable_thinking=False
    )
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert default.eos_token_ids  # from generation_config.json


@pytest.mark.slow
def test_greedy_text_matches_tokens_and_max_tokens(default):
    ids = default.tokenizer.encode("def add(a, b):")
    pieces, finish = run_all(default, ids, SamplingParams(temperature=0, max_tokens=12))
    assert finish.reason == "length" and len(pieces) == 12
    tokens = [p.token_id for p in pieces]
    assert tokens == greedy_tokens(default.model, ids, 12)
    text = "".join(p.text for p in pieces) + finish.text
    assert text == default.tokenizer.decode(tokens)


@pytest.mark.slow
def test_seed_reproducible(default):
    ids = default.tokenizer.encode("import os")
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=123, max_tokens=10)
    a, _ = run_all(default, ids, params)
    b, _ = run_all(default, ids, params)
    assert [p.token_id for p in a] == [p.token_id for p in b]


def test_stop_string_truncates(default):
    ids = default.tokenizer.encode("class Foo:")
    pieces, finish = run_all(default, ids, SamplingParams(temperature=0, max_tokens=16))
    full = "".join(p.text for p in pieces) + finish.text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    pieces, finish = run_all(
        default, ids, SamplingParams(temperature=0, max_tokens=16, stop=[stop])
    )
    text = "".join(p.text for p in pieces) + finish.text
    assert finish.reason == "stop" and text == full[: full.index(stop)]


def test_stop_token_ends_without_emitting_it(default):
    ids = default.tokenizer.encode("x = 1")
    first = greedy_tokens(default.model, ids, 3)
    pieces, finish = run_all(
        default, ids, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[first[2]])
    )
    assert [p.token_id for p in pieces] == first[:2] and finish.reason == "stop"


def test_logprobs(default):
    ids = default.tokenizer.encode("y")
    pieces, _ = run_all(default, ids, SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    for p in pieces:
        assert p.logprob is not None and p.logprob <= 0
        assert len(p.top_logprobs) == 2 and p.top_logprobs[0][0] == p.token_id


def test_prompt_over_context_is_refused(default):
    with pytest.raises(ValueError, match="context"):
        list(
            generate(
                default.model, default.tokenizer, [1] * 10, SamplingParams(), (), max_context=10
            )
        )
    with pytest.raises(ValueError, match="empty"):
        list(generate(default.model, default.tokenizer, [], SamplingParams(), ()))


@pytest.mark.slow
def test_cli_run_streams_a_reply():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "headstart",
            "run",
            "Say hi",
            "--max-tokens",
            "8",
            "--seed",
            "1",
            "--no-think",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "[finish:" in out.stderr


@pytest.mark.slow
def test_cli_bad_model_is_a_clear_error(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "headstart", "run", "--model", str(tmp_path), "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "tokenizer.json" in out.stderr or "config.json" in out.stderr


def test_default_drafter_is_used_only_where_it_was_measured_to_pay(tmp_path):
    import json
    import shutil

    from headstart.loading import default_drafter

    model = tmp_path / "m"
    model.mkdir()
    assert default_drafter("cpu", model) is None  # no drafter shipped
    (model / "drafter").mkdir()
    shutil.copy(default_model_dir() / "config.json", model / "drafter" / "config.json")
    assert default_drafter("cuda", model) == model / "drafter"  # no policy: anywhere
    (model / "headstart.json").write_text(json.dumps({"drafter_devices": ["cpu"]}))
    assert default_drafter("cpu", model) == model / "drafter"
    assert default_drafter("cuda", model) is None
