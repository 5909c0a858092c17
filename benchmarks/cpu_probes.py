"""Probes for a faster CPU decode, outside the server (default model sizes, 1 stream, 1 thread).

1. One GDN layer's decode core (conv step, gates, delta step: the reference kernels) eager and
   under ``torch.compile(dynamic=False)`` (inductor's C++ backend): time per call, compile
   time, and how far the compiled outputs and state are from eager's.
2. A 1-row matmul ``[1, 256] x [256, 1536]``: f32 weights (in cache, and 16 distinct ones that
   are not) against torch's CPU int4 matmul (``_weight_int4pack_mm_for_cpu``) with bf16 and
   f32 activations.

    python benchmarks/cpu_probes.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from headstart.kernels import REFERENCE
from headstart.ops.pointwise import reference as pointwise


def _us(fn, reps: int = 500) -> float:
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def gdn_core() -> None:
    n, C, K, H, D, slots_total = 1, 768, 4, 4, 64, 16
    gen = torch.Generator().manual_seed(0)
    mixed, weight = torch.randn(n, C, generator=gen), torch.randn(C, K, generator=gen)
    tails0 = torch.randn(slots_total, C, K - 1, generator=gen)
    states0 = torch.randn(slots_total, H, D, D, generator=gen)
    a, b = torch.randn(n, H, generator=gen), torch.randn(n, H, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    rows = slots = torch.arange(n)
    fresh = torch.zeros(n, dtype=torch.bool)

    def step(tails, states):
        y = pointwise.conv_step_rows(mixed, rows, weight, tails, slots, fresh)
        q, k, v = (t.reshape(n, H, D) for t in torch.split(y, [H * D] * 3, dim=-1))
        return REFERENCE.gdn_decode_gates(q, k, v, a, b, rows, A_log, dt_bias, slots, fresh, states)

    tails, states = tails0.clone(), states0.clone()
    eager = _us(lambda: step(tails, states))
    compiled = torch.compile(step, dynamic=False)
    start = time.perf_counter()
    t1, s1 = tails0.clone(), states0.clone()
    o1 = compiled(t1, s1)
    compile_s = time.perf_counter() - start
    t2, s2 = tails0.clone(), states0.clone()
    o2 = step(t2, s2)
    fast = _us(lambda: compiled(tails, states))
    print(
        f"GDN decode core: eager {eager:.1f} us, compiled {fast:.1f} us, compile {compile_s:.1f} s;"
        f" max |diff| out {(o1 - o2).abs().max():.1e}, state {(s1 - s2).abs().max():.1e}"
    )


def matmul() -> None:
    N, K = 1536, 256
    x, w = torch.randn(1, K), torch.randn(N, K)
    print(f"f32 linear, weight in cache: {_us(lambda: F.linear(x, w)):.1f} us")
    weights = [torch.randn(N, K) for _ in range(16)]

    def all_weights():
        for wi in weights:
            F.linear(x, wi)

    print(f"f32 linear, 16 distinct weights (25 MB): {_us(all_weights, 50) / 16:.1f} us each")
    codes = torch.randint(0, 16, (N, K), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_zeros = torch.randn(K // 64, N, 2)
    for dtype in (torch.bfloat16, torch.float32):
        xd, sz = x.to(dtype), scales_zeros.to(dtype)
        us = _us(
            lambda xd=xd, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(xd, packed, 64, sz)
        )
        print(f"int4pack matmul, {dtype} activations: {us:.1f} us")


def main() -> None:
    torch.set_num_threads(1)
    gdn_core()
    matmul()


if __name__ == "__main__":
    main()
