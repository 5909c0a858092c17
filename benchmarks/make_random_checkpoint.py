"""Write a random-weight checkpoint at a real Qwen3.5 shape (HF text-only layout, bf16), with the
embedded default model's tokenizer and chat template, for serving benchmarks on a machine that
has no real weights.

    python benchmarks/make_random_checkpoint.py --shape 2b --out /tmp/qwen35-2b-random

``--config-only`` writes the folder without weights, for ``headstart serve --load-format dummy``
(random weights made on the device at load: no 15-54 GB file to write and read); ``--format
4bit`` declares MLX affine 4-bit (groups of 64) in its config.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import SHAPES

from headstart.loading import default_model_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="2b", choices=list(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--format", default="bf16", choices=["bf16", "4bit"])
    ap.add_argument("--config-only", action="store_true", help="no weights (--load-format dummy)")
    args = ap.parse_args()
    if args.format == "4bit" and not args.config_only:
        ap.error("--format 4bit is written as a config for --load-format dummy: add --config-only")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    s = SHAPES[args.shape]
    L = s["num_hidden_layers"]
    cfg = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)
        ],
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "dtype": "bfloat16",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
        },
        **s,
    }
    if args.format == "4bit":
        cfg["quantization"] = {"group_size": 64, "bits": 4}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    ):
        shutil.copy(default_model_dir() / f, out / f)
    if args.config_only:
        print(f"wrote {out} (config only: serve it with --load-format dummy)")
        return
    from headstart.models.qwen35.config import load_config
    from headstart.models.qwen35.weights import expected_shapes

    shapes = expected_shapes(load_config(out))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("conv1d.weight"):
            shape = (shape[0], 1, shape[1])
        if len(shape) == 1:
            t = (
                torch.zeros(shape, device=dev)
                if "norm" in name and "linear_attn" not in name
                else torch.rand(shape, device=dev, generator=gen) - 0.5
            )
            t = t.float()
        else:
            t = (torch.randn(shape, device=dev, generator=gen) / shape[-1] ** 0.5).bfloat16()
        tensors[name if name == "lm_head.weight" else "model." + name] = t.cpu()
    save_file(tensors, str(out / "model.safetensors"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
