"""The training pipeline on a tiny scale (CPU): data split, target training, MLX export that
headstart loads, perplexity by headstart's own forward."""

from __future__ import annotations

import pytest
import torch

from headstart.loading import default_model_dir, load
from headstart.quant import QuantizedTensor
from headstart.tokenizer import Tokenizer
from training.data import candidate_files, documents, split_of, token_rows
from training.export import export_default, model_files_bytes
from training.target import target_config, train_target


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_dir())


def test_split_is_deterministic_and_disjoint():
    files = candidate_files(packages=False)
    held = [f for f in files if split_of(f.rel) == "held_out"]
    assert files and 0 < len(held) < len(files) // 5
    assert held == [f for f in candidate_files(packages=False) if split_of(f.rel) == "held_out"]
    train_docs = set(documents("train", 200_000))
    held_docs = set(documents("held_out", 200_000))
    assert train_docs and held_docs and not train_docs & held_docs


@pytest.mark.slow
def test_target_trains_exports_and_loads(tokenizer, tmp_path):
    train = token_rows(tokenizer, "train", 64, 150_000)
    held = token_rows(tokenizer, "held_out", 64, 50_000)[:4]
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    torch.manual_seed(0)
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM(target_config(4160, eos, layers=4, hidden=64))
    report = train_target(
        model, train, held, steps=25, time_budget_s=120, batch=8, lr=3e-3, log=lambda *_: None
    )
    first, last = report["loss_history"][0][1], report["loss_history"][-1][1]
    assert report["steps"] == 25 and last < first
    out = export_default(model.eval(), default_model_dir(), tmp_path / "m", eos)
    assert model_files_bytes(out) < 15_000_000
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:  # 4-bit on disk (MLX layout)
        assert any(k.endswith("mlp.gate_proj.scales") for k in f.keys())  # noqa: SIM118 - safe_open is not iterable
    loaded = load(str(out))
    assert isinstance(loaded.model.w["embed_tokens.weight"], QuantizedTensor)
    from training.run import headstart_perplexity

    ppl = headstart_perplexity(out, held[:2], "cpu")
    assert 1 < ppl < report["held_out_ppl"] * 1.5  # 4-bit costs a little, not a lot


@pytest.mark.slow
def test_one_command_pipeline_end_to_end(tmp_path):
    """`python -m training.run` at a toy scale, one stage per call as
    benchmarks/train_default_gpu.sh runs it: every stage runs, the report holds every figure,
    and the result serves with thinking off and its drafter."""
    from training.run import HOW_MEASURED, STAGES, main

    out = tmp_path / "default_model"
    args = ["--out", str(out), "--device", "cpu", "--steps", "3", "--chat-steps", "3"]
    args += ["--drafter-steps", "3", "--max-chars", "150000", "--chat-max-chars", "300000"]
    args += ["--layers", "4", "--hidden", "64", "--seq-len", "64", "--batch", "4"]
    args += ["--block", "4", "--eval-prompts", "2", "--continuations", "4"]
    args += ["--code-max-tokens", "8", "--ppl-rows", "4", "--work", str(tmp_path / "work")]
    for stage in STAGES:
        report = main([*args, "--stage", stage])
    assert set(report["stage_seconds"]) == set(STAGES)
    assert (out / "drafter" / "config.json").exists() and (out / "training_report.json").exists()
    assert report["acceptance"]["rounds"] > 0 and report["model_bytes"] < 15_000_000
    assert report["target"]["held_out_ppl"] > 1 and report["exported_held_out_ppl"] > 1
    assert report["chat"]["steps"] == 3 and report["drafter"]["steps"] == 3
    assert report["code"]["prompts"] == 20 and len(report["code"]["answers"]) == 20
    assert set(report["samples"]) == {"completion", "chat"} and report["samples"]["chat"]
    assert set(HOW_MEASURED) <= set(report["how_measured"])
    loaded = load(str(out))
    assert loaded.template_defaults == {"enable_thinking": False}
    from headstart.engine.spec.drafter import DFlashDrafter

    DFlashDrafter.load(out / "drafter", loaded.model)


@pytest.mark.slow
def test_early_stopping_restores_the_best_validation_weights(tokenizer):
    """A learning rate high enough to overshoot: whatever the run does, the weights it returns
    are those of its best validation perplexity."""
    from transformers import Qwen3_5ForCausalLM

    from training.target import perplexity

    rows = token_rows(tokenizer, "train", 32, 60_000)
    train, val = rows[:-4], rows[-4:]
    torch.manual_seed(1)
    model = Qwen3_5ForCausalLM(target_config(4160, [1, 2], layers=4, hidden=64))
    report = train_target(
        model,
        train,
        val[:2],
        steps=24,
        time_budget_s=120,
        batch=4,
        lr=3e-2,
        val=val,
        eval_every=3,
        patience=2,
        log=lambda *_: None,
    )
    history = dict(report["val_history"])
    assert report["best_step"] == min(history, key=history.get)
    assert perplexity(model, val, 4, "cpu", torch.float32) == pytest.approx(
        history[report["best_step"]], rel=1e-4
    )
