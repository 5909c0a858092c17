"""Config reading: both placements, rope/layer_types variants, quantization, and a fuzz test."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headstart.errors import ConfigError
from headstart.models.qwen35.config import ModelConfig, load_config

TEXT = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "eos_token_id": 248044,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "dtype": "bfloat16",
}


def write(tmp: Path, data, gen=None) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(data) if not isinstance(data, str) else data)
    if gen is not None:
        (tmp / "generation_config.json").write_text(json.dumps(gen))
    return tmp


def test_27b_text_config_sizes(tmp_path):
    cfg = load_config(write(tmp_path, TEXT))
    assert (cfg.conv_dim, cfg.key_dim, cfg.value_dim, cfg.rotary_dim) == (10240, 2048, 6144, 64)
    assert cfg.attention_layers[:3] == (3, 7, 11) and len(cfg.attention_layers) == 16
    assert cfg.rope_theta == 1e7 and cfg.eos_token_ids == (248044,)


def test_wrapper_placement_and_generation_config(tmp_path):
    wrapper = {
        "model_type": "qwen3_5",
        "text_config": dict(TEXT, tie_word_embeddings=True),
        "vision_config": {"depth": 27},
        "tie_word_embeddings": True,
    }
    cfg = load_config(
        write(
            tmp_path,
            wrapper,
            gen={"eos_token_id": [248046, 248044], "temperature": 0.6, "top_k": 20},
        )
    )
    assert cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (248046, 248044)
    assert dict(cfg.generation_defaults) == {"temperature": 0.6, "top_k": 20.0}
    assert cfg == load_config(
        write(
            tmp_path / "b",
            {**TEXT, "tie_word_embeddings": True},
            gen={"eos_token_id": [248046, 248044], "temperature": 0.6, "top_k": 20},
        )
    )


def test_top_level_rope_keys_and_layer_types_list(tmp_path):
    data = {k: v for k, v in TEXT.items() if k != "rope_parameters"}
    data.update(
        rope_theta=5e6,
        partial_rotary_factor=0.5,
        num_hidden_layers=3,
        layer_types=["full_attention", "linear_attention", "full_attention"],
    )
    cfg = load_config(write(tmp_path, data))
    assert (cfg.rope_theta, cfg.rotary_dim) == (5e6, 128)
    assert cfg.attention_layers == (0, 2) and cfg.linear_layers == (1,)


def test_mlx_quantization_block_with_overrides(tmp_path):
    data = dict(
        TEXT,
        quantization={
            "group_size": 64,
            "bits": 4,
            "mode": "affine",
            "language_model.model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
            "language_model.lm_head": False,
        },
    )
    cfg = load_config(write(tmp_path, data))
    q = cfg.quantization
    assert q is not None and (q.default.bits, q.default.group_size) == (4, 64)
    assert q.spec_for("layers.0.mlp.down_proj").bits == 8
    assert q.spec_for("layers.10.mlp.down_proj").bits == 4
    assert q.spec_for("lm_head") is None


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda d: d.pop("hidden_size"), "hidden_size"),
        (lambda d: d.update(num_key_value_heads=5), "num_key_value_heads"),
        (lambda d: d.update(linear_num_value_heads=40), "linear_num_value_heads"),
        (lambda d: d.update(head_dim=0), "head_dim"),
        (lambda d: d.update(vocab_size="big"), "vocab_size"),
        (lambda d: d.update(layer_types=["full_attention"]), "layer_types"),
        (lambda d: d.update(layer_types=["mamba"] * 64), "layer_types"),
        (lambda d: d["rope_parameters"].update(rope_type="yarn"), "rope_parameters.rope_type"),
        (
            lambda d: d["rope_parameters"].update(partial_rotary_factor=1.5),
            "rope_parameters.partial_rotary_factor",
        ),
        (lambda d: d.update(quantization={"bits": 3, "group_size": 64}), "quantization.bits"),
        (lambda d: d.update(quantization={"bits": 4, "group_size": 48}), "quantization.group_size"),
        (lambda d: d.update(eos_token_id=[1, "x"]), "eos_token_id"),
        (lambda d: d.update(tie_word_embeddings="yes"), "tie_word_embeddings"),
    ],
)
def test_invalid_fields_are_named(tmp_path, mutate, field):
    data = copy.deepcopy(TEXT)
    mutate(data)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, data))
    assert e.value.field == field
    assert "config.json" in str(e.value) and field in str(e.value)


def test_missing_and_unparseable_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(write(tmp_path, '{"hidden_size": 5'))
    with pytest.raises(ConfigError, match="generation_config.json"):
        write(tmp_path, TEXT)
        (tmp_path / "generation_config.json").write_text("[1, 2]")
        load_config(tmp_path)


# -- fuzz: mutated configs raise ConfigError or load; nothing else escapes ---------------------

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**12),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.lists(st.integers(-2, 3), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from(["linear_attention", "full_attention", "default", "yarn", "affine"]),
)
keys = st.sampled_from(
    sorted(TEXT)
    + [
        "layer_types",
        "quantization",
        "text_config",
        "full_attention_interval",
        "rope_theta",
        "partial_rotary_factor",
        "rope_scaling",
    ]
)
mutation = st.tuples(st.sampled_from(["set", "delete", "set_rope", "wrap"]), keys, junk)


def apply(data: dict, op: tuple) -> dict:
    kind, key, value = op
    if kind == "set":
        data[key] = value
    elif kind == "delete":
        data.pop(key, None)
    elif kind == "set_rope" and isinstance(data.get("rope_parameters"), dict):
        data["rope_parameters"][
            key if key in ("rope_theta", "rope_type") else "partial_rotary_factor"
        ] = value
    elif kind == "wrap":
        data = {"text_config": data, key: value}
    return data


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(mutation, min_size=1, max_size=4))
def test_fuzzed_configs_raise_only_config_error(tmp_path, ops):
    data = copy.deepcopy(TEXT)
    for op in ops:
        data = apply(data, op)
    try:
        cfg = load_config(write(tmp_path, data))
    except ConfigError as e:
        assert e.field and "config.json" in e.file
        return
    assert isinstance(cfg, ModelConfig)
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.linear_num_value_heads % cfg.linear_num_key_heads == 0
    assert len(cfg.layer_types) == cfg.num_hidden_layers and cfg.rotary_dim % 2 == 0


def test_default_step_budget_is_sized_to_model_and_device():
    """About 0.2 s of prefill compute per step at the device's peak, a power of two in
    512..8192; the CPU and unknown sizes keep 512."""
    from headstart.engine.config import default_step_tokens

    h200 = (9, 0, 132)
    assert default_step_tokens(26_900_000_000, "cuda", h200) == 2048  # 27B
    assert default_step_tokens(1_900_000_000, "cuda", h200) == 8192  # 2B: capped
    assert default_step_tokens(16_000_000_000, "cuda", h200) == 4096
    assert default_step_tokens(26_900_000_000, "cuda", (8, 0, 108)) == 1024  # A100: half
    assert default_step_tokens(26_900_000_000, "cuda", (8, 9, 128)) == 512  # a 4090-class part
    assert default_step_tokens(26_900_000_000, "cpu", (0, 0, 0)) == 512
    assert default_step_tokens(None, "cuda", h200) == 512
    for n in (10**8, 10**9, 10**10, 10**11, 10**12):
        b = default_step_tokens(n, "cuda", h200)
        assert 512 <= b <= 8192 and b & (b - 1) == 0
