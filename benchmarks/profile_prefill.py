"""Where eager prefill time goes (GPU): wall time vs host enqueue time per batch shape, the top
host ops and GPU kernels of a burst, and the attention and 4-bit matmul alternatives at the
model's shapes.

    python benchmarks/profile_prefill.py --shape 27b --format 4bit

Prints one table per part; the last lines summarise. A shape whose host time is close to its
wall time is launch-bound (graphs or fewer launches help); one whose wall time is far above its
host time is GPU-bound (kernels help).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_engine import config, cuda_time, random_weights

from headstart.batch import ForwardBatch, SeqChunk
from headstart.models.qwen35.model import Qwen35Model

TOP = 14  # rows of each kernel / op table (--top)


def host_and_wall(fn, reps: int = 3) -> tuple[float, float]:
    """Median (host seconds until fn returns, wall seconds until the GPU is done)."""
    fn()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        wall.append(t2 - t0)
    return sorted(host)[reps // 2], sorted(wall)[reps // 2]


def shapes_table(model, pool, lines: list[str]) -> None:
    tok = tuple(range(5, 8197))
    cases = {
        "decode x1": [SeqChunk(0, 100, (7,))],
        "decode x16": [SeqChunk(s, 100, (7,)) for s in range(16)],
        "fresh 31 x1": [SeqChunk(0, 0, tok[:31])],
        "fresh 31 x16": [SeqChunk(s, 0, tok[s : s + 31]) for s in range(16)],
        "fresh 512": [SeqChunk(0, 0, tok[:512])],
        "fresh 2048": [SeqChunk(0, 0, tok[:2048])],
        "cont 2048 @6144": [SeqChunk(0, 6144, tok[:2048])],
        "fresh 4096": [SeqChunk(0, 0, tok[:4096])],
        "fresh 8192": [SeqChunk(0, 0, tok[:8192])],
        "2048 + 8 decode": [SeqChunk(0, 0, tok[:2048])]
        + [SeqChunk(s, 100, (7,)) for s in range(1, 9)],
    }
    for name, chunks in cases.items():
        batch = ForwardBatch.build(chunks, "cuda")
        try:
            h, w = host_and_wall(lambda b=batch: model.forward(b, pool))
        except Exception as e:
            lines.append(f"{name:18s} failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        rows = sum(len(c.tokens) for c in chunks)
        lines.append(
            f"{name:18s} rows {rows:5d}  wall {w * 1e3:8.1f} ms  host {h * 1e3:7.1f} ms  "
            f"{rows / w:9.0f} tok/s"
        )
        print(lines[-1], flush=True)


def graphs_table(model, pool, lines: list[str], budget: int) -> None:
    """Prompt graphs as the engine captures them (shared pool with the decode graphs): capture
    time, then replay wall time per shape beside the eager forward of the same prompts."""
    from headstart.engine.cuda_graph import DecodeGraphs, PromptGraphs

    scratch = pool.num_slots - 1
    t0 = time.perf_counter()
    decode = DecodeGraphs(model, pool, 16, scratch)
    t1 = time.perf_counter()
    prompts = PromptGraphs(model, pool, 16, 1024, budget, scratch, mempool=decode.mempool)
    t2 = time.perf_counter()
    lines.append(
        f"capture: decode {len(decode.graphs)} graphs {t1 - t0:.1f} s, "
        f"prompts {len(prompts.graphs)} graphs {t2 - t1:.1f} s"
    )
    tok = tuple(range(5, 2000))
    for n, length in ((1, 31), (4, 31), (16, 31), (16, 100), (1, 512), (1, 1000)):
        ps = [tok[j : j + length] for j in range(n)]
        slots = list(range(n))
        g = host_and_wall(lambda ps=ps, slots=slots: prompts.run(ps, slots))
        batch = ForwardBatch.build([SeqChunk(s, 0, p) for s, p in enumerate(ps)], "cuda")
        e = host_and_wall(lambda b=batch: model.forward(b, pool))
        lines.append(
            f"prompts {n:2d} x {length:4d}: graph {g[1] * 1e3:7.1f} ms (host {g[0] * 1e3:5.1f})"
            f"  eager {e[1] * 1e3:7.1f} ms (host {e[0] * 1e3:5.1f})"
        )
        print(lines[-1], flush=True)
    g = host_and_wall(lambda: decode.run([7] * 8, [100] * 8, list(range(8))))
    lines.append(f"decode graph x8: {g[1] * 1e3:.2f} ms")


def profile_burst(model, pool, lines: list[str]) -> None:
    from torch.profiler import ProfilerActivity, profile

    tok = tuple(range(5, 200))
    batch = ForwardBatch.build([SeqChunk(s, 0, tok[s : s + 31]) for s in range(16)], "cuda")
    model.forward(batch, pool)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.forward(batch, pool)
        torch.cuda.synchronize()
    avg = prof.key_averages()
    t = avg.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60)
    lines.append("burst 16x31: top host ops\n" + t)
    t = avg.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60)
    lines.append("burst 16x31: top GPU kernels\n" + t)


def profile_case(
    model, pool, lines: list[str], name: str, chunks: list[SeqChunk] | ForwardBatch
) -> None:
    """The GPU kernels of one eager forward over ``chunks`` (or a built batch), summed by
    kernel, largest first, beside the forward's wall time (what a graph replay of it would
    spend, less launch gaps)."""
    from torch.profiler import ProfilerActivity, profile

    batch = chunks if isinstance(chunks, ForwardBatch) else ForwardBatch.build(chunks, "cuda")
    _, wall = host_and_wall(lambda: model.forward(batch, pool))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.forward(batch, pool)
        torch.cuda.synchronize()
    kernels = sorted(
        ((e.key, e.self_device_time_total, e.count) for e in prof.key_averages()),
        key=lambda k: -k[1],
    )
    total = sum(t for _, t, _ in kernels)
    lines.append(
        f"{name}: eager wall {wall * 1e3:.2f} ms, GPU kernels {total / 1e3:.2f} ms in "
        f"{sum(c for _, _, c in kernels)} launches"
    )
    for key, t, count in kernels[:TOP]:
        lines.append(f"  {t / 1e3:8.3f} ms  {count:5d}x  {key[:90]}")


def profile_ops(
    model, pool, lines: list[str], name: str, chunks: list[SeqChunk] | ForwardBatch
) -> None:
    """The host ops of one eager forward over ``chunks`` (or a built batch) that launch GPU
    work, by count: which torch calls the many small kernels of a short prompt come from
    (shapes of the top ones)."""
    from torch.profiler import ProfilerActivity, profile

    batch = chunks if isinstance(chunks, ForwardBatch) else ForwardBatch.build(chunks, "cuda")
    model.forward(batch, pool)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as p:
        model.forward(batch, pool)
        torch.cuda.synchronize()
    ops = [
        e
        for e in p.key_averages(group_by_input_shape=True)
        if e.key.startswith("aten::") and e.device_time_total > 0
    ]
    ops.sort(key=lambda e: -e.count)
    lines.append(f"{name}: aten ops that ran GPU work, by calls (input shapes)")
    for e in ops[:TOP]:
        shapes = str(e.input_shapes)[:70]
        ms = e.device_time_total / 1e3
        lines.append(f"  {e.count:5d}x {ms:7.3f} ms  {e.key:28s} {shapes}")


def attention_probe(cfg, lines: list[str]) -> None:
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dev, dt = "cuda", torch.bfloat16
    lines.append(f"varlen_attn available: {_has_varlen()}")
    for T, start in ((2048, 6144), (512, 1536), (2048, 0)):
        n = start + T
        q = torch.randn(1, nh, T, hd, device=dev, dtype=dt)
        k = torch.randn(1, nkv, n, hd, device=dev, dtype=dt)
        v = torch.randn(1, nkv, n, hd, device=dev, dtype=dt)
        pos = torch.arange(start, n, device=dev)
        res = {}

        def masked():
            mask = torch.arange(n, device=dev)[None, :] <= pos[:, None]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

        res["mask"] = masked
        try:
            from torch.nn.attention.bias import causal_lower_right

            bias = causal_lower_right(T, n)
            res["lower_right gqa"] = lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, enable_gqa=True
            )
            rep = nh // nkv
            res["lower_right expand"] = lambda: F.scaled_dot_product_attention(
                q,
                k.repeat_interleave(rep, 1),
                v.repeat_interleave(rep, 1),
                attn_mask=bias,
            )
        except Exception as e:
            lines.append(f"causal_lower_right: {e}")
        if start == 0:
            res["is_causal gqa"] = lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            )
        ref = masked().float()
        for name, fn in res.items():
            try:
                err = (fn().float() - ref).abs().max().item()
                t = cuda_time(fn, reps=10)
                lines.append(f"attn T={T} @{start} {name:20s} {t * 1e3:7.2f} ms  err {err:.3g}")
            except Exception as e:
                lines.append(f"attn T={T} start={start} {name:20s} failed: {str(e)[:100]}")
            print(lines[-1], flush=True)


def _has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401

        return True
    except ImportError:
        return False


def matmul_probe(model, lines: list[str]) -> None:
    from headstart.ops.linear import linear
    from headstart.ops.quant_matmul.triton import PreparedQuant, dequantize_prepared

    w = model.w["layers.0.mlp.gate_up_proj.weight"]
    if not isinstance(w, PreparedQuant):
        return
    dense = dequantize_prepared(w, torch.bfloat16)
    t_dq = cuda_time(lambda: dequantize_prepared(w, torch.bfloat16), reps=10)
    lines.append(f"gate_up {tuple(dense.shape)} dequantize {t_dq * 1e3:.3f} ms")
    for M in (16, 64, 128, 256, 496, 2048, 8192):
        x = torch.randn(M, dense.shape[1], device="cuda", dtype=torch.bfloat16)
        t_q = cuda_time(lambda x=x: linear(x, w), reps=10)
        t_d = cuda_time(lambda x=x: x @ dense.T, reps=10)
        flops = 2 * M * dense.numel()
        lines.append(
            f"gate_up M={M:5d} linear {t_q * 1e3:7.3f} ms  bf16 cuBLAS {t_d * 1e3:7.3f} ms "
            f"({flops / t_d / 1e12:5.0f} TFLOP/s)"
        )
        print(lines[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="27b")
    ap.add_argument("--format", default="4bit", choices=["bf16", "4bit"])
    ap.add_argument("--context", type=int, default=8200)
    ap.add_argument("--budget", type=int, default=2048, help="prompt graphs' most padded rows")
    ap.add_argument(
        "--parts",
        default="attn,matmul,shapes,graphs,profile",
        help="also: prof31, prof31pad, ops31, ops31pad, profcont, profburst",
    )
    ap.add_argument(
        "--dense-gib",
        type=float,
        default=0.0,
        help="4-bit: give the first layers dense prefill copies in this many GiB (serve's top-up)",
    )
    ap.add_argument("--top", type=int, default=14, help="rows of each kernel / op table")
    args = ap.parse_args()
    global TOP
    TOP = args.top
    quant = args.format == "4bit"
    cfg = config(args.shape, quant)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.perf_counter()
    model = Qwen35Model(cfg, random_weights(cfg, quant, gen), torch.bfloat16, "cuda")
    pool = model.new_state_pool(17, args.context)
    lines = [f"{args.shape} {args.format}: built in {time.perf_counter() - t0:.1f} s"]
    if args.dense_gib > 0:
        kept = model.keep_dense_copies(int(args.dense_gib * 2**30))
        lines.append(f"dense prefill copies: the first {kept} layers")
    parts = args.parts.split(",")
    if "attn" in parts:
        attention_probe(cfg, lines)
    if "matmul" in parts:
        matmul_probe(model, lines)
    if "shapes" in parts:
        shapes_table(model, pool, lines)
    if "graphs" in parts:
        graphs_table(model, pool, lines, args.budget)
    if "profile" in parts:
        profile_burst(model, pool, lines)
    tok = tuple(range(5, 5 + 1024))
    if "prof31" in parts:  # one new short prompt alone, and a decode step, kernel by kernel
        profile_case(model, pool, lines, "fresh 31 x1", [SeqChunk(0, 0, tok[:31])])
        profile_case(model, pool, lines, "decode x1", [SeqChunk(0, 100, (7,))])
    if "prof31pad" in parts or "ops31pad" in parts:  # the prompt as serve runs it: padded
        ids = torch.tensor([*tok[:31], 0], device="cuda")
        one = torch.ones(1, dtype=torch.int64, device="cuda")
        batch = ForwardBatch.padded_of(ids, one * 0, one * 31, 32)
        if "prof31pad" in parts:
            profile_case(model, pool, lines, "padded 31 in 32 x1", batch)
        if "ops31pad" in parts:
            profile_ops(model, pool, lines, "padded 31 in 32 x1", batch)
    if "ops31" in parts:  # the torch calls behind the short prompt's small kernels
        profile_ops(model, pool, lines, "fresh 31 x1", [SeqChunk(0, 0, tok[:31])])
    if "profburst" in parts:  # 16 new 31-token prompts, padded to 32 as serve's graphs run them
        ids = torch.tensor([t for j in range(16) for t in (*tok[j : j + 31], 0)], device="cuda")
        slots = torch.arange(16, device="cuda")
        batch = ForwardBatch.padded_of(ids, slots, torch.full_like(slots, 31), 32)
        profile_case(model, pool, lines, "burst 16x31 padded to 32", batch)
    if "profcont" in parts:  # an agent turn's chunk on a short and on a long history
        for start in (2063, args.context - 600):
            chunk = [SeqChunk(0, start, tok[:501])]
            profile_case(model, pool, lines, f"cont 501 @{start}", chunk)
        profile_case(model, pool, lines, "fresh 500", [SeqChunk(0, 0, tok[:500])])
    print("\n".join(lines))


if __name__ == "__main__":
    main()
