"""The training pipeline on a tiny scale (CPU): data split, target training, MLX export that
headstart loads, perplexity by headstart's own forward."""

from __future__ import annotations

import pytest
import torch

from headstart.loading import default_model_dir, load
from headstart.quant import QuantizedTensor
from headstart.tokenizer import Tokenizer
from training.data import documents, is_held_out, stdlib_files, token_rows
from training.export import export_default, model_files_bytes
from training.target import target_config, train_target


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_dir())


def test_split_is_deterministic_and_disjoint():
    files = stdlib_files()
    held = [f for f in files if is_held_out(f, 0.05)]
    assert files and 0 < len(held) < len(files) // 5
    assert held == [f for f in stdlib_files() if is_held_out(f, 0.05)]
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
    """`python -m training.run` at a toy scale: every stage runs and the result serves."""
    from training.run import main

    out = tmp_path / "default_model"
    report = main(
        [
            "--out",
            str(out),
            "--device",
            "cpu",
            "--steps",
            "3",
            "--drafter-steps",
            "3",
            "--max-chars",
            "150000",
            "--layers",
            "4",
            "--hidden",
            "64",
            "--seq-len",
            "64",
            "--batch",
            "4",
            "--block",
            "4",
            "--eval-prompts",
            "2",
            "--continuations",
            "4",
        ]
    )
    assert (out / "drafter" / "config.json").exists() and (out / "training_report.json").exists()
    assert report["acceptance"]["rounds"] > 0 and report["model_bytes"] < 15_000_000
    assert report["target"]["held_out_ppl"] > 1 and set(report["samples"])
    loaded = load(str(out))
    from headstart.engine.spec.drafter import DFlashDrafter

    DFlashDrafter.load(out / "drafter", loaded.model)


def test_greedy_continuations_are_what_the_target_would_say(tokenizer):
    """Generated with the cache, step by step; a full forward over the result must pick every
    generated token as its argmax (teacher forcing on greedy output is greedy decoding)."""
    from transformers import Qwen3_5ForCausalLM

    from training.continuations import continuation_batches, greedy_continuations

    torch.manual_seed(3)
    model = Qwen3_5ForCausalLM(target_config(4160, [1, 2], layers=4, hidden=64)).eval()
    prompts = torch.randint(5, 4000, (3, 9))
    seqs = greedy_continuations(model, prompts, 12, batch=2)
    assert seqs.shape == (3, 21) and torch.equal(seqs[:, :9], prompts)
    with torch.no_grad():
        argmax = model(seqs).logits.argmax(-1)
    assert torch.equal(argmax[:, 8:-1], seqs[:, 9:])
    item = next(continuation_batches(seqs, 9, batch=5))
    assert item["input_ids"].shape == (5, 21)
    assert not item["loss_mask"][:, :8].any() and item["loss_mask"][:, 8:].all()


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
