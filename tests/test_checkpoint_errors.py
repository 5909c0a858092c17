"""Damaged checkpoints fail with a CheckpointError that names the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import tiny
import torch
from safetensors.torch import load_file, save_file

from headstart.errors import CheckpointError
from headstart.models.qwen35.model import Qwen35Model


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return tiny.save_text_only(tiny.causal_lm(seed=1), tmp_path_factory.mktemp("err") / "good")


def copy(good, tmp_path):
    return shutil.copytree(good, tmp_path / "ckpt")


@pytest.mark.parametrize("keep", [0.0, 0.001, 0.5, 0.99])
def test_truncated_safetensors(good, tmp_path, keep):
    d = copy(good, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        Qwen35Model.load(d)


def test_no_weight_files(good, tmp_path):
    d = copy(good, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Qwen35Model.load(d)


def test_missing_tensor_is_named(good, tmp_path):
    d = copy(good, tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.2.linear_attn.A_log"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.2.linear_attn.A_log"):
        Qwen35Model.load(d)


def test_wrong_shape_is_named(good, tmp_path):
    d = copy(good, tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="layers.3.self_attn.k_proj.weight.*shape"):
        Qwen35Model.load(d)


def test_config_disagreeing_with_weights(good, tmp_path):
    d = copy(good, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mlp.*shape"):
        Qwen35Model.load(d)


def test_sharded_checkpoint_with_index(good, tmp_path):
    """Two shards plus an index load the same as one file; an index naming a lost shard fails."""
    d = copy(good, tmp_path)
    tensors = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, d / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = Qwen35Model.load(d)
    single = Qwen35Model.load(good)
    for k, v in single.w.items():
        assert torch.equal(v, sharded.w[k])
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002"):
        Qwen35Model.load(d)
