"""Microbenchmarks of the GPU kernels (H200-sized shapes of Qwen3.5-27B), against their floors.

Prints the measured device-to-device copy bandwidth (bytes read + bytes written over time, the
convention of the device notes), then:

* 4-bit quant_matmul for the 27B projections (and, with ``--lm-head``, the 248320x5120 lm_head)
  at M = 1, 4, 16, 31: our kernel (at M = 31 also with ``QmmConfig(mma_rows=32)``, one program
  column of 32 rows instead of two of 16: "rows32"), torch's dequantize + matmul, torch's int4
  tinygemm (``_weight_int4pack_mm``, if this torch has it), bf16 cuBLAS on the unquantized
  weight, and the floor = (packed words + scales + biases) / copy bandwidth. ``--quick`` skips the
  three torch baselines; ``--before FILE`` also times the ``quant_matmul`` of another copy of the
  module (e.g. the previous version) in the same process; an optional config sweep (``--sweep``)
  runs alongside. A variant whose relative error against the fp32 reference exceeds 1e-2 is flagged
  WRONG on its line (the lm_head, too large for an fp32 copy, is compared to our own output).
* decode_attention at n = 16 streams, lengths 512 and 8192 (floor = K+V bytes / bandwidth), with
  the reference path (gather the slots' rows + attend_decode) for comparison.
* chunk_attention: one stream's continued chunk of 64..1024 rows at position 12000, beside
  the same rows as decode rows and SDPA over the slot's rows.
* gdn_decode for 48 layers of 27B state at n = 1 and 16 (floor = state read + write / bandwidth):
  one layer alone, and all 48 layers replayed from a CUDA graph.
* the GDN convolution of prefill rows (27B: 10240 channels, 4 taps, rows read from the wider
  projection output): ``ops/conv/triton.py`` against the PyTorch reference of each shape (new
  prompts padded to 32 rows, one span of 500..8192 rows, a padded continued chunk, 16 spans in
  one forward), floor = rows read + written / bandwidth.

Kernel times are per call, replayed back to back from a CUDA graph over several copies of the
weights/caches (so the 60 MB L2 cannot hold them), as a graph-captured decode step runs them: a
Triton launch from Python costs tens of microseconds of host time on the test VM, which would
otherwise swamp a 5-20 us kernel ("eager" columns show that cost). Medians of
``triton.testing.do_bench``, which also flushes the L2 before every replay. The last lines are a
short aligned table.

    PYTHONPATH=src python benchmarks/gpu_ops.py [--sweep] [--quick] [--lm-head] [--before FILE]
        [--skip attention,gdn,conv] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import contextlib

import triton
from triton.testing import do_bench

from headstart.ops.attention.reference import attend_decode
from headstart.ops.attention.triton import decode_attention
from headstart.ops.gated_delta.triton import gdn_decode
from headstart.ops.quant_matmul.triton import QmmConfig, prepare, quant_matmul
from headstart.quant import QuantizedTensor, dequantize

DEV = torch.device("cuda")
SHAPES_27B = {  # name: (N out, K in)
    "q_proj": (12288, 5120),
    "in_proj_qkv": (10240, 5120),
    "mlp_gate_up": (17408, 5120),
    "mlp_down": (5120, 17408),
    "o_proj": (5120, 6144),
}
LM_HEAD = {"lm_head": (248320, 5120)}
MS = (1, 4, 16, 31)
ROWS32_M = 31  # M at which QmmConfig(mma_rows=32) (32-row program columns) is timed beside ours
# ... with the next K step's x prefetched (181 registers) and without (108: two programs per SM)
ROWS32 = {
    "rows32": QmmConfig(mma_rows=32, x_chunk_ahead_wide=False),
    # the weight dequantized in the A registers (QmmConfig.dequant_a), every weight word unpacked
    # once for all 32 rows: 4 warps of two 16-row blocks (141 registers without x prefetch, 182
    # with x a chunk ahead) or 8 warps of one (80, 104)
    "r32deqnpx": QmmConfig(mma_rows=32, dequant_a=True, prefetch_x=False),
    "r32deqx2": QmmConfig(mma_rows=32, dequant_a=True, prefetch_x=False, x_chunk_ahead=True),
    "r32w8deqnpx": QmmConfig(mma_rows=32, dequant_a=True, prefetch_x=False, num_warps=8),
    "r32w8deqx2": QmmConfig(
        mma_rows=32, dequant_a=True, prefetch_x=False, x_chunk_ahead=True, num_warps=8
    ),
}
SWEEP = {  # name: (prepare() keyword arguments, launch config); "ours" is ({}, QmmConfig())
    "w8": ({}, QmmConfig(num_warps=8)),
    "bn256": ({"block_n": 256}, QmmConfig()),
    "bn64": ({"block_n": 64}, QmmConfig()),
    "c3": ({}, QmmConfig(ctas_per_sm=3)),
    "c12": ({}, QmmConfig(ctas_per_sm=12)),
    "nopf": ({}, QmmConfig(prefetch=False)),
    "stages3": ({}, QmmConfig(num_stages=3)),
    "nopx": ({}, QmmConfig(prefetch_x=False)),
    "nopxc4": ({}, QmmConfig(prefetch_x=False, ctas_per_sm=4)),
    "c4": ({}, QmmConfig(ctas_per_sm=4)),
    "c5": ({}, QmmConfig(ctas_per_sm=5)),
    "x2": ({}, QmmConfig(prefetch_x=False, x_chunk_ahead=True)),
    "deq": ({}, QmmConfig(dequant_a=True)),
    "deqnpx": ({}, QmmConfig(dequant_a=True, prefetch_x=False)),
    "deqx2": ({}, QmmConfig(dequant_a=True, prefetch_x=False, x_chunk_ahead=True)),
    "w8deqx2": (
        {},
        QmmConfig(num_warps=8, dequant_a=True, prefetch_x=False, x_chunk_ahead=True),
    ),
}


def bench(fn: Callable[[], object], rep: int = 60) -> float:
    """Median microseconds of ``fn`` launched eagerly."""
    return do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


def bench_graph(calls: list[Callable[[], object]], rep: int = 60) -> float:
    """Median microseconds per call of ``calls`` replayed back to back from one CUDA graph."""
    for c in calls:  # compile and warm up outside the capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return bench(graph.replay, rep) / len(calls)


def copies_for(nbytes: int) -> int:
    """Enough copies that one pass over them is four times the 60 MB L2."""
    return max(2, math.ceil(240e6 / nbytes))


def copy_bandwidth() -> float:
    n = 1 << 30  # 2 GiB of bf16 each way
    a = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    us = bench(lambda: b.copy_(a), rep=200)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / (us * 1e-6) / 1e9  # GB/s, read + write


def random_qt(n: int, k: int, group: int = 64) -> QuantizedTensor:
    """Random codes and bf16 scales/biases (values are irrelevant to speed; never zeros)."""
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device=DEV)
    scales = (torch.rand(n, k // group, device=DEV) * 0.01 + 1e-3).to(torch.bfloat16)
    biases = (torch.randn(n, k // group, device=DEV) * 0.05).to(torch.bfloat16)
    return QuantizedTensor(packed, scales, biases, 4, group)


def torch_int4_calls(
    n: int, k: int, group: int, x: torch.Tensor, copies: int
) -> list[Callable[[], object]] | None:
    """Calls of torch's int4 tinygemm on ``copies`` random weights, or None where unsupported."""
    if not hasattr(torch, "_weight_int4pack_mm"):
        return None
    err: Exception | None = None
    for tiles in (8, 4, 2):
        try:
            calls = []
            for _ in range(copies):
                q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=DEV)
                w_u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
                packed = torch._convert_weight_to_int4pack(w_u8, tiles)
                sz = torch.randn(k // group, n, 2, device=DEV).to(torch.bfloat16)
                calls.append(
                    lambda packed=packed, sz=sz: torch._weight_int4pack_mm(x, packed, group, sz)
                )
            calls[0]()
            return calls
        except (RuntimeError, TypeError) as e:  # API or shape not supported here
            err = e
    print(f"  torch int4 unavailable: {str(err).splitlines()[0][:100]}")
    return None


def geomean(v: list[float]) -> float:
    return math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")


def load_module(path: str):
    """A module from a file (``--before``: e.g. a copy of the previous quant_matmul.py)."""
    spec = importlib.util.spec_from_file_location("qmm_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def bench_matmul(
    bw: float, sweep_on: bool, quick: bool = False, lm_head: bool = False, before=None
) -> list[dict]:
    rows = []
    sweep = SWEEP if sweep_on else {}
    sweep_ratios: dict[tuple[str, int], list[float]] = {}
    shapes = dict(SHAPES_27B, **(LM_HEAD if lm_head else {}))
    for name, (n, k) in shapes.items():
        big = name in LM_HEAD  # only ours and before (memory, time)
        qt0 = random_qt(n, k)
        nbytes = qt0.nbytes()
        qts = [random_qt(n, k) for _ in range(copies_for(nbytes))]
        w_ref = qts[0].dequantize(torch.float32) if n * k <= 2**27 else None
        variants = {c: v for c, v in sweep.items() if not big}
        ours = [prepare(qt) for qt in qts]
        preps = {c: [prepare(qt, **kw) for qt in qts] for c, (kw, _) in variants.items() if kw}
        olds = [before.prepare(qt) for qt in qts] if before is not None else None
        del qts
        floor = nbytes / (bw * 1e9) * 1e6
        w16s = (
            [qt0.dequantize(torch.bfloat16) for _ in range(2)]  # 2 x >100 MB: beyond L2
            if not quick
            else []
        )
        for m in MS:
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            res = {"shape": name, "N": n, "K": k, "M": m, "bytes": nbytes, "floor_us": floor}
            y_ref = x.float() @ w_ref.T if w_ref is not None else quant_matmul(x, ours[0]).float()
            res["err"] = rel_err(quant_matmul(x, ours[0]), y_ref)
            bad = [f"ours {res['err']:.1e}"] if res["err"] > 1e-2 else []
            for cname, (_kw, cfg) in variants.items():
                ps = preps.get(cname, ours)
                seen = compiled_mma()
                err = rel_err(quant_matmul(x, ps[0], cfg), y_ref)  # same function, any config
                REGISTERS.setdefault(cname, set()).update(
                    (k.n_regs, k.n_spills) for key, k in compiled_mma().items() if key not in seen
                )
                if err > 1e-2:
                    bad.append(f"{cname} {err:.1e}")
                t = bench_graph([lambda p=p, cfg=cfg: quant_matmul(x, p, cfg) for p in ps])
                if m <= 16:  # the summary's buckets: M = 1 | M = 4, 16
                    sweep_ratios.setdefault((cname, 1 if m == 1 else 16), []).append(t / floor)
                res[f"cfg_{cname}"] = t
            seen = compiled_mma()
            quant_matmul(x, ours[0])
            REGISTERS.setdefault("ours", set()).update(
                (k.n_regs, k.n_spills) for key, k in compiled_mma().items() if key not in seen
            )
            res["ours_us"] = bench_graph([lambda p=p: quant_matmul(x, p) for p in ours])
            res["ours_eager_us"] = bench(lambda: quant_matmul(x, ours[0]))
            for label, cfg32 in ROWS32.items() if m == ROWS32_M else ():
                seen = compiled_mma()
                err = rel_err(quant_matmul(x, ours[0], cfg32), y_ref)
                REGISTERS.setdefault(label, set()).update(
                    (k.n_regs, k.n_spills) for key, k in compiled_mma().items() if key not in seen
                )
                if err > 1e-2:
                    bad.append(f"{label} {err:.1e}")
                res[f"{label}_us"] = bench_graph(
                    [lambda p=p, c=cfg32: quant_matmul(x, p, c) for p in ours]
                )
            if olds is not None:
                err = rel_err(before.quant_matmul(x, olds[0]), y_ref)
                if err > 1e-2:
                    bad.append(f"before {err:.1e}")
                res["before_us"] = bench_graph(
                    [lambda p=p: before.quant_matmul(x, p) for p in olds]
                )
            nan = float("nan")
            res["torch_deq_mm_us"] = res["torch_int4_us"] = res["bf16_cublas_us"] = nan
            if not quick:
                res["torch_deq_mm_us"] = bench(
                    lambda: (
                        x @ dequantize(qt0.packed, qt0.scales, qt0.biases, 4, 64, torch.bfloat16).T
                    ),
                    rep=20,
                )
                int4 = torch_int4_calls(n, k, 64, x, len(ours))
                res["torch_int4_us"] = bench_graph(int4) if int4 else nan
                del int4
                res["bf16_cublas_us"] = bench_graph([lambda w=w: x @ w.T for w in w16s])
            res["ratio"] = res["ours_us"] / floor
            rows.append(res)
            print(
                f"  {name:12s} M={m:2d} ours {res['ours_us']:6.1f} us (eager "
                f"{res['ours_eager_us']:5.1f})  floor {floor:5.1f}  ratio {res['ratio']:.2f}"
                + (f"  before {res['before_us']:6.1f}" if "before_us" in res else "")
                + "".join(f"  {c} {res[f'{c}_us']:6.1f}" for c in ROWS32 if f"{c}_us" in res)
                + f"  int4 {res['torch_int4_us']:6.1f}  deq+mm {res['torch_deq_mm_us']:6.1f}"
                f"  bf16 {res['bf16_cublas_us']:6.1f}"
                + "".join(f"  {c}={res[f'cfg_{c}']:.1f}" for c in sweep if f"cfg_{c}" in res)
                + (f"  WRONG: {', '.join(bad)}" if bad else ""),
                flush=True,
            )
        del preps, ours, olds, w16s, qt0, w_ref
        torch.cuda.empty_cache()
    for cname, regs in REGISTERS.items():
        print(f"  registers (spills) of {cname}: {sorted(regs)}")
    if sweep_ratios:
        print("config sweep: geometric-mean ratio to floor (M=1 | M=4,16)")
        for cname in sweep:
            print(
                f"  {cname:10s} {geomean(sweep_ratios.get((cname, 1), [])):5.2f} | "
                f"{geomean(sweep_ratios.get((cname, 16), [])):5.2f}"
            )
    return rows


def compiled_mma() -> dict:
    """Every compiled variant of the MMA kernel so far (cache key -> compiled kernel)."""
    from headstart.ops.quant_matmul import triton as qm

    return {
        key: k for caches in qm._mma_kernel.device_caches.values() for key, k in caches[0].items()
    }


REGISTERS: dict[str, set] = {}  # config name -> {(registers, spills)} of the kernels it compiled


def bench_attention(bw: float) -> list[dict]:
    rows = []
    n, nh, nkv, hd, max_tokens, groups = 16, 24, 4, 256, 8192, 8
    # 8 disjoint groups of 16 slots: consecutive calls read different K/V (no L2 reuse).
    keys = torch.randn(n * groups, nkv, max_tokens, hd, device=DEV).to(torch.bfloat16)
    values = torch.randn(n * groups, nkv, max_tokens, hd, device=DEV).to(torch.bfloat16)
    q = torch.randn(n, nh, hd, device=DEV).to(torch.bfloat16)
    slot_sets = [torch.arange(n, device=DEV) + i * n for i in range(groups)]
    for length in (512, 8192):
        lengths = torch.full((n,), length, device=DEV, dtype=torch.int32)
        nbytes = 2 * n * nkv * length * hd * 2
        floor = nbytes / (bw * 1e9) * 1e6
        ours = bench_graph(
            [lambda s=s: decode_attention(q, keys, values, s, lengths) for s in slot_sets]
        )
        eager = bench(lambda: decode_attention(q, keys, values, slot_sets[0], lengths))
        sl = slot_sets[0]
        ref = bench(
            lambda: attend_decode(q, keys[sl, :, :length], values[sl, :, :length], lengths), rep=30
        )
        rows.append(
            {
                "n": n,
                "length": length,
                "ours_us": ours,
                "ours_eager_us": eager,
                "floor_us": floor,
                "ratio": ours / floor,
                "torch_ref_us": ref,
            }
        )
        print(
            f"  attention n={n} len={length}: ours {ours:.1f} us (eager {eager:.1f}) floor "
            f"{floor:.1f} ratio {ours / floor:.2f}  torch gather+attend {ref:.1f} us",
            flush=True,
        )
    del keys, values
    torch.cuda.empty_cache()
    return rows


# chunk_attention configs (query block, key block, warps, stages) that --sweep times.
CHUNK_SWEEP = [
    (64, 32, 8, 2),
    (64, 64, 8, 2),
    (64, 64, 4, 2),
    (64, 32, 4, 3),
    (128, 32, 8, 2),
    (128, 64, 8, 2),
    (64, 128, 8, 2),
    (64, 64, 8, 3),
    (128, 32, 8, 3),
]


def bench_chunk(bw: float, sweep: bool = False) -> list[dict]:
    """One stream's continued chunk of W rows at position 12000 (27B heads): chunk_attention,
    the same rows as decode rows (what continuation graphs ran before it), and SDPA over the
    slot's rows (the eager path's ``attn_span``). Floor: the larger of K+V bytes over the copy
    bandwidth and the causal FLOPs over 790 TFLOP/s."""
    from headstart.ops.attention.sdpa import attn_span
    from headstart.ops.attention.triton import chunk_attention

    rows, nh, nkv, hd, start, copies = [], 24, 4, 256, 12000, 4
    max_tokens = start + 1024
    keys = torch.randn(copies, nkv, max_tokens, hd, device=DEV).to(torch.bfloat16)
    values = torch.randn(copies, nkv, max_tokens, hd, device=DEV).to(torch.bfloat16)
    at = torch.tensor([start], device=DEV)
    slots = [torch.tensor([c], device=DEV) for c in range(copies)]
    for width in (64, 512, 1024):
        q = torch.randn(width, nh, hd, device=DEV).to(torch.bfloat16)
        end = start + width
        flops = 4 * width * (start + width / 2) * nh * hd
        floor = max(2 * nkv * end * hd * 2 / (bw * 1e9), flops / 790e12) * 1e6
        ours = bench_graph([lambda s=s: chunk_attention(q, keys, values, s, at) for s in slots])
        lengths = torch.arange(start + 1, end + 1, device=DEV, dtype=torch.int32)
        repeated = [s.repeat(width) for s in slots]
        as_rows = bench_graph(
            [lambda s=s: decode_attention(q, keys, values, s, lengths) for s in repeated]
        )
        sdpa = bench(lambda: attn_span(q, keys[0, :, :end], values[0, :, :end], start))
        for config in CHUNK_SWEEP if sweep and width >= 512 else ():
            for splits in (None, 1):
                try:
                    t = bench_graph(
                        [
                            lambda s=s: chunk_attention(
                                q, keys, values, s, at, num_splits=splits, config=config
                            )
                            for s in slots
                        ]
                    )
                except Exception as e:  # out of resources: report it, go on
                    print(f"  chunk W={width} {config} splits {splits}: {type(e).__name__}")
                    continue
                print(f"  chunk W={width} {config} splits {splits}: {t:.1f} us", flush=True)
        rows.append(
            {
                "width": width,
                "start": start,
                "ours_us": ours,
                "decode_rows_us": as_rows,
                "sdpa_us": sdpa,
                "floor_us": floor,
            }
        )
        print(
            f"  chunk W={width} at {start}: ours {ours:.1f} us, as decode rows {as_rows:.1f}, "
            f"sdpa {sdpa:.1f}, floor {floor:.1f}",
            flush=True,
        )
    del keys, values
    torch.cuda.empty_cache()
    return rows


def bench_gdn(bw: float) -> list[dict]:
    rows = []
    layers, Hk, Hv, D = 48, 16, 48, 128
    for n in (1, 16):
        pool = torch.randn(layers, n, Hv, D, D, device=DEV) * 0.1  # one state pool per layer
        q = torch.randn(n, Hk, D, device=DEV).to(torch.bfloat16)
        k = torch.randn(n, Hk, D, device=DEV).to(torch.bfloat16)
        v = torch.randn(n, Hv, D, device=DEV).to(torch.bfloat16)
        g = -torch.rand(n, Hv, device=DEV)
        beta = torch.rand(n, Hv, device=DEV).to(torch.bfloat16)
        slots = torch.arange(n, device=DEV)
        fresh = torch.zeros(n, dtype=torch.bool, device=DEV)
        floor1 = 2 * n * Hv * D * D * 4 / (bw * 1e9) * 1e6  # state read + write, one layer
        calls = [
            lambda i=i: gdn_decode(q, k, v, g, beta, slots, fresh, pool[i]) for i in range(layers)
        ]
        total = bench_graph(calls) * layers

        def all_layers() -> None:
            for c in calls:
                c()

        eager = bench(all_layers)
        rows.append(
            {
                "n": n,
                "layer_us": total / layers,
                "floor_layer_us": floor1,
                "graph48_us": total,
                "eager48_us": eager,
                "floor48_us": floor1 * layers,
                "ratio": total / (floor1 * layers),
            }
        )
        print(
            f"  gdn decode n={n}: 48 layers graph {total:.1f} us, eager {eager:.1f} us "
            f"(floor {floor1 * layers:.1f})",
            flush=True,
        )
        del pool
        torch.cuda.empty_cache()
    return rows


def bench_conv(bw: float) -> list[dict]:
    from headstart.ops.conv import reference as ref
    from headstart.ops.conv import triton as gpu_conv

    rows = []
    C, K, width = 10240, 4, 10240 + 6144 + 96
    w = torch.randn(C, K, device=DEV).to(torch.bfloat16)

    def case(name, T, make):
        copies = copies_for(T * width * 2)
        xs = [torch.randn(T, width, device=DEV).to(torch.bfloat16)[:, :C] for _ in range(copies)]
        ours, theirs = make(gpu_conv), make(ref)
        got, want = ours(xs[0]), theirs(xs[0])
        err = max(
            (a.float() - b.float()).abs().max().item() for a, b in zip(got, want, strict=True)
        )
        t_ours = bench_graph([lambda x=x: ours(x) for x in xs])
        t_ref = bench_graph([lambda x=x: theirs(x) for x in xs])
        floor = 2 * T * C * 2 / (bw * 1e9) * 1e6
        rows.append(
            {
                "case": name,
                "rows": T,
                "ours_us": t_ours,
                "ref_us": t_ref,
                "floor_us": floor,
                "max_abs_err": err,
            }
        )
        print(
            f"  conv {name}: ours {t_ours:.1f} us, reference {t_ref:.1f} us, floor "
            f"{floor:.1f} (max |diff| {err:.3g})",
            flush=True,
        )

    def padded(n, L):
        lengths = torch.full((n,), L - 1, device=DEV)
        return lambda mod: lambda x: mod.causal_conv_padded(x.view(n, L, C), lengths, w)

    def span(T):
        tail = torch.randn(C, K - 1, device=DEV).to(torch.bfloat16)
        return lambda mod: lambda x: mod.causal_conv(x, tail, w)

    def upto(L):
        tail = torch.randn(C, K - 1, device=DEV).to(torch.bfloat16)
        length = torch.tensor([L - 3], device=DEV)
        return lambda mod: lambda x: mod.causal_conv_upto(x, tail, w, length)

    def spans(n, L):
        tails = torch.randn(n, C, K - 1, device=DEV).to(torch.bfloat16)
        cu = torch.arange(0, (n + 1) * L, L, dtype=torch.int32, device=DEV)
        plan = [t.to(DEV) for t in ref.conv_spans_plan([L] * n, K - 1)]
        return lambda mod: lambda x: mod.causal_conv_spans(x, tails, w, lambda: plan, cu)

    case("padded 1x32", 32, padded(1, 32))
    case("padded 16x32", 512, padded(16, 32))
    case("span 500", 500, span(500))
    case("span 8192", 8192, span(8192))
    case("upto 512", 512, upto(512))
    case("spans 16x31", 496, spans(16, 31))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time the config sweep")
    ap.add_argument("--configs", default="", help="comma list: sweep only these SWEEP entries")
    ap.add_argument("--quick", action="store_true", help="skip the torch matmul baselines")
    ap.add_argument("--ms", default="", help="comma list: time the matmuls at these M only")
    ap.add_argument("--lm-head", action="store_true", help="also time the 248320x5120 lm_head")
    ap.add_argument("--before", default="", help="a quant_matmul.py to time alongside")
    ap.add_argument("--skip", default="", help="parts to skip: matmul,attention,gdn,chunk,conv")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "gpu_ops.json"))
    args = ap.parse_args()
    if args.ms:
        global MS
        MS = tuple(int(m) for m in args.ms.split(","))
    if args.configs:
        for name in set(SWEEP) - set(args.configs.split(",")):
            del SWEEP[name]
    torch.manual_seed(0)
    print(
        f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"triton {triton.__version__}"
    )
    bw = copy_bandwidth()
    print(f"copy bandwidth (read + write): {bw:.0f} GB/s", flush=True)
    skip = set(args.skip.split(","))
    before = load_module(args.before) if args.before else None
    mm = [] if "matmul" in skip else bench_matmul(bw, args.sweep, args.quick, args.lm_head, before)
    att = [] if "attention" in skip else bench_attention(bw)
    gdn = [] if "gdn" in skip else bench_gdn(bw)
    chunk = [] if "chunk" in skip else bench_chunk(bw, args.sweep)
    conv = [] if "conv" in skip else bench_conv(bw)
    with contextlib.suppress(OSError):
        Path(args.json).write_text(
            json.dumps(
                {
                    "copy_GBps": bw,
                    "matmul": mm,
                    "attention": att,
                    "gdn": gdn,
                    "chunk": chunk,
                    "conv": conv,
                },
                indent=1,
            )
        )

    print(
        f"\ncopy bandwidth {bw:.0f} GB/s; us per call (median); ours = CUDA-graph replay over "
        "weight copies (cold L2), eager = one Python launch; ratio = ours / floor"
    )
    print(
        f"{'matmul 4-bit g64':24s} {'M':>2s} {'ours':>6s} {'eager':>6s} {'floor':>6s} "
        f"{'ratio':>5s} {'before':>6s} {'b.rat':>5s} {'int4':>6s} {'deq+mm':>7s} {'bf16':>6s}"
    )
    for r in mm:
        b = r.get("before_us", float("nan"))
        print(
            f"{r['shape'] + ' ' + str(r['N']) + 'x' + str(r['K']):24.24s} {r['M']:2d} "
            f"{r['ours_us']:6.1f} {r['ours_eager_us']:6.1f} {r['floor_us']:6.1f} "
            f"{r['ratio']:5.2f} {b:6.1f} {b / r['floor_us']:5.2f} {r['torch_int4_us']:6.1f} "
            f"{r['torch_deq_mm_us']:7.1f} {r['bf16_cublas_us']:6.1f}"
            + "".join(f"  {c} {r[f'{c}_us']:6.1f}" for c in ROWS32 if f"{c}_us" in r)
        )
    for r in att:
        print(
            f"attention n={r['n']} len={r['length']:<5d}   {r['ours_us']:6.1f} "
            f"{r['ours_eager_us']:6.1f} {r['floor_us']:6.1f} {r['ratio']:5.2f}  torch ref "
            f"{r['torch_ref_us']:.1f}"
        )
    for r in gdn:
        print(
            f"gdn decode n={r['n']:<2d} x48 layers {r['graph48_us']:6.1f} {r['eager48_us']:6.1f} "
            f"{r['floor48_us']:6.1f} {r['ratio']:5.2f}"
        )
    for r in chunk:
        print(
            f"chunk attention W={r['width']:<4d} at {r['start']}: ours {r['ours_us']:.1f} us, "
            f"decode rows {r['decode_rows_us']:.1f}, sdpa {r['sdpa_us']:.1f}, floor "
            f"{r['floor_us']:.1f}"
        )
    for r in conv:
        print(
            f"conv {r['case']:<14s} ours {r['ours_us']:7.1f} us, reference {r['ref_us']:7.1f}, "
            f"floor {r['floor_us']:6.1f}, "
            f"48 layers save {(r['ref_us'] - r['ours_us']) * 48e-3:.2f} ms"
        )


if __name__ == "__main__":
    main()
