"""`headstart train-drafter` (training/selfdistill.py): prompt files, the headstart-loaded target
as the trainer's frozen target, batches of continuations, and the command end to end on a tiny
4-bit target: a drafter folder headstart loads, whose greedy decode equals plain decode."""

from __future__ import annotations

import json
import shutil

import pytest
import tiny
import torch

from headstart.cli import main as cli_main
from headstart.engine.spec.drafter import DFlashDrafter
from headstart.loading import default_model_dir, load
from headstart.models.qwen35.model import Qwen35Model
from headstart.tokenizer import Tokenizer
from training.drafter import evaluate_acceptance, tapped_features
from training.selfdistill import (
    HeadstartTarget,
    default_mask_token,
    drafter_config_for,
    read_prompts,
    sequence_batches,
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """As in test_training_drafter: tiny forwards are fastest on one thread under contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_dir())


def with_tokenizer(folder):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir() / name, folder / name)
    return folder


def test_prompt_files(tokenizer, tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("Write a function that adds.\n\nSay hi.\n")
    ids = read_prompts(text, tokenizer, {"enable_thinking": False})
    want = tokenizer.encode_chat(
        [{"role": "user", "content": "Say hi."}], add_generation_prompt=True, enable_thinking=False
    ).ids
    assert len(ids) == 2 and ids[1] == list(want)
    jsonl = tmp_path / "p.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    jsonl.write_text(
        json.dumps({"prompt": "def add(a, b):"}) + "\n" + json.dumps({"messages": messages}) + "\n"
    )
    got = read_prompts(jsonl, tokenizer)
    assert got[0] == tokenizer.encode("def add(a, b):")
    assert got[1] == list(tokenizer.encode_chat(messages, add_generation_prompt=True).ids)
    jsonl.write_text('{"prompt": "x"}\n{"text": "y"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2"):
        read_prompts(jsonl, tokenizer)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(tmp_path / "empty.txt", tokenizer)


def test_headstart_target_gives_what_transformers_gives(tmp_path):
    """Taps (in the order asked, not layer order), embedding rows and the head's weight of a
    headstart-loaded checkpoint equal the transformers model's: the trainer sees the same
    target either way."""
    ref = tiny.causal_lm(seed=5)
    target = HeadstartTarget(Qwen35Model.load(tiny.save_text_only(ref, tmp_path / "t")))
    ids = torch.randint(5, 155, (3, 17), generator=torch.Generator().manual_seed(0))
    for taps in ((0, 2), (2, 0, 1)):
        got = target.tapped_features(ids, taps)
        assert (got - tapped_features(ref, ids, taps)).abs().max() <= 1e-4
    assert torch.allclose(target.get_output_embeddings().weight, ref.lm_head.weight, atol=1e-6)
    assert torch.equal(target.get_input_embeddings()(ids), ref.get_input_embeddings()(ids))
    assert not any(p.requires_grad for p in target.parameters())


def test_continuations_are_greedy_and_keep_the_token_that_ended_them(tmp_path, tokenizer):
    from headstart.generate import greedy_tokens
    from training.selfdistill import generate_continuations

    model = Qwen35Model.load(tiny.save_text_only(tiny.causal_lm(seed=2), tmp_path / "t"))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 155, (n,), generator=gen).tolist() for n in (3, 9, 5)]
    want = [greedy_tokens(model, p, 12) for p in prompts]
    small = tiny.small_tokenizer()
    got = generate_continuations(model, small, prompts, 12, (), streams=2)
    assert got == want
    stop = want[1][4]  # a stop id: each continuation ends at its first occurrence, kept
    got = generate_continuations(model, small, prompts, 12, (stop,), streams=3)
    for g, w in zip(got, want, strict=True):
        assert g == (w[: w.index(stop) + 1] if stop in w else w)
    # Nothing finishes in no time: every continuation is reported unfinished, none cut.
    assert generate_continuations(model, small, prompts, 12, (), timeout_s=0) == [None] * 3


def test_batched_continuations_are_the_engines(tmp_path, tokenizer):
    """The batched generator (the training path) gives what the engine gives (its reference):
    prompts of several lengths in groups smaller than the prompt count, prefills split into
    several forwards, a stop id that ends some continuations early; no time, no continuations."""
    from training.selfdistill import batched_continuations, generate_continuations

    model = Qwen35Model.load(tiny.save_text_only(tiny.causal_lm(seed=3), tmp_path / "t"))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(5, 155, (n,), generator=gen).tolist() for n in (7, 2, 11, 4, 9)]
    small = tiny.small_tokenizer()
    plain = generate_continuations(model, small, prompts, 10, (), streams=5)
    stop = plain[2][3]
    want = generate_continuations(model, small, prompts, 10, (stop,), streams=5)
    assert any(len(w) < 10 for w in want) and any(len(w) == 10 for w in want)
    got = batched_continuations(model, prompts, 10, (stop,), rows=2, prefill_tokens=8)
    assert got == want
    assert batched_continuations(model, prompts, 10, (), rows=5) == plain
    assert batched_continuations(model, prompts, 10, (), timeout_s=0) == [None] * 5


def test_sequence_batches_train_on_generated_tokens_only():
    seqs = [[5, 6, 7, 8, 9], [5, 6, 10], [11, 12, 13, 14]]
    prompt = [2, 2, 3]
    batch = next(sequence_batches(seqs, prompt, batch=3, pad_id=0))
    for ids, valid, loss in zip(*batch.values(), strict=True):
        seq = next(s for s in seqs if s[: int(valid.sum())] == ids[valid].tolist())
        p = prompt[seqs.index(seq)]
        assert loss.tolist() == [p <= i < len(seq) for i in range(ids.shape[0])]
        assert (ids[~valid] == 0).all()


def test_drafter_geometry_defaults():
    class C:  # the fields of headstart's ModelConfig the drafter's geometry comes from
        num_hidden_layers, hidden_size, intermediate_size = 8, 64, 96
        num_attention_heads, num_key_value_heads, head_dim = 4, 2, 32
        rms_norm_eps, rope_theta = 1e-6, 1e7

    d = drafter_config_for(C, layers=3, block=8, mask_token_id=9)
    assert d.target_layer_ids == (1, 3, 5) and d.hidden_size == 64 and d.block_size == 8
    with pytest.raises(ValueError, match="below 7"):
        drafter_config_for(C, layers=2, block=8, mask_token_id=9, taps=[1, 7])
    assert default_mask_token(4160, 4105) == 4159
    with pytest.raises(ValueError, match="mask-token-id"):
        default_mask_token(4105, 4105)


@pytest.fixture(scope="module")
def mlx_target(tmp_path_factory):
    """A tiny random target, 4-bit in the MLX layout, with the default model's tokenizer."""
    ref = tiny.causal_lm(seed=3, vocab_size=4160, tie_word_embeddings=True)
    _, packed = tiny.dequantized_copy(ref, bits=4, group=64)
    out = tmp_path_factory.mktemp("distill") / "target"
    return with_tokenizer(tiny.save_mlx(ref, packed, out, bits=4, group=64))


def test_train_drafter_command_end_to_end(mlx_target, tmp_path, tokenizer):
    """`headstart train-drafter` on a 4-bit target: the folder it writes loads with headstart,
    greedy decode with it equals plain decode (checked strictly), and it drafts what the
    target says on the prompts it was trained on (an untrained drafter is accepted ~1 token a
    round)."""
    requests = [f"Write a function number {i} that adds {i} to x." for i in range(6)]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(requests) + "\n")
    out = tmp_path / "drafter"
    argv = ["train-drafter", "--target", str(mlx_target), "--prompts", str(prompts)]
    argv += ["--out", str(out), "--device", "cpu", "--block", "6", "--taps", "0,2"]
    argv += ["--max-new-tokens", "32", "--steps", "80", "--lr", "3e-3", "--batch", "6"]
    argv += ["--anchors", "8", "--no-think"]
    assert cli_main(argv) == 0
    report = json.loads((out / "train_report.json").read_text())
    assert report["continuations"] == 6 and report["steps"] == 80
    assert report["template_kwargs"] == {"enable_thinking": False}
    assert report["loss_last"] < 0.5 * report["loss_first"]
    loaded = load(str(mlx_target))
    drafter = DFlashDrafter.load(out, loaded.model)
    assert drafter.cfg.block_size == 6 and drafter.cfg.target_layer_ids == (0, 2)
    ids = read_prompts(prompts, tokenizer, {"enable_thinking": False})
    result = evaluate_acceptance(
        mlx_target, out, ids, max_tokens=24, tokenizer=tokenizer, device="cpu", strict=True
    )
    assert result["mismatches"] == 0 and result["tokens"] == 24 * len(ids)
    assert result["mean_accepted_length"] > 2.0, result

    # Going on training it starts where it ended, not where a fresh drafter starts.
    from training.selfdistill import DrafterRecipe, batched_continuations, fit_drafter

    conts = batched_continuations(loaded.model, ids, 32, loaded.eos_token_ids, rows=6)
    recipe = DrafterRecipe(block=6, taps=(0, 2), steps=2, batch=6, anchors=8, lr=1e-9)
    fit = dict(tokenizer_size=tokenizer.vocab_size, eos_token_ids=loaded.eos_token_ids)
    again = fit_drafter(loaded.model, ids, conts, tmp_path / "again", recipe, **fit, init=out)
    assert again["loss_first"] < 0.6 * report["loss_first"], (again, report)
    with pytest.raises(ValueError, match="recipe"):
        other = DrafterRecipe(block=4, taps=(0, 2), steps=1, batch=6, anchors=8)
        fit_drafter(loaded.model, ids, conts, tmp_path / "other", other, **fit, init=out)


def test_train_drafter_command_reports_bad_input(mlx_target, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n")
    argv = ["train-drafter", "--target", str(mlx_target), "--prompts", str(tmp_path / "empty.txt")]
    assert cli_main([*argv, "--out", str(tmp_path / "d"), "--device", "cpu", "--steps", "1"]) == 2
    assert "no prompts" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
