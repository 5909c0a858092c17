"""The compile-ahead process of `headstart serve` (server/compile_ahead.py): the model cut to
the first layers that hold every layer type, and `serve --warm-only` on it, which starts up and
exits without listening."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest

from headstart.cli import _add_model_args
from headstart.loading import default_model_dir
from headstart.server import compile_ahead
from headstart.server.serve import _start_compile_ahead, add_serve_args

DEFAULT_MODEL_DIR = default_model_dir()


def _parser() -> argparse.ArgumentParser:
    """`headstart serve`'s arguments (the model ones and the server's)."""
    p = argparse.ArgumentParser()
    _add_model_args(p)
    add_serve_args(p)
    return p


def test_the_cut_keeps_one_layer_of_each_type():
    types = ["linear_attention"] * 3 + ["full_attention"]
    assert compile_ahead.cut_layers(types * 16) == 4
    assert compile_ahead.cut_layers(["full_attention", "linear_attention"] * 3) == 2


def test_cut_folder_writes_a_shorter_config_and_links_the_rest(tmp_path):
    cut = compile_ahead.cut_folder(DEFAULT_MODEL_DIR, tmp_path / "cut")
    cfg = json.loads((cut / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    assert text["num_hidden_layers"] == 4
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (cut / "tokenizer.json").resolve() == (DEFAULT_MODEL_DIR / "tokenizer.json").resolve()
    assert not any(f.name.endswith(".safetensors") for f in cut.iterdir())
    # Already as short as the cut: nothing to gain.
    assert compile_ahead.cut_folder(cut, tmp_path / "again") is None


def test_warm_only_starts_up_on_the_cut_model_and_exits(tmp_path):
    """The command the server runs, here on the CPU (the server only runs it on a GPU): it
    loads random weights at the cut model's shapes, builds the engine and exits 0, binding no
    port (the one asked for is taken by this test)."""
    import socket

    p = _parser()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = p.parse_args(["--device", "cpu", "--port", str(taken.getsockname()[1])])
        cut = compile_ahead.cut_folder(DEFAULT_MODEL_DIR, tmp_path / "cut")
        cmd = compile_ahead.command(args, cut, 512)
        cmd += ["--port", str(taken.getsockname()[1])]
        env = {**os.environ, "HEADSTART_CPU_COMPILE": "off"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--warm-only" in cmd and "--load-format" in cmd


def test_no_process_for_the_cpu_or_without_graphs():
    p = _parser()
    for argv in (["--device", "cpu"], ["--device", "cuda", "--no-graphs"]):
        assert _start_compile_ahead(p.parse_args(argv)) is None


def test_no_process_for_a_small_model():
    """The embedded default model loads in seconds: nothing to overlap."""
    assert compile_ahead.planned_step_tokens(DEFAULT_MODEL_DIR, "cuda") is None


def test_the_planned_budget_is_the_one_serve_gives_the_loaded_model(tmp_path, monkeypatch):
    """From config.json alone, the step budget serve logged for the random 27B checkpoint on
    the H200 (2048 tokens: BENCHMARKS.md), and the cut of its 64 layers to 4."""
    import sys
    from types import SimpleNamespace

    import torch

    root = Path(__file__).resolve().parent.parent
    script = root / "benchmarks" / "make_random_checkpoint.py"
    out = tmp_path / "m-27b"
    subprocess.run(
        [
            sys.executable,
            str(script),
            "--shape",
            "27b",
            "--format",
            "4bit",
            "--config-only",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    h200 = SimpleNamespace(major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: h200)
    assert compile_ahead.planned_step_tokens(out, "cuda") == 2048
    cut = compile_ahead.cut_folder(out, tmp_path / "cut")
    text = json.loads((cut / "config.json").read_text())
    assert text["num_hidden_layers"] == 4 and len(text["layer_types"]) == 4


def test_the_planned_parameters_are_the_loaded_models():
    from headstart.loading import family_for, load

    plan = family_for(DEFAULT_MODEL_DIR).planned_parameters
    assert plan(DEFAULT_MODEL_DIR) == load().model.num_parameters()


def test_start_and_wait_run_the_process_to_its_end(monkeypatch, caplog):
    """CompileAhead as serve drives it (here on the CPU): started, waited for, its folder gone;
    a failure is logged with the tail of its stderr, which goes to a file (a pipe nobody reads
    until the load is done could fill and stop it)."""
    import logging

    monkeypatch.setenv("HEADSTART_CPU_COMPILE", "off")
    args = _parser().parse_args(["--device", "cpu"])
    ahead = compile_ahead.CompileAhead.start(args, DEFAULT_MODEL_DIR, 512)
    with caplog.at_level(logging.INFO, logger="headstart.serve"):
        ahead.wait(timeout=300)
    assert ahead.proc.returncode == 0 and "done in" in caplog.text
    assert not Path(ahead.tmp.name).exists()
    args.kernels = "no-such-set"  # refused by the process's argument parser
    failing = compile_ahead.CompileAhead.start(args, DEFAULT_MODEL_DIR, 512)
    with caplog.at_level(logging.INFO, logger="headstart.serve"):
        failing.wait(timeout=120)
    assert failing.proc.returncode != 0 and "no-such-set" in caplog.text


def test_the_work_is_shared_by_a_process_per_two_cores_at_most_eight(monkeypatch):
    monkeypatch.delenv("HEADSTART_COMPILE_AHEAD_PROCESSES", raising=False)
    assert [compile_ahead.shards(c) for c in (1, 2, 5, 16, 64)] == [1, 1, 2, 8, 8]
    monkeypatch.setenv("HEADSTART_COMPILE_AHEAD_PROCESSES", "3")
    assert compile_ahead.shards(64) == 3


def test_shards_are_asked_for_by_the_process_command():
    """Each of n processes runs the same start-up with its own --warm-shard I/N, which the
    server's parser takes (and refuses outside 0 <= I < N)."""
    p = _parser()
    assert p.parse_args(["--warm-shard", "2/3"]).warm_shard == (2, 3)
    for bad in ("3/3", "x/2", "1"):
        with pytest.raises(SystemExit):
            p.parse_args(["--warm-shard", bad])
