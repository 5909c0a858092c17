"""Which layers keep dense prefill copies of their 4-bit weights under a byte budget
(``models/qwen35/pipeline.py``, ``Qwen35Model.keep_dense_copies``): as many layers as fit,
from the first, and only their quantized weights; never the head. Shapes only: the embedded
default model's checkpoint read as meta stand-ins, and a stand-in for the GPU kernel set's
``prepare`` that reports the copy it was asked for (the GPU set itself needs Triton and FLA;
``tests/test_gpu_model.py`` checks the copies' bits on a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from headstart.loading import default_model_dir
from headstart.models.qwen35.config import load_config
from headstart.models.qwen35.pipeline import HEAD, consume, layer_bytes, layers_within
from headstart.models.qwen35.weights import load_weights, stand_ins
from headstart.quant import QuantizedTensor

BF = torch.bfloat16


def shapes():
    path = default_model_dir()
    cfg = load_config(path)
    return cfg, stand_ins(load_weights(path, cfg, BF, "cpu", lazy=True))


def quantized(t) -> bool:
    return isinstance(t, QuantizedTensor)


def test_as_many_layers_as_fit_from_the_first():
    cfg, weights = shapes()
    n = cfg.num_hidden_layers
    sizes = layer_bytes(weights, BF, n, quantized)
    assert n >= 3 and all(sizes)
    # bf16 copies: two bytes a weight of every quantized weight named layers.<i>.
    want = [0] * n
    for k, t in weights.items():
        if quantized(t) and k.startswith("layers."):
            want[int(k.split(".")[1])] += 2 * t.shape[0] * t.shape[1]
    assert sizes == want
    assert layer_bytes(weights, torch.float32, n, quantized) == [2 * b for b in want]
    assert layers_within(sizes, 0) == 0
    assert layers_within(sizes, sizes[0] - 1) == 0
    assert layers_within(sizes, sizes[0]) == 1
    assert layers_within(sizes, sizes[0] + sizes[1] - 1) == 1
    assert layers_within(sizes, sizes[0] + sizes[1]) == 2
    assert layers_within(sizes, sum(sizes)) == n
    assert layers_within(sizes, 1 << 62) == n
    # Layers whose copies exist already take no bytes; nothing to copy, nothing kept.
    assert layers_within([0, sizes[1], sizes[2]], sizes[1]) == 2
    assert layers_within([0] * n, 1 << 62) == 0


def test_the_pipeline_copies_only_the_kept_layers_quantized_weights():
    cfg, weights = shapes()
    kept = 2
    kernels = SimpleNamespace(
        fused_matmul=True,
        prepare=lambda t, dense=None: (
            ("copy" if dense is not None else "packed", t) if isinstance(t, QuantizedTensor) else t
        ),
    )
    w, head = consume(dict(weights), cfg, kernels, BF, False, 0, lambda k, t: t, kept)
    copied = {k for k, t in w.items() if isinstance(t, tuple) and t[0] == "copy"}
    packed = {k for k, t in w.items() if isinstance(t, tuple) and t[0] == "packed"}
    assert copied and packed
    assert all(int(k.split(".")[1]) < kept for k in copied)
    assert {int(k.split(".")[1]) for k in copied} == set(range(kept))
    # Every quantized weight of a kept layer has its copy; none of the others.
    assert not any(k.startswith(("layers.0.", "layers.1.")) for k in packed)
    assert not isinstance(head, tuple) or head[0] == "packed"
    assert not (isinstance(w.get(HEAD), tuple) and w[HEAD][0] == "copy")


def test_no_copies_without_the_gpu_kernels():
    """The CPU kernel sets multiply packed or already unpacked weights: nothing to add."""
    from headstart.models.qwen35.model import Qwen35Model

    model = Qwen35Model.load(default_model_dir())
    before = dict(model.w)
    assert model.keep_dense_copies(1 << 40) == 0
    assert all(model.w[k] is t for k, t in before.items())
