"""GPU measurements of the engine at the real Qwen3.5 shapes, with random weights.

One run reports, for each requested shape and weight format:
  * measured copy bandwidth and the decode floor (bytes one decode step must read / bandwidth);
  * decode step time at 1, 4 and 16 streams (CUDA-graph replay, and eager for reference);
  * prefill time for 512 and 4096 tokens;
  * engine TTFT (submit -> first token, in process) for 14- and 31-token prompts, at 1 and 16
    streams, for a prompt-cache miss and an exact hit;
  * verify-window cost at 2, 4, 8 and 16 rows relative to one decode step, and TTFT with a
    (random) DFlash drafter attached;
  * the same decode/TTFT figures for transformers (flash-linear-attention kernels) on the same
    shape in bf16.
Prints a table last; writes JSON to --out.

    python benchmarks/gpu_engine.py --shape 27b --format bf16 4bit --hf
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import threading
import time
import traceback
from pathlib import Path

import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.models.qwen35.config import FULL, ModelConfig
from headstart.models.qwen35.weights import LazyWeights, expected_shapes
from headstart.quant import QuantizedTensor

SHAPES = {
    "27b": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_value_heads=48,
        tie_word_embeddings=False,
    ),
    "2b": dict(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_value_heads=16,
        tie_word_embeddings=True,
    ),
}


def config(shape: str, quant: bool) -> ModelConfig:
    s = SHAPES[shape]
    L = s["num_hidden_layers"]
    from headstart.models.qwen35.config import Quantization, QuantSpec

    return ModelConfig(
        vocab_size=248320,
        head_dim=256,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else "linear_attention" for i in range(L)),
        rms_norm_eps=1e-6,
        rope_theta=1e7,
        partial_rotary_factor=0.25,
        max_position_embeddings=262144,
        eos_token_ids=(),
        dtype="bfloat16",
        quantization=Quantization(QuantSpec(4, 64)) if quant else None,
        **s,
    )


def random_weights(
    cfg: ModelConfig, quant: bool, gen: torch.Generator, device: str = "cuda"
) -> LazyWeights:
    """Random weights at ``cfg``'s shapes (``serve --load-format dummy``'s), made on the device
    as the model takes them."""
    from headstart.models.qwen35.dummy import RandomRecipe

    bits = 4 if quant else None
    return LazyWeights(
        {n: RandomRecipe(n, s, bits, gen) for n, s in expected_shapes(cfg).items()}, device
    )


def nbytes(t) -> int:
    if isinstance(t, QuantizedTensor) or (hasattr(t, "nbytes") and callable(t.nbytes)):
        return t.nbytes()
    return t.numel() * t.element_size()


def decode_floor_bytes(cfg: ModelConfig, w: dict, streams: int, context: int) -> int:
    """Bytes one decode step must move: every weight but the embedding table (one row is
    looked up), the head, each stream's GDN state read + written, its KV rows read."""
    weights = sum(nbytes(t) for k, t in w.items() if k != "embed_tokens.weight")
    if cfg.tie_word_embeddings:
        weights += nbytes(w["embed_tokens.weight"])
    state = len(cfg.linear_layers) * cfg.linear_num_value_heads * 128 * 128 * 4 * 2
    kv = len(cfg.attention_layers) * 2 * cfg.num_key_value_heads * 256 * 2 * context
    return weights + streams * (state + kv)


def cuda_time(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def copy_bandwidth() -> float:
    a = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = cuda_time(lambda: b.copy_(a), reps=10)
    del a, b
    return 2 * (4 << 30) / t  # read + write


class Timer:
    """Collects server-side TTFT: submit -> first Piece, per request."""

    def __init__(self):
        self.sent = time.perf_counter()
        self.first = None
        self.done = threading.Event()

    def __call__(self, ev):
        from headstart.engine.engine import Failed, Finish, Piece

        if isinstance(ev, Piece) and self.first is None:
            self.first = time.perf_counter()
        if isinstance(ev, (Finish, Failed)):
            self.done.set()


def engine_ttft(engine, prompts: list[list[int]], repeat: int = 3) -> float:
    from headstart.engine.engine import EngineRequest
    from headstart.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    out = []
    for _r in range(repeat):
        timers = []
        for i, ids in enumerate(prompts):
            t = Timer()
            engine.submit(EngineRequest(f"t{time.perf_counter_ns()}-{i}", ids, params, 2, t))
            timers.append(t)
        for t in timers:
            t.done.wait(120)
        out.append(statistics.median(t.first - t.sent for t in timers))
    return statistics.median(out)


def distinct_prompts(n: int, length: int, salt: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(salt)
    return [torch.randint(10, 4000, (length,), generator=g).tolist() for _ in range(n)]


def _tokenizer():
    # Any tokenizer works for timing: logits past its vocabulary are masked, like padding rows.
    from headstart.loading import default_model_dir
    from headstart.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_dir())


def run_headstart(shape: str, fmt: str, args, rows: list[dict]) -> None:
    from headstart.engine.config import CacheConfig, EngineConfig
    from headstart.engine.engine import Engine
    from headstart.models.qwen35.model import Qwen35Model

    quant = fmt == "4bit"
    cfg = config(shape, quant)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.perf_counter()
    model = Qwen35Model(cfg, random_weights(cfg, quant, gen), torch.bfloat16, "cuda")
    build_s = time.perf_counter() - t0
    w_bytes = decode_floor_bytes(cfg, model.w, 0, 0)
    row = {
        "shape": shape,
        "format": fmt,
        "build_s": build_s,
        "weight_gb": w_bytes / 1e9,
        "bandwidth_gbs": args.bandwidth / 1e9,
    }
    rows.append(row)
    from headstart.engine.cuda_graph import DecodeGraphs

    pool = model.new_state_pool(17, 4608)
    for s in range(16):
        model.forward(ForwardBatch.build([SeqChunk(s, 0, tuple(range(5, 105)))], "cuda"), pool)
    graphs = DecodeGraphs(model, pool, 16, 16)
    for n in (1, 4, 16):
        floor = decode_floor_bytes(cfg, model.w, n, 101) / args.bandwidth
        t_graph = cuda_time(lambda: graphs.run([7] * n, [100] * n, list(range(n))))
        batch = ForwardBatch.build([SeqChunk(s, 100, (7,)) for s in range(n)], "cuda")
        t_eager = cuda_time(lambda: model.forward(batch, pool), reps=5)
        row[f"decode{n}_ms"] = t_graph * 1e3
        row[f"decode{n}_eager_ms"] = t_eager * 1e3
        row[f"floor{n}_ms"] = floor * 1e3
        row[f"tok_s{n}"] = n / t_graph
    for n in (512, 4096):
        batch = ForwardBatch.build([SeqChunk(16, 0, tuple(range(3, 3 + n)))], "cuda")
        row[f"prefill{n}_ms"] = cuda_time(lambda: model.forward(batch, pool), reps=3) * 1e3
    # Verify windows (recorded, as speculative decoding runs them) vs one decode step: eager,
    # and replayed from window graphs (engine/cuda_graph.py WindowGraphs).
    from headstart.engine.cuda_graph import WindowGraphs

    windows = WindowGraphs(model, pool, 1, (2, 4, 8, 16), 16, mempool=graphs.mempool)
    for b in (2, 4, 8, 16):
        batch = ForwardBatch.build([SeqChunk(0, 101, (7,) * b, b, record=True)], "cuda")
        row[f"verify{b}_x"] = cuda_time(lambda: model.forward_ex(batch, pool), reps=5) / (
            row["decode1_ms"] / 1e3
        )
        row[f"verify{b}_graph_x"] = cuda_time(lambda: windows.run([[7] * b], [101], [0])) / (
            row["decode1_ms"] / 1e3
        )
    del windows
    del graphs, pool
    gc.collect()
    torch.cuda.empty_cache()
    # Engine TTFT: miss and exact hit, 1 and 16 streams.
    t0 = time.perf_counter()  # warm-up, decode graphs, prefill graphs (2..64 tokens)
    engine = Engine(
        model, _tokenizer(), (), EngineConfig(16, 4096, cache=CacheConfig(bytes=16 << 30))
    )
    row["engine_start_s"] = time.perf_counter() - t0
    engine.start()
    try:
        for length in (14, 31):
            for n in (1, 16):
                # One unmeasured miss of this shape first: kernels compile on first use.
                engine_ttft(engine, distinct_prompts(n, length, length * 1000 + n), repeat=1)
                row[f"ttft{length}_miss{n}_ms"] = (
                    engine_ttft(engine, distinct_prompts(n, length, length * 100 + n), repeat=1)
                    * 1e3
                )
                # Exact hits: the same prompts again (now cached).
                hit = distinct_prompts(n, length, 7 + length + n)
                engine_ttft(engine, hit, repeat=1)
                row[f"ttft{length}_hit{n}_ms"] = engine_ttft(engine, hit, repeat=3) * 1e3
    finally:
        engine.stop()
    if args.spec and shape in ("27b", "2b"):
        run_spec(model, cfg, row)
    del model, engine
    gc.collect()
    torch.cuda.empty_cache()


def run_spec(model, cfg: ModelConfig, row: dict) -> None:
    """TTFT with and without a random DFlash drafter (5 layers at the target's width)."""
    from headstart.engine.config import EngineConfig
    from headstart.engine.engine import Engine
    from headstart.engine.spec.drafter import DFlashDrafter, DrafterConfig, drafter_shapes

    L = cfg.num_hidden_layers
    dc = DrafterConfig(
        cfg.hidden_size,
        cfg.hidden_size * 3,
        5,
        32,
        8,
        128,
        1e-6,
        1e7,
        16,
        248077,
        tuple(round(1 + i * (L - 4) / 4) for i in range(5)),
        (False,) * 5,
        (0,) * 5,
    )
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = {
        k: (
            torch.ones(s, device="cuda")
            if len(s) == 1
            else (torch.randn(s, device="cuda", generator=gen) / s[1] ** 0.5).bfloat16()
        )
        for k, s in drafter_shapes(dc).items()
    }
    drafter = DFlashDrafter(dc, w, model)
    for with_drafter in (False, True):
        engine = Engine(
            model,
            _tokenizer(),
            (),
            EngineConfig(16, 4096),
            drafter=drafter if with_drafter else None,
        )
        engine.start()
        try:
            key = "ttft31_spec_ms" if with_drafter else "ttft31_nospec_ms"
            row[key] = engine_ttft(engine, distinct_prompts(1, 31, 99), repeat=5) * 1e3
        finally:
            engine.stop()


def run_hf(shape: str, args, rows: list[dict]) -> None:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    s = SHAPES[shape]
    hc = Qwen3_5TextConfig(
        vocab_size=248320,
        head_dim=256,
        linear_num_key_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        **s,
    )
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = Qwen3_5ForCausalLM(hc).eval()
        torch.set_default_dtype(torch.float32)
    row = {"shape": shape, "format": "hf-bf16"}
    rows.append(row)

    @torch.no_grad()
    def decode_time(n: int) -> float:
        ids = torch.randint(10, 4000, (n, 100), device="cuda")
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        tok = torch.full((n, 1), 7, device="cuda")

        def step():
            model(tok, past_key_values=cache, use_cache=True)
            # The cache grows each call, as in generation.

        return cuda_time(step, reps=10)

    @torch.no_grad()
    def ttft(length: int) -> float:
        ids = torch.randint(10, 4000, (1, length), device="cuda")

        def first():
            out = model(ids, use_cache=True)
            out.logits[:, -1].argmax(-1).item()

        return cuda_time(first, reps=5)

    for n in (1, 16):
        row[f"decode{n}_ms"] = decode_time(n) * 1e3
        row[f"tok_s{n}"] = n / (row[f"decode{n}_ms"] / 1e3)
    for length in (14, 31):
        row[f"ttft{length}_miss1_ms"] = ttft(length) * 1e3
    del model
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", nargs="+", default=["2b"], choices=list(SHAPES))
    ap.add_argument("--format", nargs="+", default=["bf16"], choices=["bf16", "4bit"])
    ap.add_argument("--hf", action="store_true")
    ap.add_argument("--spec", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.bandwidth = copy_bandwidth()
    rows: list[dict] = []
    for shape in args.shape:
        for fmt in args.format:
            try:
                run_headstart(shape, fmt, args, rows)
            except Exception:
                traceback.print_exc()
            print(json.dumps(rows[-1] if rows else {}), flush=True)
        if args.hf:
            try:
                run_hf(shape, args, rows)
            except Exception:
                traceback.print_exc()
            print(json.dumps(rows[-1] if rows else {}), flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": commit,
        "copy_bandwidth_gbs": args.bandwidth / 1e9,
    }
    if args.out:
        Path(args.out).write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(json.dumps(env))
    cols = [
        "shape",
        "format",
        "decode1_ms",
        "floor1_ms",
        "decode4_ms",
        "decode16_ms",
        "floor16_ms",
        "tok_s1",
        "tok_s16",
        "decode1_eager_ms",
        "prefill512_ms",
        "prefill4096_ms",
        "ttft14_miss1_ms",
        "ttft31_miss1_ms",
        "ttft31_hit1_ms",
        "ttft31_miss16_ms",
        "ttft31_hit16_ms",
        "verify2_x",
        "verify4_x",
        "verify8_x",
        "verify16_x",
        "verify2_graph_x",
        "verify4_graph_x",
        "verify8_graph_x",
        "verify16_graph_x",
        "ttft31_nospec_ms",
        "ttft31_spec_ms",
        "engine_start_s",
    ]
    for r in rows:
        print(
            " ".join(
                f"{c}={r[c]:.3f}" if isinstance(r.get(c), float) else f"{c}={r.get(c)}"
                for c in cols
                if c in r
            )
        )


if __name__ == "__main__":
    main()
