"""Nemotron-H config and weight layout against transformers (the reference), on tiny checkpoints
written by ``NemotronHConfig.save_pretrained`` / ``NemotronHForCausalLM.save_pretrained`` and on
config.json files spelled as NVIDIA's checkpoints spell them. Nothing is downloaded."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from headstart.errors import CheckpointError, ConfigError
from headstart.models.nemotron_h.config import ATTENTION, MAMBA, MLP, ModelConfig, load_config
from headstart.models.nemotron_h.weights import expected_shapes, load_weights, stored_name

transformers = pytest.importorskip("transformers")
from transformers import NemotronHConfig, NemotronHForCausalLM
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

BASE = dict(
    vocab_size=96,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=4,
    mamba_head_dim=16,
    ssm_state_size=8,
    n_groups=2,
    conv_kernel=4,
    chunk_size=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

CASES = {
    "gqa-untied": dict(hybrid_override_pattern="M*-M-"),
    "mha-tied": dict(
        hybrid_override_pattern="MM*-", num_key_value_heads=4, tie_word_embeddings=True
    ),
    "mqa-biases": dict(
        hybrid_override_pattern="M-M*",
        num_key_value_heads=1,
        use_bias=True,
        mlp_bias=True,
        use_conv_bias=False,
    ),
    "list-form": dict(
        layers_block_type=[MAMBA, MLP, ATTENTION, MLP, MAMBA],
        head_dim=16,  # q_dim 64 != hidden 32, as in real checkpoints
    ),
    # expand * hidden (96) disagrees with heads * head_dim (64): transformers uses the latter.
    "expand-disagrees": dict(
        hybrid_override_pattern="M*", mamba_num_heads=8, mamba_head_dim=8, n_groups=4, expand=3
    ),
}


def hf_config(**overrides) -> NemotronHConfig:
    return NemotronHConfig(**{**BASE, **overrides})


def save_config(tmp: Path, **overrides) -> Path:
    hf_config(**overrides).save_pretrained(tmp)
    return tmp


def hf_model(seed: int = 0, **overrides) -> NemotronHForCausalLM:
    torch.manual_seed(seed)
    return NemotronHForCausalLM(hf_config(**overrides)).float().eval()


def canonical_state(model: NemotronHForCausalLM) -> dict[str, torch.Tensor]:
    """transformers' in-memory state dict (``model.*``) under our canonical names."""
    out = {}
    for name, t in model.state_dict().items():
        canon = name.removeprefix("model.")
        out[canon] = t.squeeze(1) if canon.endswith("conv1d.weight") else t
    return out


# -- configs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_sizes_match_transformers(tmp_path, case):
    """Layer kinds and every derived size agree with the modules transformers builds."""
    cfg = load_config(save_config(tmp_path, **CASES[case]))
    hf = NemotronHForCausalLM(hf_config(**CASES[case]))
    assert cfg.layer_types == tuple(hf.config.layers_block_type)
    assert cfg.num_hidden_layers == len(hf.model.layers)
    assert cfg.hybrid_override_pattern == hf.config.hybrid_override_pattern
    assert cfg.tie_word_embeddings == CASES[case].get("tie_word_embeddings", False)
    for i, block in enumerate(hf.model.layers):
        mixer = block.mixer
        if i in cfg.mamba_layers:
            assert cfg.mamba_intermediate_size == mixer.intermediate_size
            assert cfg.mamba_conv_dim == mixer.conv_dim
            assert cfg.mamba_in_proj_dim == mixer.in_proj.out_features
            assert cfg.mamba_norm_group_size == mixer.norm.group_size
            assert (cfg.use_bias, cfg.use_conv_bias) == (
                mixer.in_proj.bias is not None,
                mixer.conv1d.bias is not None,
            )
        elif i in cfg.attention_layers:
            assert (cfg.q_dim, cfg.kv_dim) == (mixer.q_proj.out_features, mixer.k_proj.out_features)
            assert cfg.head_dim == mixer.head_dim
        else:
            assert i in cfg.mlp_layers
            assert cfg.intermediate_size == mixer.up_proj.out_features
            assert cfg.mlp_bias == (mixer.up_proj.bias is not None)
    assert cfg.eos_token_ids == (2,) and (cfg.bos_token_id, cfg.pad_token_id) == (1, 0)
    assert cfg.time_step_limit == (0.0, math.inf)  # written as {"__float__": "Infinity"}
    assert cfg.layer_norm_epsilon == 1e-5 and cfg.dtype == "bfloat16"  # none written: default


def test_expand_is_not_the_mamba_width(tmp_path):
    cfg = load_config(save_config(tmp_path, **CASES["expand-disagrees"]))
    assert cfg.expand * cfg.hidden_size == 96
    assert cfg.mamba_intermediate_size == 64
    assert cfg.mamba_heads_per_group == 2


# NVIDIA-Nemotron-Nano-9B-v2's config.json as NVIDIA writes it (remote-code spellings: pattern
# string, num_hidden_layers, bare Infinity, torch_dtype, both epsilon spellings).
NANO_9B_V2 = """{
  "architectures": ["NemotronHForCausalLM"],
  "attention_bias": false,
  "bos_token_id": 1,
  "chunk_size": 128,
  "conv_kernel": 4,
  "eos_token_id": 12,
  "expand": 2,
  "head_dim": 128,
  "hidden_size": 4480,
  "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
  "intermediate_size": 15680,
  "layer_norm_epsilon": 1e-05,
  "mamba_head_dim": 80,
  "mamba_hidden_act": "silu",
  "mamba_num_heads": 128,
  "mamba_proj_bias": false,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "mlp_hidden_act": "relu2",
  "model_type": "nemotron_h",
  "n_groups": 8,
  "num_attention_heads": 40,
  "num_hidden_layers": 56,
  "num_key_value_heads": 8,
  "pad_token_id": 0,
  "residual_in_fp32": false,
  "rms_norm_eps": 1e-05,
  "sliding_window": null,
  "ssm_state_size": 128,
  "tie_word_embeddings": false,
  "time_step_floor": 0.0001,
  "time_step_limit": [0.0, Infinity],
  "time_step_max": 0.1,
  "time_step_min": 0.001,
  "torch_dtype": "bfloat16",
  "use_bias": false,
  "use_conv_bias": true,
  "vocab_size": 131072
}"""


def test_nvidia_spelled_config_at_real_size(tmp_path):
    (tmp_path / "config.json").write_text(NANO_9B_V2)
    cfg = load_config(tmp_path)
    assert cfg.num_hidden_layers == 56 and cfg.dtype == "bfloat16"
    assert cfg.attention_layers == (14, 21, 30, 39)
    assert (len(cfg.mamba_layers), len(cfg.mlp_layers)) == (27, 25)
    assert (cfg.mamba_intermediate_size, cfg.mamba_conv_dim, cfg.mamba_in_proj_dim) == (
        10240,
        12288,
        22656,
    )
    assert (cfg.q_dim, cfg.kv_dim, cfg.time_step_limit) == (5120, 1024, (0.0, math.inf))
    # transformers reads the same file to the same sizes (one mixer, built without memory).
    hf = NemotronHConfig.from_pretrained(tmp_path)
    assert cfg.layer_types == tuple(hf.layers_block_type)
    with torch.device("meta"):
        mixer = NemotronHMamba2Mixer(hf, layer_idx=0)
    assert mixer.in_proj.weight.shape == (cfg.mamba_in_proj_dim, cfg.hidden_size)
    assert mixer.conv1d.weight.shape == (cfg.mamba_conv_dim, 1, cfg.conv_kernel)
    assert mixer.out_proj.weight.shape == (cfg.hidden_size, cfg.mamba_intermediate_size)


def test_mamba_aliases_read_as_transformers_reads_them(tmp_path):
    data = json.loads(NANO_9B_V2)
    for name in ("n_groups", "conv_kernel", "chunk_size", "use_conv_bias", "time_step_limit"):
        data.pop(name)
    data.update(
        mamba_n_groups=4,
        mamba_d_conv=3,
        mamba_chunk_size=64,
        mamba_conv_bias=False,
        mamba_dt_limit=[0.0, 0.5],
        attention_head_dim=64,
    )
    data.pop("head_dim")
    (tmp_path / "config.json").write_text(json.dumps(data))
    cfg = load_config(tmp_path)
    hf = NemotronHConfig.from_pretrained(tmp_path)
    assert (cfg.n_groups, cfg.conv_kernel, cfg.chunk_size, cfg.use_conv_bias) == (
        hf.n_groups,
        hf.conv_kernel,
        hf.chunk_size,
        hf.use_conv_bias,
    )
    assert cfg.time_step_limit == tuple(hf.time_step_limit) == (0.0, 0.5)
    assert cfg.head_dim == 64


def test_head_dim_derived_when_absent(tmp_path):
    data = json.loads(NANO_9B_V2)
    data.pop("head_dim")
    data.update(hidden_size=5120)
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert load_config(tmp_path).head_dim == 128


def test_pure_mamba_needs_no_attention_or_mlp_sizes(tmp_path):
    data = json.loads(NANO_9B_V2)
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        data.pop(key)
    data.update(hybrid_override_pattern="MMM", num_hidden_layers=3)
    (tmp_path / "config.json").write_text(json.dumps(data))
    cfg = load_config(tmp_path)
    assert cfg.mamba_layers == (0, 1, 2) and not cfg.attention_layers


def test_legacy_layer_names_and_generation_config(tmp_path):
    save_config(tmp_path, hybrid_override_pattern="M*-")
    data = json.loads((tmp_path / "config.json").read_text())
    data["layers_block_type"] = ["mamba", "attention", "mlp"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 11], "temperature": 0.6, "top_p": 0.95})
    )
    cfg = load_config(tmp_path)
    assert cfg.layer_types == (MAMBA, ATTENTION, MLP)
    assert cfg.eos_token_ids == (2, 11)
    assert dict(cfg.generation_defaults) == {"temperature": 0.6, "top_p": 0.95}


def test_mlx_quantization_block(tmp_path):
    """mlx-lm's block (and its quantization_config mirror), per-module overrides by the
    checkpoint's own names."""
    data = json.loads(NANO_9B_V2)
    block = {
        "group_size": 64,
        "bits": 4,
        "mode": "affine",
        "backbone.layers.0.mixer.in_proj": {"group_size": 64, "bits": 8},
        "lm_head": False,
    }
    data.update(quantization=block, quantization_config=block)
    (tmp_path / "config.json").write_text(json.dumps(data))
    q = load_config(tmp_path).quantization
    assert q is not None and (q.default.bits, q.default.group_size) == (4, 64)
    assert q.spec_for("layers.0.mixer.in_proj").bits == 8
    assert q.spec_for("layers.10.mixer.in_proj").bits == 4
    assert q.spec_for("lm_head") is None
    assert load_config(write(tmp_path, json.loads(NANO_9B_V2))).quantization is None


def test_config_is_frozen(tmp_path):
    cfg = load_config(save_config(tmp_path, hybrid_override_pattern="M*"))
    with pytest.raises(AttributeError):
        cfg.hidden_size = 64  # type: ignore[misc]
    assert isinstance(cfg, ModelConfig)


# -- broken configs ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    """config.json as transformers writes it for a model with all three layer kinds."""
    d = save_config(tmp_path_factory.mktemp("cfg"), hybrid_override_pattern="M*-M-")
    return json.loads((d / "config.json").read_text())


def write(tmp: Path, data: dict | str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(data if isinstance(data, str) else json.dumps(data))
    return tmp


REQUIRED = [
    "vocab_size",
    "hidden_size",
    "mamba_num_heads",
    "mamba_head_dim",
    "ssm_state_size",
    "n_groups",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "layers_block_type",
]


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_required_field_is_named(tmp_path, written, field):
    data = copy.deepcopy(written)
    del data[field]
    with pytest.raises(ConfigError, match="missing") as e:
        load_config(write(tmp_path, data))
    assert e.value.field == field
    assert e.value.file == str(tmp_path / "config.json")


PATTERN = {"layers_block_type": None}  # None: delete the key

INVALID = [
    ({"hidden_size": 0}, "hidden_size", ">= 1"),
    ({"vocab_size": "big"}, "vocab_size", "integer"),
    ({"mamba_head_dim": 1.5}, "mamba_head_dim", "integer"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "does not divide"),
    ({"n_groups": 3}, "n_groups", "does not divide mamba_num_heads"),
    ({"mamba_n_groups": 4}, "mamba_n_groups", "disagrees with n_groups"),
    ({"rms_norm_eps": 1e-6}, "rms_norm_eps", "disagrees with layer_norm_epsilon"),
    ({**PATTERN, "hybrid_override_pattern": "M*-X"}, "hybrid_override_pattern", "'X'"),
    ({**PATTERN, "hybrid_override_pattern": "M*E-"}, "hybrid_override_pattern", "mixture-of"),
    ({**PATTERN, "hybrid_override_pattern": ""}, "hybrid_override_pattern", "no layer"),
    ({**PATTERN, "hybrid_override_pattern": 5}, "hybrid_override_pattern", "string"),
    (
        {**PATTERN, "hybrid_override_pattern": "M*-M", "num_hidden_layers": 5},
        "num_hidden_layers",
        "has 4 layers",
    ),
    ({"num_hidden_layers": 4}, "num_hidden_layers", "has 5 layers"),
    ({"hybrid_override_pattern": "M*-MM"}, "hybrid_override_pattern", "disagrees"),
    ({"layers_block_type": "M*-M-"}, "layers_block_type", "list of strings"),
    ({"layers_block_type": [MAMBA, "cross"]}, "layers_block_type", "'cross'"),
    ({"layers_block_type": [MAMBA, "moe"]}, "layers_block_type", "mixture-of"),
    ({"conv_kernel": 1}, "conv_kernel", ">= 2"),
    ({"chunk_size": 0}, "chunk_size", ">= 1"),
    ({"head_dim": 0}, "head_dim", ">= 1"),
    ({"layer_norm_epsilon": 0}, "layer_norm_epsilon", "> 0"),
    ({"layer_norm_epsilon": "tiny"}, "layer_norm_epsilon", "number"),
    ({"time_step_limit": [0.1]}, "time_step_limit", "pair"),
    ({"time_step_limit": [0.5, 0.1]}, "time_step_limit", "low <= high"),
    ({"time_step_limit": [{"__float__": "NaN"}, 1.0]}, "time_step_limit", "low <= high"),
    ({"time_step_min": 0}, "time_step_min", "0 < time_step_min"),
    ({"time_step_max": {"__float__": "Infinity"}}, "time_step_max", "finite"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act", "relu2"),
    ({"mamba_hidden_act": "relu"}, "mamba_hidden_act", "silu"),
    ({"attention_bias": True}, "attention_bias", "not supported"),
    ({"sliding_window": 1024}, "sliding_window", "not supported"),
    (
        {"quantization_config": {"quant_method": "fp8"}},
        "quantization_config.quant_method",
        "only MLX affine",
    ),
    (
        {"quantization": {"bits": 4, "group_size": 128, "quant_method": "gptq"}},
        "quantization.quant_method",
        "'gptq' is not supported",
    ),
    ({"quantization": {"bits": 3, "group_size": 64}}, "quantization.bits", "not supported"),
    ({"quantization": {"bits": 4, "group_size": 48}}, "quantization.group_size", "32, 64"),
    (
        {"quantization": {"bits": 4, "group_size": 64, "mode": "mxfp4"}},
        "quantization.mode",
        "affine",
    ),
    ({"quantization": "4bit"}, "quantization", "object"),
    ({"eos_token_id": 500}, "eos_token_id", "outside the vocabulary"),
    ({"eos_token_id": [2, "x"]}, "eos_token_id", "token id"),
    ({"bos_token_id": -1}, "bos_token_id", ">= 0"),
    ({"pad_token_id": 96}, "pad_token_id", "outside the vocabulary"),
    ({"dtype": "int8"}, "dtype", "not supported"),
    ({"dtype": None, "torch_dtype": "float64"}, "torch_dtype", "not supported"),
    ({"mamba_ssm_cache_dtype": "fp8"}, "mamba_ssm_cache_dtype", "not supported"),
    ({"model_type": "llama"}, "model_type", "nemotron_h"),
    ({"use_bias": "no"}, "use_bias", "true or false"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings", "true or false"),
]


@pytest.mark.parametrize(
    "change,field,problem", INVALID, ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(INVALID)]
)
def test_invalid_field_is_named(tmp_path, written, change, field, problem):
    data = copy.deepcopy(written)
    for key, value in change.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, data))
    assert e.value.field == field, str(e.value)
    assert e.value.file == str(tmp_path / "config.json")
    assert problem in e.value.problem, str(e.value)
    assert field in str(e.value) and "config.json" in str(e.value)


def test_generation_config_eos_outside_vocab_names_that_file(tmp_path, written):
    write(tmp_path, written)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 500]}))
    with pytest.raises(ConfigError, match="outside the vocabulary") as e:
        load_config(tmp_path)
    assert e.value.file == str(tmp_path / "generation_config.json")


def test_missing_and_unparseable_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(write(tmp_path, '{"hidden_size": 5'))
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(write(tmp_path, "[1, 2]"))


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**12),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.lists(st.one_of(st.integers(-2, 3), st.sampled_from(["M", MAMBA, "moe"])), max_size=4),
    st.dictionaries(st.sampled_from(["__float__", "x"]), st.sampled_from(["Infinity", "NaN"])),
    st.sampled_from(["M*-", "E", "relu2", "silu", "bfloat16", MAMBA]),
)
KEYS = sorted(json.loads(NANO_9B_V2)) + [
    "layers_block_type",
    "mamba_n_groups",
    "mamba_dt_limit",
    "quantization",
]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from(KEYS), junk), min_size=1, max_size=3))
def test_fuzzed_configs_load_or_raise_config_error(tmp_path, ops):
    data = json.loads(NANO_9B_V2)
    for delete, key, value in ops:
        if delete:
            data.pop(key, None)
        else:
            data[key] = value
    try:
        text = json.dumps(data)
    except ValueError:
        return
    with contextlib.suppress(ConfigError):  # anything else escaping fails the test
        load_config(write(tmp_path, text))


# -- weights -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_checkpoint_loads_every_tensor(tmp_path, case):
    """Every tensor transformers saves is found, at the config's shapes, with its values."""
    model = hf_model(**CASES[case])
    model.save_pretrained(tmp_path)
    cfg = load_config(tmp_path)
    weights = load_weights(tmp_path, cfg)
    reference = canonical_state(model)
    assert set(weights) == set(reference)  # lm_head too when tied: transformers stores it
    shapes = expected_shapes(cfg)
    assert set(shapes) | {"lm_head.weight"} == set(reference)
    for name, want in reference.items():
        assert tuple(want.shape) == shapes.get(name, (cfg.vocab_size, cfg.hidden_size)), name
        got = weights[name]
        assert got.dtype == torch.float32 and torch.equal(got, want), name


def test_names_are_transformers_file_names(tmp_path):
    model = hf_model(hybrid_override_pattern="M*-")
    model.save_pretrained(tmp_path)
    stored = set(load_file(tmp_path / "model.safetensors"))
    assert {stored_name(n) for n in expected_shapes(load_config(tmp_path))} == stored
    assert "backbone.layers.0.mixer.A_log" in stored and "backbone.norm_f.weight" in stored


def test_dtypes_and_laziness(tmp_path, monkeypatch):
    hf_model(hybrid_override_pattern="M*-").save_pretrained(tmp_path)
    cfg = load_config(tmp_path)
    from headstart.models.qwen35 import weights as shared

    reads = []
    real = shared._Source.read
    monkeypatch.setattr(shared._Source, "read", lambda self: reads.append(self.name) or real(self))
    weights = load_weights(tmp_path, cfg, dtype=torch.bfloat16)
    meta = weights.meta()
    assert not reads  # checked and described from the headers alone
    fp32 = {n for n, t in meta.items() if t.dtype == torch.float32}
    assert fp32 == {
        "layers.0.mixer.A_log",
        "layers.0.mixer.D",
        "layers.0.mixer.dt_bias",
        "layers.0.mixer.norm.weight",
        "layers.0.norm.weight",
        "layers.1.norm.weight",
        "layers.2.norm.weight",
        "norm_f.weight",
    }
    assert all(t.dtype == torch.bfloat16 for n, t in meta.items() if n not in fp32)
    assert weights.pop("layers.0.mixer.conv1d.weight").shape == (cfg.mamba_conv_dim, 4)
    assert reads == ["backbone.layers.0.mixer.conv1d.weight"]
    eager = load_weights(tmp_path, cfg, lazy=False)
    assert isinstance(eager, dict) and len(eager) == len(expected_shapes(cfg))


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ckpt") / "good"
    hf_model(seed=1, hybrid_override_pattern="M*-M-").save_pretrained(d)
    return d


def edit(good: Path, tmp_path: Path, change) -> Path:
    d = shutil.copytree(good, tmp_path / "ckpt")
    tensors = load_file(d / "model.safetensors")
    change(tensors)
    save_file(tensors, d / "model.safetensors")
    return d


def load(d: Path):
    return load_weights(d, load_config(d))


def test_tied_without_a_stored_head_uses_the_embeddings(tmp_path):
    hf_model(hybrid_override_pattern="M*-", tie_word_embeddings=True).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    weights = load(tmp_path)
    assert "lm_head.weight" not in weights and "embeddings.weight" in weights


def test_untied_without_a_head_is_named(good, tmp_path):
    d = edit(good, tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="'lm_head.weight' is missing"):
        load(d)


def test_model_prefix_layout_and_ignored_mtp(good, tmp_path):
    """transformers' in-memory names (``model.*``) read the same; ``mtp.*`` is skipped."""

    def rename(t):
        for name in [n for n in t if n.startswith("backbone.")]:
            t["model." + name.removeprefix("backbone.")] = t.pop(name)
        t["mtp.layers.0.norm.weight"] = torch.ones(3)

    d = edit(good, tmp_path, rename)
    a, b = load(good), load(d)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_tensor_is_named(good, tmp_path):
    d = edit(good, tmp_path, lambda t: t.pop("backbone.layers.3.mixer.A_log"))
    with pytest.raises(CheckpointError, match="'backbone.layers.3.mixer.A_log' is missing") as e:
        load(d)
    assert str(d) in str(e.value)


@pytest.mark.parametrize(
    "name,shape",
    [
        ("backbone.layers.1.mixer.k_proj.weight", (24, 32)),
        ("backbone.layers.0.mixer.conv1d.weight", (96, 1, 3)),
        ("backbone.layers.0.mixer.conv1d.weight", (96, 2, 4)),
        ("backbone.layers.0.mixer.in_proj.weight", (163, 32)),
        ("backbone.layers.0.mixer.norm.weight", (32,)),
        ("backbone.embeddings.weight", (95, 32)),
    ],
)
def test_wrong_shape_is_named(good, tmp_path, name, shape):
    d = edit(good, tmp_path, lambda t: t.update({name: torch.zeros(shape)}))
    with pytest.raises(CheckpointError, match=f"'{name}' has shape") as e:
        load(d)
    assert str(d / "model.safetensors") in str(e.value)


def test_config_disagreeing_with_weights(good, tmp_path):
    d = shutil.copytree(good, tmp_path / "ckpt")
    data = json.loads((d / "config.json").read_text())
    data["intermediate_size"] = 64
    (d / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="mixer.up_proj.weight' has shape"):
        load(d)


@pytest.mark.parametrize(
    "name",
    ["backbone.layers.1.mixer.q_proj.bias", "backbone.layers.9.norm.weight", "vision.proj"],
)
def test_unexpected_tensor_is_named(good, tmp_path, name):
    d = edit(good, tmp_path, lambda t: t.update({name: torch.zeros(4)}))
    with pytest.raises(CheckpointError, match=f"unexpected tensor '{name}'") as e:
        load(d)
    assert str(d / "model.safetensors") in str(e.value)


def test_non_float_tensor_is_named(good, tmp_path):
    name = "backbone.layers.0.mixer.D"
    d = edit(good, tmp_path, lambda t: t.update({name: torch.zeros(4, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match=f"'{name}' has non-float dtype"):
        load(d)


def test_sharded_checkpoint_and_a_tensor_stored_twice(good, tmp_path):
    d = shutil.copytree(good, tmp_path / "ckpt")
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, d / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load(good), load(d)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    second = d / "model-00002-of-00002.safetensors"
    extra = load_file(second)
    extra["model.norm_f.weight"] = tensors["backbone.norm_f.weight"]
    save_file(extra, second)
    with pytest.raises(CheckpointError, match="norm_f.weight' is stored twice"):
        load(d)


@pytest.mark.parametrize("keep", [0.0, 0.01, 0.5, 0.99])
def test_truncated_file_is_named(good, tmp_path, keep):
    d = shutil.copytree(good, tmp_path / "ckpt")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load(d)


# -- MLX layout (mlx-lm's nemotron_h: transformers' names, conv [C, K, 1], affine-quantized) ----


@pytest.fixture(scope="module")
def mlx(tmp_path_factory) -> tuple[NemotronHForCausalLM, dict, Path]:
    """(transformers' model, {HF module: QuantizedTensor}, its MLX 4-bit folder, group 32).
    Hidden 32 and the Mamba width 64 are multiples of the group; the MLP width 48 is not, so
    down_proj stays unquantized, as mlx-lm leaves it."""
    import tiny

    model = hf_model(seed=2, hybrid_override_pattern="M*-M-")
    _, packed = tiny.dequantized_copy(model, 4, 32)
    d = tiny.save_mlx_nemotron_h(model, packed, tmp_path_factory.mktemp("mlx") / "q4", 4, 32)
    return model, packed, d


def test_mlx_checkpoint_keeps_quantized_modules_packed(mlx, monkeypatch):
    from headstart.models.qwen35 import weights as shared
    from headstart.quant import QuantizedTensor

    model, packed, d = mlx
    cfg = load_config(d)
    reads = []
    real = shared._Source.read
    monkeypatch.setattr(shared._Source, "read", lambda self: reads.append(self.name) or real(self))
    weights = load_weights(d, cfg, dtype=torch.bfloat16)
    meta = weights.meta()
    assert not reads  # checked and described from the headers alone
    assert isinstance(meta["layers.0.mixer.in_proj.weight"], QuantizedTensor)
    reference = canonical_state(model)
    assert set(weights) == set(reference)
    modules = {n.removeprefix("model.") + ".weight": q for n, q in packed.items()}
    quantized = set(modules)
    assert "layers.2.mixer.down_proj.weight" not in quantized  # 48 inputs: not a group multiple
    assert {"embeddings.weight", "lm_head.weight", "layers.1.mixer.o_proj.weight"} <= quantized
    for name, want in reference.items():
        got = weights.pop(name)
        if name in quantized:
            q = modules[name]
            assert isinstance(got, QuantizedTensor) and (got.bits, got.group_size) == (4, 32)
            assert torch.equal(got.packed, q.packed) and torch.equal(got.scales, q.scales)
            assert torch.equal(got.biases, q.biases), name
        else:
            assert isinstance(got, torch.Tensor), name
            assert torch.equal(got, want.to(got.dtype)), name
            assert got.shape == meta[name].shape and got.dtype == meta[name].dtype, name


def test_unquantized_mlx_layout_reads_as_transformers_files(tmp_path):
    """No quantization: only the conv weight's layout differs ([C, K, 1])."""
    import tiny

    model = hf_model(seed=3, hybrid_override_pattern="M*-M-")
    d = tiny.save_mlx_nemotron_h(model, {}, tmp_path)
    stored = load_file(d / "model.safetensors")
    assert stored["backbone.layers.0.mixer.conv1d.weight"].shape == (96, 4, 1)
    weights = load(d)
    reference = canonical_state(model)
    assert set(weights) == set(reference)
    assert all(torch.equal(weights[k], reference[k]) for k in reference)


def _drop(name):
    return lambda t: t.pop(name)


IN_PROJ = "backbone.layers.0.mixer.in_proj"
BROKEN_MLX = [
    (_drop(IN_PROJ + ".biases"), IN_PROJ + ".scales", "no '" + IN_PROJ + ".biases' beside it"),
    (_drop(IN_PROJ + ".scales"), IN_PROJ + ".biases", "no '.scales' beside it"),
    (_drop(IN_PROJ + ".weight"), IN_PROJ + ".weight", "is missing"),
    (
        lambda t: t.update({IN_PROJ + ".weight": torch.zeros(164, 5, dtype=torch.uint32)}),
        IN_PROJ + ".weight",
        "expected uint32 (164, 4) for 4-bit weights",
    ),
    (
        lambda t: t.update({IN_PROJ + ".weight": torch.zeros(164, 4)}),
        IN_PROJ + ".weight",
        "torch.float32 (164, 4), expected uint32",
    ),
    (
        lambda t: t.update({IN_PROJ + ".scales": torch.zeros(164, 2)}),
        IN_PROJ + ".scales",
        "expected float (164, 1)",
    ),
    (
        lambda t: t.update({IN_PROJ + ".biases": torch.zeros(164, 1, dtype=torch.int32)}),
        IN_PROJ + ".biases",
        "expected float (164, 1)",
    ),
    (
        lambda t: t.update({"backbone.layers.0.norm.scales": torch.zeros(1)}),
        "backbone.layers.0.norm.scales",
        "which MLX never does",
    ),
    (
        lambda t: t.update({"backbone.layers.0.mixer.conv1d.weight": torch.zeros(96, 4, 2)}),
        "backbone.layers.0.mixer.conv1d.weight",
        "has shape (96, 4, 2), config implies (96, 1, 4)",
    ),
    (
        lambda t: t.update({"backbone.layers.2.mixer.down_proj.biases": torch.zeros(32, 1)}),
        "backbone.layers.2.mixer.down_proj.biases",
        "no '.scales' beside it",
    ),
    (
        lambda t: t.update({"backbone.layers.0.mixer.gate.scales": torch.zeros(1)}),
        "backbone.layers.0.mixer.gate.scales",
        "unexpected tensor",
    ),
]


@pytest.mark.parametrize(
    "change,name,problem", BROKEN_MLX, ids=[f"{n}-{i}" for i, (_, n, _) in enumerate(BROKEN_MLX)]
)
def test_broken_mlx_tensor_is_named(mlx, tmp_path, change, name, problem):
    d = edit(mlx[2], tmp_path, change)
    with pytest.raises(CheckpointError) as e:
        load(d)
    message = str(e.value)
    assert f"'{name}'" in message and problem in message, message
    assert str(d) in message


@pytest.mark.parametrize(
    "block,problem",
    [
        (None, "config.json has no quantization"),
        ({"bits": 4, "group_size": 32, "lm_head": False}, "'lm_head' quantized, but config.json"),
        ({"bits": 8, "group_size": 32}, "for 8-bit weights"),
        ({"bits": 4, "group_size": 64}, "group size 64 does not divide the input size 32"),
    ],
)
def test_quantization_block_disagreeing_with_the_files(mlx, tmp_path, block, problem):
    d = shutil.copytree(mlx[2], tmp_path / "ckpt")
    data = json.loads((d / "config.json").read_text())
    data.pop("quantization_config")
    if block is None:
        data.pop("quantization")
    else:
        data["quantization"] = block
    (d / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="model.safetensors") as e:
        load(d)
    assert problem in str(e.value), str(e.value)
