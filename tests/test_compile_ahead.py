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
    # Its log names its phases, which the server sums up beside the process's time.
    summary = compile_ahead.phase_summary(done.stderr)
    assert "loaded cut" in summary and "engine ready" in summary, done.stderr[-2000:]


def test_the_phase_summary_lists_each_timed_phase_in_order():
    text = (
        "2026-12-07 09:47:05,632 headstart.serve: loaded m (qwen35) in 15.9s\n"
        "2026-12-07 09:47:05,700 headstart.serve: state pool: 16 streams x 16384 tokens\n"
        "2026-12-07 09:47:54,143 headstart.engine: prompt graphs in 6.04s (GPU: 4.30 GiB free)\n"
        "a traceback line in 3s\n"
    )
    summary = compile_ahead.phase_summary(text)
    assert summary == " (loaded m (qwen35) 15.9s; prompt graphs 6.0s)"
    assert compile_ahead.phase_summary("no phase here") == ""


def test_no_process_for_the_cpu_or_without_graphs():
    p = _parser()
    for argv in (["--device", "cpu"], ["--device", "cuda", "--no-graphs"]):
        assert _start_compile_ahead(p.parse_args(argv)) is None


def test_the_server_decides_its_dense_copies_before_the_processes_start(monkeypatch, random_27b):
    """``--prefill-weights auto`` is resolved on the memory free before the processes take
    any, for the server's load and the processes alike; where no process fits, none starts.
    (The CUDA plan is stood in for: this machine has no GPU.)"""
    p = _parser()
    for dense, want in ((True, "dense"), (False, "packed")):
        monkeypatch.setattr(compile_ahead, "planned_step_tokens", lambda path, device: 2048)
        plan = (compile_ahead.LoadPlan(1, dense), 0, 0)
        monkeypatch.setattr(compile_ahead, "gpu_plan", lambda path, device, n, plan=plan: plan)
        args = p.parse_args(["--model", str(random_27b), "--device", "cuda"])
        assert args.prefill_weights == "auto"
        assert _start_compile_ahead(args) is None  # no process fits
        assert args.prefill_weights == want
        assert args.dense_top_up  # still the server's choice: copies beside the state pool
    args = p.parse_args(
        ["--model", str(random_27b), "--device", "cuda", "--prefill-weights", "dense"]
    )
    monkeypatch.setattr(compile_ahead, "gpu_plan", lambda path, device, n: plan)
    _start_compile_ahead(args)
    assert args.prefill_weights == "dense"  # asked for: kept
    assert not getattr(args, "dense_top_up", False)


def test_no_process_for_a_small_model():
    """The embedded default model loads in seconds: nothing to overlap."""
    assert compile_ahead.planned_step_tokens(DEFAULT_MODEL_DIR, "cuda") is None


@pytest.fixture(scope="module")
def random_27b(tmp_path_factory) -> Path:
    """config.json of the random 27B 4-bit checkpoint (benchmarks/make_random_checkpoint.py)."""
    import sys

    root = Path(__file__).resolve().parent.parent
    script = root / "benchmarks" / "make_random_checkpoint.py"
    out = tmp_path_factory.mktemp("ckpt") / "m-27b"
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
    return out


def test_the_planned_budget_is_the_one_serve_gives_the_loaded_model(
    random_27b, tmp_path, monkeypatch
):
    """From config.json alone, the step budget serve logged for the random 27B checkpoint on
    the H200 (2048 tokens: BENCHMARKS.md), and the cut of its 64 layers to 4."""
    from types import SimpleNamespace

    import torch

    out = random_27b
    h200 = SimpleNamespace(major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: h200)
    assert compile_ahead.planned_step_tokens(out, "cuda") == 2048
    cut = compile_ahead.cut_folder(out, tmp_path / "cut")
    text = json.loads((cut / "config.json").read_text())
    assert text["num_hidden_layers"] == 4 and len(text["layer_types"]) == 4


GiB = 2**30


@pytest.mark.parametrize("free,total", [(79.1 * GiB, 79.2 * GiB), (139 * GiB, 140 * GiB)])
def test_the_processes_fit_beside_the_servers_load(random_27b, free, total):
    """At 27B 4-bit, eight processes of about 8 GB beside the server's load ran an H100 out of
    memory (session 29): the plan keeps the processes' caps, the load (with the dense copies
    where the loader would keep them) and a tenth of the device within what is free."""
    from headstart.loading import family_for

    free, total = int(free), int(total)
    from headstart.models.qwen35.pipeline import DENSE_FRACTION

    family = family_for(random_27b)
    assert family.dense_fraction == DENSE_FRACTION == 0.4  # the loader's rule, as planned
    params = family.planned_parameters(random_27b)
    plan = compile_ahead.load_plan(random_27b, params, free, total, family.dense_fraction)
    packed = params * (4 / 8 + 4 / 64)
    # The dense copies (2 bytes a weight) fit the H200's 0.4 but not the H100's.
    assert plan.dense == (total > 100 * GiB)
    assert plan.nbytes == int(packed) + (2 * params if plan.dense else 0)
    load = plan.nbytes
    n, cap = compile_ahead.memory_plan(8, free, total, load)
    assert 1 <= n <= 8 and cap >= compile_ahead.PROCESS_BYTES
    assert n * cap + load + total // 10 <= free
    # What the H100 had free beside the load is not enough for eight.
    assert compile_ahead.memory_plan(8, free - 10 * GiB, total, load)[0] < 8
    assert compile_ahead.memory_plan(8, load + total // 10 + GiB, total, load) == (0, 0)


def test_the_load_counts_the_weight_files_where_there_are_any(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    plan = compile_ahead.load_plan(tmp_path, 1000, 10**12, 10**12, 0.4)
    assert plan == compile_ahead.LoadPlan(2000, False)  # bf16: no dense copies to keep
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1234)
    assert compile_ahead.load_plan(tmp_path, 1000, 10**12, 10**12, 0.4).nbytes == 1234


def test_a_process_holds_its_allocator_to_the_servers_cap(monkeypatch):
    """cap_memory: the fraction of the device given to set_per_process_memory_fraction (the
    CUDA calls stand in here: this machine has no GPU; the stand-in checks its device as torch
    does, which refuses an index-less "cuda"); nothing without the variable or off CUDA."""
    import torch
    from torch.cuda._utils import _get_device_index

    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (0, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda,
        "set_per_process_memory_fraction",
        lambda f, d=None: calls.append((f, _get_device_index(d))),
    )
    monkeypatch.delenv(compile_ahead.CAP_ENV, raising=False)
    compile_ahead.cap_memory("cuda")
    monkeypatch.setenv(compile_ahead.CAP_ENV, str(8 * GiB))
    compile_ahead.cap_memory("cpu")
    assert calls == []
    compile_ahead.cap_memory("cuda")
    compile_ahead.cap_memory("cuda:1")
    assert calls == [(0.1, 0), (0.1, 1)]


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
