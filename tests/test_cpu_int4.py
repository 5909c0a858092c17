"""torch's int4 CPU kernel for 4-bit weights of bf16 models on the CPU (ops/quant_matmul/cpu.py)
against the reference dequantize-and-multiply, on fresh random weights; and a bf16 model whose
packed 4-bit weights run through it against the same model unpacking them per call."""

from __future__ import annotations

import pytest
import tiny
import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.models.qwen35.model import Qwen35Model
from headstart.ops.quant_matmul import cpu
from headstart.ops.quant_matmul.reference import quant_matmul
from headstart.quant import QuantizedTensor, quantize


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize(
    "n,k,group", [(64, 128, 32), (48, 256, 64), (32, 512, 128), (16, 256, 256)]
)
@pytest.mark.parametrize("lead", [(1,), (7,), (2, 3)])
def test_int4_matmul_matches_the_reference(n, k, group, lead):
    g = torch.Generator().manual_seed(n + k + group + len(lead))
    w = quantize(torch.randn(n, k, generator=g) * 0.05, 4, group)
    x = torch.randn(*lead, k, generator=g).to(torch.bfloat16)
    got = cpu.int4_matmul(x, cpu.prepare(w))
    want = quant_matmul(x.float(), w)  # fp32 throughout
    assert got.shape == (*lead, n) and got.dtype == torch.bfloat16
    # bf16: the output's rounding and the zero point's (bias + 8 * scale).
    assert rel_err(got, want) <= 1e-2


def test_what_the_kernel_takes():
    assert cpu.fits(quantize(torch.randn(48, 128), 4, 64))
    assert not cpu.fits(quantize(torch.randn(40, 128), 4, 64))  # N not a multiple of 16
    assert not cpu.fits(quantize(torch.randn(48, 128), 8, 64))
    assert not cpu.fits(quantize(torch.randn(48, 64), 4, 16))
    w = quantize(torch.randn(48, 128), 4, 64)
    with pytest.raises(ValueError, match="bf16"):
        cpu.int4_matmul(torch.randn(1, 128), cpu.prepare(w))
    # Planned on meta stand-ins (the weight arena) as it is made for real.
    meta = cpu.prepare(
        QuantizedTensor(*(t.to("meta") for t in (w.packed, w.scales, w.biases)), 4, 64)
    )
    real = cpu.prepare(w)
    for a, b in ((meta.packed, real.packed), (meta.scale_zero, real.scale_zero)):
        assert a.is_meta and (a.shape, a.dtype) == (b.shape, b.dtype)


def _logits(model: Qwen35Model, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """The prompt's last logits, then each of ``tokens`` fed as a decode step."""
    pool = model.new_state_pool(1, 128)
    rows = [model.forward(ForwardBatch.build([SeqChunk(0, 0, ids)]), pool)[-1:]]
    for t, tok in enumerate(tokens):
        batch = ForwardBatch.build([SeqChunk(0, len(ids) + t, (tok,))])
        rows.append(model.forward(batch, pool))
    return torch.cat(rows).float()


@pytest.mark.parametrize("tied", [False, True])
def test_a_bf16_model_with_packed_weights_runs_them_through_the_kernel(tmp_path, tied):
    """Packed (too big to unpack, here by a zero budget) in bf16 on the CPU: the 4-bit
    projections and head run through the kernel; prefill and decode logits as close to the
    fp32 model's as those of the same model unpacked to bf16 (within a small margin)."""
    ref = tiny.causal_lm(seed=21, tie_word_embeddings=tied, hidden_size=128, vocab_size=256)
    deq, packed = tiny.dequantized_copy(ref, 4, 32)
    ckpt = tiny.save_mlx(deq, packed, tmp_path / "q4", 4, 32)
    fast = Qwen35Model.load(ckpt, torch.bfloat16, "cpu", unpack_bytes=0)
    assert any(isinstance(w, cpu.CpuInt4) for k, w in fast.w.items() if k.endswith("proj.weight"))
    assert isinstance(fast.head, cpu.CpuInt4)
    assert isinstance(fast.w["embed_tokens.weight"], QuantizedTensor)  # rows are looked up
    truth = Qwen35Model.load(ckpt, torch.float32, "cpu")
    bf16 = Qwen35Model.load(ckpt, torch.bfloat16, "cpu")  # small: unpacked at load
    ids = torch.randint(0, 256, (33,), generator=torch.Generator().manual_seed(3)).tolist()
    tokens = torch.randint(0, 256, (4,), generator=torch.Generator().manual_seed(4)).tolist()
    want = _logits(truth, ids, tokens)
    assert (
        rel_err(_logits(fast, ids, tokens), want)
        <= 2 * rel_err(_logits(bf16, ids, tokens), want) + 1e-2
    )


def test_the_cpu_default_dtype_is_bf16_only_for_big_4bit_checkpoints(tmp_path):
    """fp32 on the CPU (the embedded default, unquantized or small checkpoints), bf16 for a
    4-bit checkpoint too big to unpack (the 2B shape) and on a GPU."""
    import json

    from headstart.loading import default_dtype, resolve_model_dir

    def folder(name: str, **cfg) -> object:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    two_b = dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=6144, vocab_size=248320)
    q4 = {"quantization": {"bits": 4, "group_size": 64}}
    assert default_dtype(resolve_model_dir(None), "cpu") == "float32"
    assert default_dtype(folder("q4-2b", **two_b, **q4), "cpu") == "bfloat16"
    assert default_dtype(folder("q4-vl", text_config=two_b, **q4), "cpu") == "bfloat16"
    assert default_dtype(folder("bf16-2b", **two_b), "cpu") == "float32"
    assert default_dtype(folder("q8-2b", **two_b, quantization={"bits": 8}), "cpu") == "float32"
    assert default_dtype(folder("q4-2b-gpu", **two_b, **q4), "cuda") == "bfloat16"
    assert default_dtype(tmp_path / "missing", "cpu") == "float32"


def test_nemotron_h_packed_in_bf16_runs_the_kernel_too(tmp_path):
    """The same rule for the second family: packed 4-bit weights of a bf16 model on the CPU go
    to the kernel, its logits close to the fp32 model's."""
    from test_nemotron_h_model import mlx_checkpoint

    from headstart.models.nemotron_h.config import load_config
    from headstart.models.nemotron_h.model import NemotronHModel
    from headstart.models.nemotron_h.weights import load_weights

    _, out = mlx_checkpoint(tmp_path, "M*-M-", 4, 5, vocab_size=256, intermediate_size=128)
    cfg = load_config(out)
    fast = NemotronHModel(cfg, load_weights(out, cfg), torch.bfloat16, unpack_bytes=0)
    assert isinstance(fast.head, cpu.CpuInt4)
    assert any(isinstance(w, cpu.CpuInt4) for w in fast.w.values())
    assert fast.num_parameters() == NemotronHModel.load(out, torch.float32, "cpu").num_parameters()
    truth = NemotronHModel.load(out, torch.float32, "cpu")
    ids = torch.randint(2, 256, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    tokens = [7, 91, 200]
    assert rel_err(_logits(fast, ids, tokens), _logits(truth, ids, tokens)) <= 5e-2
