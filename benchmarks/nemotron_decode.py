"""Nemotron-H's decode step on the GPU at a real shape (random weights), beside its floor.

    python benchmarks/nemotron_decode.py [--shape nano9b|h4b] [--streams 1 8 16] [--context 4096]

Writes the shape's config.json to a temporary folder, loads it with random weights made on the
GPU (``load(dummy=True)``, bf16), prefills each stream with a short prompt, then times the
decode step for each batch size: replayed from the runner's CUDA graphs (``DecodeGraphs``, as
the engine runs it) and eager. The floor is the bytes a step must read over the copy bandwidth
measured here: every weight once, each stream's SSM state and conv tail read and written, and
its KV rows read. Prints one table last.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.engine.cuda_graph import DecodeGraphs
from headstart.models.nemotron_h.model import NemotronHModel

# Published config.json values (nvidia/NVIDIA-Nemotron-Nano-9B-v2, nvidia/Nemotron-H-4B).
SHAPES = {
    "nano9b": dict(
        vocab_size=131072,
        hidden_size=4480,
        intermediate_size=15680,
        num_hidden_layers=56,
        hybrid_override_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        mamba_num_heads=128,
        mamba_head_dim=80,
        n_groups=8,
        ssm_state_size=128,
    ),
    "h4b": dict(
        vocab_size=131072,
        hidden_size=3136,
        intermediate_size=12544,
        num_hidden_layers=42,
        hybrid_override_pattern="M-M-M-MM-M-M*-M-M*-M-M-M*-M-M-MM*-MMM-M-M-",
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        mamba_num_heads=96,
        mamba_head_dim=80,
        n_groups=8,
        ssm_state_size=128,
    ),
}


def write_config(shape: str, folder: Path) -> Path:
    cfg = dict(
        architectures=["NemotronHForCausalLM"],
        model_type="nemotron_h",
        conv_kernel=4,
        chunk_size=128,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
        eos_token_id=2,
        max_position_embeddings=131072,
        **SHAPES[shape],
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, bytes/s (read + write counted once each)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - t0)


def timed(fn, reps: int = 30) -> float:
    """Median seconds of ``fn`` (GPU work included)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def floor_bytes(model: NemotronHModel, streams: int, length: int) -> int:
    weights = sum(
        math.prod(t.shape) * t.element_size() for n, t in model.w.items() if "embeddings" not in n
    )
    if "lm_head.weight" not in model.w:
        weights += math.prod(model.head.shape) * model.head.element_size()
    pool = model.new_state_pool(1, length + 1)
    fixed = sum(
        t[:, 0].numel() * t.element_size() for t in (pool.conv, pool.ssm)
    )  # one stream's conv tails and SSM states, all layers
    kv = sum(t[:, 0, :, :length].numel() * t.element_size() for t in (pool.keys, pool.values))
    return weights + streams * (2 * fixed + kv)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="nano9b", choices=sorted(SHAPES))
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512, help="tokens each stream has before")
    args = ap.parse_args()
    folder = write_config(args.shape, Path(tempfile.mkdtemp()))
    t0 = time.perf_counter()
    model = NemotronHModel.load(folder, torch.bfloat16, "cuda", "auto", dummy=True)
    took = time.perf_counter() - t0
    print(f"loaded {args.shape} ({model.num_parameters() / 1e9:.2f}B) in {took:.1f}s")
    slots = max(args.streams)
    pool = model.new_state_pool(slots + 1, args.context)
    ids = torch.randint(5, 1000, (args.prompt,)).tolist()
    for s in range(slots):
        model.forward(ForwardBatch.build([SeqChunk(s, 0, ids)], model.device), pool)
    t0 = time.perf_counter()
    graphs = DecodeGraphs(model, pool, slots, slots)
    print(f"decode graphs captured in {time.perf_counter() - t0:.1f}s")
    bw = copy_bandwidth()
    rows = []
    for n in args.streams:
        tokens, positions = [7] * n, [args.prompt] * n
        replay = timed(lambda n=n: graphs.run(tokens, positions, list(range(n))))
        chunks = [SeqChunk(s, args.prompt, (7,)) for s in range(n)]
        eager = timed(lambda c=chunks: model.forward(ForwardBatch.build(c, model.device), pool))
        floor = floor_bytes(model, n, args.prompt) / bw
        rows.append((n, replay, eager, floor))
    print(f"\n{args.shape}, bf16, copy bandwidth {bw / 1e12:.2f} TB/s, {args.prompt} tokens each")
    print("streams  graph ms  eager ms  floor ms  graph/floor")
    for n, replay, eager, floor in rows:
        ms = "  ".join(f"{1e3 * t:8.2f}" for t in (replay, eager, floor))
        print(f"{n:7d}  {ms}  {replay / floor:11.2f}")


if __name__ == "__main__":
    main()
