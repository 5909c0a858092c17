"""headstart's model against HF transformers (the reference) on tiny random checkpoints."""

from __future__ import annotations

import pytest
import tiny
import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.models.qwen35.model import Qwen35Model

PROMPT_LEN = 45
STEPS = 20
# fp32 against fp32, logits up to ~6: the GDN prefill's chunking differs (HF: 64 rows; the CPU
# kernel set: 32), which moves the last bits by up to ~1.1e-4.
TOL = 2e-4


def hf_prefill_and_greedy(model, ids: torch.Tensor, steps: int):
    """Reference: prefill logits of every prompt row, then greedy tokens and their step logits."""
    with torch.no_grad():
        out = model(ids[None], use_cache=True)
        prefill = out.logits[0]
        cache = out.past_key_values
        token = int(prefill[-1].argmax())
        tokens, step_logits = [token], []
        for _ in range(steps):
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            step_logits.append(out.logits[0, -1])
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
    return prefill, tokens, torch.stack(step_logits)


def ours_prefill_and_greedy(model: Qwen35Model, ids: torch.Tensor, steps: int, slot: int = 1):
    pool = model.new_state_pool(num_slots=3, max_tokens=128)
    n = len(ids)
    prefill = model.forward(ForwardBatch.build([SeqChunk(slot, 0, ids.tolist(), n)]), pool)
    token = int(prefill[-1].argmax())
    tokens, step_logits = [token], []
    for i in range(steps):
        logits = model.forward(ForwardBatch.build([SeqChunk(slot, n + i, (token,))]), pool)[0]
        step_logits.append(logits)
        token = int(logits.argmax())
        tokens.append(token)
    return prefill, tokens, torch.stack(step_logits)


def prompt(vocab: int, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed))


CASES = {
    # value heads = 1x key heads, tied head, the every-4th pattern from full_attention_interval
    "r1-tied": dict(linear_num_value_heads=2, linear_value_head_dim=16, tie_word_embeddings=True),
    # 2x value heads, Dk != Dv, untied
    "r2-untied": dict(linear_num_value_heads=4, linear_value_head_dim=24),
    # 3x value heads, an irregular layer_types list, GQA 3:1
    "r3-irregular": dict(
        linear_num_value_heads=6,
        linear_value_head_dim=8,
        num_hidden_layers=5,
        num_attention_heads=6,
        num_key_value_heads=2,
        layer_types=[
            "full_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
        ],
    ),
}


@pytest.mark.parametrize("placement", ["text-only", "wrapper"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(tmp_path, case, placement):
    ref = tiny.causal_lm(seed=3, **CASES[case])
    save = tiny.save_text_only if placement == "text-only" else tiny.save_wrapper
    ckpt = save(ref, tmp_path / "ckpt")
    ours = Qwen35Model.load(ckpt)
    assert ours.cfg.tie_word_embeddings == ref.config.tie_word_embeddings
    ids = prompt(ref.config.vocab_size)

    want_prefill, want_tokens, want_steps = hf_prefill_and_greedy(ref, ids, STEPS)
    got_prefill, got_tokens, got_steps = ours_prefill_and_greedy(ours, ids, STEPS)

    assert (got_prefill - want_prefill).abs().max() <= TOL
    assert got_tokens == want_tokens
    assert (got_steps - want_steps).abs().max() <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("unpack", [False, True])
def test_mlx_layout_matches_dequantized_reference(tmp_path, bits, group, tied, unpack):
    model = tiny.causal_lm(seed=5, tie_word_embeddings=tied)
    ref, packed = tiny.dequantized_copy(model, bits, group)
    assert any("embed_tokens" in k for k in packed)  # the embedding is quantized too
    ckpt = tiny.save_mlx(ref, packed, tmp_path / "mlx", bits, group)
    # Packed in memory (unpacked per call), or unpacked once at load (a small model).
    ours = Qwen35Model.load(ckpt, unpack_bytes=1 << 30 if unpack else 0)
    from headstart.quant import QuantizedTensor

    assert isinstance(ours.w["layers.0.linear_attn.in_proj.weight"], QuantizedTensor) != unpack
    assert isinstance(ours.head, QuantizedTensor) != unpack
    assert isinstance(ours.w["embed_tokens.weight"], QuantizedTensor)
    ids = prompt(ref.config.vocab_size, seed=11)
    want_prefill, want_tokens, want_steps = hf_prefill_and_greedy(ref, ids, STEPS)
    got_prefill, got_tokens, got_steps = ours_prefill_and_greedy(ours, ids, STEPS)
    assert (got_prefill - want_prefill).abs().max() <= TOL
    assert got_tokens == want_tokens
    assert (got_steps - want_steps).abs().max() <= TOL


@pytest.mark.slow
def test_bf16_error_no_worse_than_transformers_bf16(tmp_path):
    """bf16 has no exact reference; our bf16 logits must be as close to the fp32 truth as HF's."""
    ref = tiny.causal_lm(seed=9)
    ckpt = tiny.save_text_only(ref, tmp_path / "ckpt")
    ids = prompt(ref.config.vocab_size, seed=2)
    with torch.no_grad():
        truth = ref(ids[None]).logits[0]
        hf_bf16 = ref.to(torch.bfloat16)(ids[None]).logits[0].float()
    ours = Qwen35Model.load(ckpt, dtype=torch.bfloat16)
    pool = ours.new_state_pool(1, 64)
    got = ours.forward(ForwardBatch.build([SeqChunk(0, 0, ids.tolist(), PROMPT_LEN)]), pool)
    assert got.dtype == torch.bfloat16
    ours_err = (got.float() - truth).abs().max()
    hf_err = (hf_bf16 - truth).abs().max()
    assert ours_err <= 1.5 * hf_err


@pytest.mark.parametrize("arena", [False, True])
def test_loading_consumes_the_weight_dict(tmp_path, arena):
    """Each projection part is released once its fused stack exists, so loading peaks near one
    copy of the weights: the model keeps no reference to the parts, and the caller's dict is
    emptied. An unfused weight moves into the model as is, or (arena) is copied into its slot
    and the original released."""
    import gc
    import weakref

    from headstart.models.qwen35.config import load_config
    from headstart.models.qwen35.weights import load_weights

    ckpt = tiny.save_text_only(tiny.causal_lm(seed=3), tmp_path / "ckpt")
    cfg = load_config(ckpt)
    weights = load_weights(ckpt, cfg, torch.float32, "cpu")
    part = weakref.ref(weights["layers.0.linear_attn.in_proj_z.weight"])
    kept = weakref.ref(weights["layers.0.mlp.down_proj.weight"])  # not fused
    want = weights["layers.0.mlp.down_proj.weight"].clone()
    model = Qwen35Model(cfg, weights, arena=arena)
    gc.collect()
    assert weights == {} and part() is None
    got = model.w["layers.0.mlp.down_proj.weight"]
    assert torch.equal(got, want)
    if arena:
        assert kept() is None and model.arena.holds(got)
    else:
        assert got is kept() and model.arena is None
