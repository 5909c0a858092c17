"""Build a small Qwen3.5-architecture checkpoint with random weights: the embedded default before
one was trained (``python -m training.run`` makes the shipped one; it reuses this tokenizer).

Writes, into the folder given, a real checkpoint in the HF
text-only layout: ``config.json``, ``generation_config.json``, ``model.safetensors`` (bf16), and the
tokenizer made by ``make_default_tokenizer.py`` (byte-level BPE trained on the Python standard
library, the real Qwen3.5 chat template). The weights are random (seeded), so the model writes
gibberish; it exercises the whole path (config, weights, tokenizer, template, sampling).

Usage: ``python scripts/make_default_model.py OUT_DIR``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_default_tokenizer import build_tokenizer

from headstart.models.qwen35.config import load_config
from headstart.models.qwen35.weights import expected_shapes

LEARNED_VOCAB = 4096
SEED = 20261129


def text_config(vocab_size: int, eos: list[int]) -> dict:
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
        "attention_bias": False,
        "eos_token_id": eos[0],
        "dtype": "bfloat16",
    }


def random_weights(shapes: dict[str, tuple[int, ...]], gen: torch.Generator) -> dict:
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("conv1d.weight"):
            t = torch.randn(shape[0], 1, shape[1], generator=gen) * 0.3
        elif name.endswith("A_log"):
            t = torch.rand(shape, generator=gen) * 2.0 - 1.0
        elif name.endswith("dt_bias"):
            t = torch.randn(shape, generator=gen) * 0.5
        elif len(shape) == 1:  # norms: zero-centred ones near 0, the GDN gate norm near 1
            base = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
            t = base + torch.randn(shape, generator=gen) * 0.05
        else:
            t = torch.randn(shape, generator=gen) * (1.0 / shape[1] ** 0.5)
        dtype = torch.float32 if name.endswith("A_log") else torch.bfloat16
        tensors["model." + name if name != "lm_head.weight" else name] = t.to(dtype).contiguous()
    return tensors


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, vocab_size=LEARNED_VOCAB)
    added = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in added}
    eos = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    vocab = -(-(max(ids.values()) + 1) // 64) * 64  # padded like Qwen's embedding table
    (out / "config.json").write_text(json.dumps(text_config(vocab, eos), indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": eos,
                "pad_token_id": ids["<|endoftext|>"],
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": 20,
            },
            indent=2,
        )
        + "\n"
    )
    cfg = load_config(out)
    gen = torch.Generator().manual_seed(SEED)
    save_file(
        random_weights(expected_shapes(cfg), gen),
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
