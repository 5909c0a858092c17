"""Nemotron-H against transformers on tiny random configs: prefill logits of every row and
greedy decode steps, several layer patterns, GQA, tied and untied, from transformers' files and
from mlx-lm's layout (4- and 8-bit affine against transformers holding the dequantized weights,
and unquantized); and the invariants (chunked prefill == one shot, a stream in a batch == alone)
through the state pool."""

from __future__ import annotations

import pytest
import torch

from headstart.batch import ForwardBatch, SeqChunk

transformers = pytest.importorskip("transformers")


def hf_model(pattern: str, tmp_path, seed: int, **overrides):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    fields = dict(
        vocab_size=160,
        hidden_size=64,
        hybrid_override_pattern=pattern,
        num_hidden_layers=len(pattern),
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
        eos_token_id=1,
    )
    cfg = NemotronHConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 0.5)  # dt well above 1e-3
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.ndim == 1 else 0.15))
    model.save_pretrained(tmp_path)
    # Greedy references run their whole length (as the engine's ignore_eos does): a random
    # model that picks token 1 would otherwise end transformers' generation there.
    model.generation_config.eos_token_id = None
    return model


def ours(tmp_path):
    from headstart.models.nemotron_h.model import NemotronHModel

    return NemotronHModel.load(tmp_path, torch.float32, "cpu")


def assert_serves_transformers_tokens(
    engine, ref, prompts, max_tokens: int, repetition_penalty: float = 1.0
) -> None:
    """Submit every prompt at once to ``engine`` (greedy), wait for all, and check each stream's
    tokens are what transformers' ``ref`` generates for that prompt alone."""
    from engine_helpers import Collector

    from headstart.engine.engine import EngineRequest, Finish, wait_idle
    from headstart.sampling import SamplingParams

    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        repetition_penalty=repetition_penalty,
    )
    results = []
    for i, ids in enumerate(prompts):
        c = Collector()
        engine.submit(EngineRequest(f"r{i}", ids, params, max_tokens, c))
        results.append(c)
    for c in results:
        assert c.done.wait(120) and isinstance(c.finish, Finish)
    assert wait_idle(engine)
    for ids, c in zip(prompts, results, strict=True):
        with torch.no_grad():
            want = ref.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                do_sample=False,
                repetition_penalty=repetition_penalty,
            )
        assert c.tokens == want[0, len(ids) :].tolist()


CASES = [
    ("M*-M-", {}),
    ("MM*-", {"num_key_value_heads": 4}),
    ("*-M", {"tie_word_embeddings": True}),
    ("M-M*-M", {"n_groups": 1, "use_conv_bias": False}),
]


def mlx_checkpoint(tmp_path, pattern: str, bits: int, seed: int, head: bool = True, **overrides):
    """(transformers' model holding the weights the MLX files give, the MLX folder): quantized
    at ``bits`` with group 64 (0: unquantized). ``head`` False: a tied checkpoint without a
    stored head (transformers' own head is set to the embedding table to match)."""
    import tiny

    ref = hf_model(pattern, tmp_path / "hf", seed, **overrides)
    if not head:
        with torch.no_grad():
            ref.lm_head.weight.copy_(ref.model.embeddings.weight)
    ref, packed = tiny.dequantized_copy(ref, bits, 64) if bits else (ref, {})
    out = tiny.save_mlx_nemotron_h(ref, packed, tmp_path / "mlx", bits or 4, 64, head=head)
    return ref, out


def assert_matches(ref, model) -> None:
    """Prefill logits of a 43-token prompt, 20 greedy steps and the last step's logits."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 160, (43,), generator=gen)
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    pool = model.new_state_pool(2, 128)
    got = model.forward(ForwardBatch.build([SeqChunk(0, 0, ids.tolist(), len(ids))]), pool)
    assert (got - want).abs().max() <= 1e-4
    # 20 greedy steps: transformers' own cached generation against ours, token by token.
    with torch.no_grad():
        out = ref.generate(ids[None], max_new_tokens=20, do_sample=False)
    want_tokens = out[0, len(ids) :].tolist()
    tokens, position = [], len(ids)
    last = int(got[-1].argmax())
    for _ in range(20):
        tokens.append(last)
        step = model.forward(ForwardBatch.build([SeqChunk(0, position, (last,))]), pool)
        position += 1
        last = int(step[0].argmax())
    assert tokens == want_tokens
    # The last step's logits against transformers over the whole sequence in one pass.
    with torch.no_grad():
        whole = ref(torch.tensor([ids.tolist() + tokens])).logits[0, -1]
    assert (step[0] - whole).abs().max() <= 1e-4


@pytest.mark.parametrize("pattern,overrides", CASES)
def test_prefill_and_greedy_steps_match_transformers(tmp_path, pattern, overrides):
    ref = hf_model(pattern, tmp_path, seed=len(pattern), **overrides)
    assert_matches(ref, ours(tmp_path))


MLX_CASES = [  # pattern, bits (0: unquantized), stored head, overrides
    ("M*-M-", 4, True, {"intermediate_size": 128}),
    # MLP width 96: group 64 does not divide down_proj's input, so it stays unquantized.
    ("M-M*-M", 4, True, {"n_groups": 1, "use_conv_bias": False}),
    ("*-M", 4, False, {"tie_word_embeddings": True, "intermediate_size": 128}),
    ("MM*-", 8, True, {"num_key_value_heads": 4, "intermediate_size": 128}),
    ("M*-M", 0, True, {}),
]


@pytest.mark.parametrize("pattern,bits,head,overrides", MLX_CASES)
def test_mlx_checkpoint_matches_transformers_with_its_weights(
    tmp_path, pattern, bits, head, overrides
):
    """Unpacked once at load (a small model) and kept packed (unpacked per call; the embedding
    table only in the rows looked up), both against transformers."""
    from headstart.models.nemotron_h.config import load_config
    from headstart.models.nemotron_h.model import EMBED, NemotronHModel
    from headstart.models.nemotron_h.weights import load_weights
    from headstart.quant import QuantizedTensor

    ref, out = mlx_checkpoint(tmp_path, pattern, bits, len(pattern), head, **overrides)
    cfg = load_config(out)
    assert (cfg.quantization is None) == (bits == 0)
    unpacked = ours(out)
    assert all(isinstance(t, torch.Tensor) for k, t in unpacked.w.items() if k != EMBED)
    assert_matches(ref, unpacked)
    if bits:
        packed = NemotronHModel(cfg, load_weights(out, cfg), unpack_bytes=0)
        assert isinstance(packed.w[EMBED], QuantizedTensor)
        assert isinstance(packed.w["layers.0.norm.weight"], torch.Tensor)
        layer0 = "layers.0.mixer." + ("in_proj" if pattern[0] == "M" else "q_proj")
        assert isinstance(packed.w[layer0 + ".weight"], QuantizedTensor)
        assert isinstance(packed.head, QuantizedTensor)
        assert packed.num_parameters() == unpacked.num_parameters()
        assert_matches(ref, packed)


def test_chunked_prefill_and_batched_streams_equal_one_shot_alone(tmp_path):
    hf_model("M*-M-", tmp_path, seed=3)
    model = ours(tmp_path)
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(2, 160, (37,), generator=gen).tolist()
    b = torch.randint(2, 160, (19,), generator=gen).tolist()
    pool = model.new_state_pool(3, 128)
    one = model.forward(ForwardBatch.build([SeqChunk(0, 0, a)]), pool)
    # The same prompt in three chunks (7 rows, then a chunk of 19 beside another stream's
    # prompt, then the rest), then one decode step for both streams in one batch.
    model.forward(ForwardBatch.build([SeqChunk(1, 0, a[:7], 0)]), pool)
    model.forward(ForwardBatch.build([SeqChunk(1, 7, a[7:26], 0), SeqChunk(2, 0, b)]), pool)
    chunked = model.forward(ForwardBatch.build([SeqChunk(1, 26, a[26:])]), pool)
    assert torch.allclose(chunked, one, atol=1e-5)
    both = model.forward(
        ForwardBatch.build([SeqChunk(1, len(a), (5,)), SeqChunk(2, len(b), (9,))]), pool
    )
    alone = model.forward(ForwardBatch.build([SeqChunk(0, len(a), (5,))]), pool)
    assert torch.allclose(both[0], alone[0], atol=1e-5)
    for name in ("conv", "ssm"):
        assert torch.allclose(getattr(pool, name)[:, 1], getattr(pool, name)[:, 0], atol=1e-5)


def test_the_engine_serves_it_with_the_prompt_cache(tmp_path, engines):
    """Registered through the model contract: the engine batches several streams and restores
    cached prompts (exact and growing), with the same greedy tokens as transformers."""
    import tiny

    from headstart.engine.config import CacheConfig, EngineConfig, SchedulingConfig
    from headstart.models import family_for

    ref = hf_model("M*-M-", tmp_path, seed=5)
    assert family_for(tmp_path).name == "nemotron_h"
    model = family_for(tmp_path).load(tmp_path, torch.float32, "cpu", "reference")
    config = EngineConfig(
        3, 256, scheduling=SchedulingConfig(16, 32), cache=CacheConfig(bytes=16 << 20)
    )
    e = engines(model, tiny.small_tokenizer(), (), config)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 160, (n,), generator=gen).tolist() for n in (23, 9, 40)]
    prompts.append(prompts[2])  # an exact repeat
    prompts.append(prompts[0] + [7, 8, 9])  # a growing prompt: a prefix hit
    assert_serves_transformers_tokens(e, ref, prompts, 10)
    assert e.stats()["cache_hits"] >= 1
    # A repetition penalty, the exact repeat's first token from the cached logits included.
    hits = e.stats()["cache_hits"]
    assert_serves_transformers_tokens(e, ref, prompts, 10, repetition_penalty=1.5)
    assert e.stats()["cache_hits"] > hits


def test_dummy_weights_at_the_configs_shapes(tmp_path):
    """`--load-format dummy`: random weights from config.json alone, a finite forward."""
    from transformers import NemotronHConfig

    from headstart.models.nemotron_h import FAMILY

    NemotronHConfig(
        vocab_size=160,
        hidden_size=64,
        hybrid_override_pattern="M*-",
        num_hidden_layers=3,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
    ).save_pretrained(tmp_path)
    model = FAMILY.load(tmp_path, torch.float32, "cpu", "reference", dummy=True)
    pool = model.new_state_pool(1, 64)
    logits = model.forward(ForwardBatch.build([SeqChunk(0, 0, tuple(range(2, 30)))]), pool)
    assert logits.shape == (1, 160) and logits.isfinite().all()
    assert model.num_parameters() > 0


@pytest.mark.slow
@pytest.mark.parametrize("bits", [None, 4], ids=["transformers", "mlx-4bit"])
def test_served_through_the_openai_api(tmp_path, bits):
    """`headstart serve` on a tiny Nemotron-H folder (the embedded tokenizer and chat template
    beside it; transformers' files, or MLX 4-bit against transformers holding the dequantized
    weights): completions with the official client give transformers' greedy tokens, and a
    repeated prompt is answered from the prompt cache."""
    import shutil

    import openai
    from server_proc import serving

    from headstart.loading import default_model_dir

    if bits is None:
        ref = hf_model("M*-M-", tmp_path, seed=6, vocab_size=4105)
    else:
        ref, tmp_path = mlx_checkpoint(
            tmp_path, "M*-M-", bits, 6, vocab_size=4105, intermediate_size=128
        )
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir() / f, tmp_path / f)
    ids = [12, 400, 37, 2048, 9, 511, 77, 3001]
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    with serving("--model", str(tmp_path), "--parallel", "2", "--context", "256") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        for attempt in range(2):
            r = client.completions.create(
                model=tmp_path.name,
                prompt=ids,
                max_tokens=6,
                temperature=0,
                logprobs=0,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            )
            got = [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
            assert got == want[0, len(ids) :].tolist(), attempt
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert cached == (len(ids) if attempt else 0)


def test_the_engine_with_decode_graphs_serves_what_transformers_generates(tmp_path, engines):
    """With graphs on (emulated on the CPU: the same static batches, run eagerly), the runner
    builds decode graphs only (the family's graph shapes) and the engine's greedy tokens are
    transformers'; new prompts and their chunks run eagerly beside the graphed decode rows."""
    import tiny

    from headstart.engine.config import EngineConfig, GraphConfig, SchedulingConfig
    from headstart.models import family_for

    ref = hf_model("M*-M-", tmp_path, seed=6)
    model = family_for(tmp_path).load(tmp_path, torch.float32, "cpu", "reference")
    config = EngineConfig(
        3,
        256,
        scheduling=SchedulingConfig(16, 32),
        graphs=GraphConfig(enabled=True, capture=False),
    )
    e = engines(model, tiny.small_tokenizer(), (), config)
    runner = e.runner
    assert runner.decode_graphs is not None and runner.prompt_graphs is None
    assert runner.continuation_graphs is None
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, 160, (n,), generator=gen).tolist() for n in (21, 5, 37)]
    assert_serves_transformers_tokens(e, ref, prompts, 8)


def test_kernel_choice():
    from headstart.models.nemotron_h.model import REFERENCE, select_kernels

    assert select_kernels(torch.device("cpu"), "auto") is REFERENCE
    assert select_kernels(torch.device("cpu"), "reference") is REFERENCE
    with pytest.raises(ValueError, match="needs CUDA and Triton"):
        select_kernels(torch.device("cpu"), "gpu")
    with pytest.raises(ValueError, match="kernels must be"):
        select_kernels(torch.device("cpu"), "fast")
