"""``--load-format dummy``: random weights at a checkpoint's shapes from its config.json alone."""

from __future__ import annotations

import json
import shutil

import pytest
import tiny
import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.errors import HeadstartError
from headstart.loading import default_model_dir, load
from headstart.ops.linear import linear


def config_folder(tmp_path, quantization=None):
    cfg = tiny.text_config(vocab_size=4105).to_dict()
    cfg["architectures"] = ["Qwen3_5ForCausalLM"]
    if quantization:
        cfg["quantization"] = quantization
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir() / f, tmp_path / f)
    return tmp_path


@pytest.mark.parametrize("quantization", [None, {"bits": 4, "group_size": 64}])
def test_dummy_weights_have_the_configs_shapes_and_formats(tmp_path, quantization):
    """No weight file in the folder: the model is built at the config's shapes (4-bit where it
    declares so), and a forward stays finite."""
    from headstart.quant import QuantizedTensor

    loaded = load(
        str(config_folder(tmp_path, quantization)), "cpu", "float32", "reference", "dummy"
    )
    model = loaded.model
    from headstart.models.qwen35.dummy import random_weights

    made = random_weights(model.cfg, "cpu", torch.float32)
    w = made["layers.0.mlp.gate_proj.weight"]  # K = 64: quantizable
    assert isinstance(w, QuantizedTensor) == (quantization is not None)
    assert tuple(w.shape) == (96, 64)
    assert linear(torch.randn(3, 64), w).isfinite().all()
    pool = model.new_state_pool(1, 32)
    logits = model.forward(ForwardBatch.build([SeqChunk(0, 0, tuple(range(5, 25)))]), pool)
    assert logits.shape == (1, 4105) and logits.isfinite().all()


def test_a_family_without_dummy_weights_says_so(tmp_path):
    import toy_family

    path = toy_family.write_checkpoint(tmp_path / "toy", default_model_dir(), 4105)
    with pytest.raises(HeadstartError, match="cannot make random weights"):
        load(str(path), "cpu", "float32", "reference", "dummy")
