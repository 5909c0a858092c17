"""GPU kernels against the reference ops, on fresh random inputs (skipped without CUDA).

Every check computes the reference in fp32 from the *same* bf16 inputs the kernel sees, so the
tolerances below only have to cover the kernels' own roundings:

* quant_matmul: y is rounded to bf16, and the tiled layout also rounds the dequantized weight to
  bf16 for the tensor cores (each ~2**-9 relative, random; the MMA layout multiplies the exact
  codes): relative Frobenius error <= 6e-3, and every element within 3e-2 * max|ref|.
* gdn_decode: fp32 arithmetic throughout, only the summation order differs: outputs (asked in
  fp32) and states within 1e-4 relative Frobenius.
* gdn_prefill_varlen (flash-linear-attention chunked kernels, bf16 intermediates inside FLA):
  outputs and final states within 2e-2 relative Frobenius.
* decode_attention, chunk_attention: probabilities are rounded to bf16 before the PV product and
  the output is bf16: relative Frobenius error <= 1e-2.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from headstart.ops.attention.reference import attend_chunk, attend_decode
from headstart.ops.attention.triton import chunk_attention, decode_attention
from headstart.ops.gated_delta.fla import gdn_prefill_varlen
from headstart.ops.gated_delta.reference import gated_delta_step, recurrent_gated_delta
from headstart.ops.gated_delta.triton import gdn_decode
from headstart.ops.quant_matmul.triton import QmmConfig, dequantize_prepared, prepare, quant_matmul
from headstart.quant import quantize

DEV = torch.device("cuda")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


# ----------------------------------------------------------------------------- quant_matmul


def make_weight(
    n: int, k: int, bits: int, group: int, seed: int, scale_dtype: torch.dtype = torch.bfloat16
):
    w = torch.randn(n, k, generator=gen(seed), device=DEV) * 0.05
    return quantize(w, bits=bits, group_size=group, scale_dtype=scale_dtype)


def check_qmm(
    qt,
    m: int,
    seed: int,
    config: QmmConfig | None = None,
    block_n: int | None = None,
    layout: str = "auto",
    x_dtype: torch.dtype = torch.bfloat16,
) -> None:
    p = prepare(qt, config, block_n=block_n, layout=layout)
    n, k = qt.shape
    x = torch.randn(m, k, generator=gen(seed + 1), device=DEV).to(x_dtype)
    y = quant_matmul(x, p)
    assert y.shape == (m, n) and y.dtype == x_dtype
    ref = x.float() @ qt.dequantize(torch.float32).T
    assert torch.isfinite(y).all()
    err = rel_err(y, ref)
    assert err <= 6e-3, f"relative error {err:.2e}"
    assert (y.float() - ref).abs().max() <= 3e-2 * ref.abs().max()
    # Split-K counters are reset by the kernel: a second call must give the same bits.
    assert torch.equal(quant_matmul(x, p), y)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize(
    "n,k,group", [(96, 256, 32), (200, 512, 64), (130, 1024, 128), (64, 320, 64)]
)  # 320: K not a multiple of 8 groups
def test_quant_matmul_small(n, k, group, m):
    check_qmm(make_weight(n, k, 4, group, seed=n + k + group), m, seed=m)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(12288, 5120), (5120, 17408), (1024, 5120), (48, 5120)])
def test_quant_matmul_real_shapes(n, k, m):
    check_qmm(make_weight(n, k, 4, 64, seed=n + k), m, seed=7 * m)


# 9: two n8 tiles; 31: two m tiles of 16 (mma_rows=32: one of four n8 tiles); 40: three (two,
# the second partly beyond M); 64: four (two); 100: dequant + cuBLAS
@pytest.mark.parametrize("m", [1, 5, 9, 31, 40, 64, 100])
def test_quant_matmul_more_rows_and_configs(m):
    qt = make_weight(384, 2048, 4, 64, seed=m)
    check_qmm(qt, m, seed=m)
    for layout, bn, cfg in (
        ("mma", 128, QmmConfig(num_warps=8)),
        ("mma", 64, QmmConfig(prefetch=False)),
        ("mma", 256, QmmConfig(num_stages=3)),  # Triton's pipeliner instead of prefetch
        ("mma", 128, QmmConfig(ctas_per_sm=1)),  # no split-K
        ("mma", 128, QmmConfig(mma_rows=32)),  # 32-row m tiles above 16 rows
        ("tiled", 32, QmmConfig()),
        ("tiled", 16, QmmConfig(prefetch=False, num_warps=2)),
        ("tiled", 64, QmmConfig(num_warps=8, ctas_per_sm=8)),
        ("tiled", 128, QmmConfig(num_warps=8, prefetch=False)),
        ("tiled", 32, QmmConfig(use_dot=True)),
    ):  # M == 1 through the tensor-core path too
        check_qmm(qt, m, seed=m + 1, config=cfg, block_n=bn, layout=layout)


@pytest.mark.parametrize("m", [1, 16])
def test_quant_matmul_8bit_and_fp16_scales(m):
    check_qmm(make_weight(256, 1024, 8, 64, seed=3), m, seed=m)
    check_qmm(make_weight(256, 1024, 4, 64, seed=4, scale_dtype=torch.float16), m, seed=m)
    check_qmm(make_weight(256, 1024, 2, 64, seed=5), m, seed=m)


@pytest.mark.parametrize("m", [1, 12])
@pytest.mark.parametrize("group", [64, 128])
def test_quant_matmul_fp16_x(m, group):
    """fp16 activations: the MMA layout multiplies in fp16 (1024 + q codes)."""
    qt = make_weight(320, 1152, 4, group, seed=group)  # 1152: an odd number of 64-chunks
    check_qmm(qt, m, seed=m, x_dtype=torch.float16)
    check_qmm(qt, m, seed=m, x_dtype=torch.float16, layout="tiled")


def test_quant_matmul_leading_dims_and_empty():
    p = prepare(make_weight(128, 256, 4, 64, seed=5))
    x = torch.randn(2, 3, 256, generator=gen(6), device=DEV).to(torch.bfloat16)
    y = quant_matmul(x, p)
    assert y.shape == (2, 3, 128)
    torch.testing.assert_close(y.reshape(6, 128), quant_matmul(x.reshape(6, 256), p))
    assert quant_matmul(x[:0].reshape(0, 256), p).shape == (0, 128)
    # a strided view of x (row stride not a multiple of 8 elements) is copied, not misread
    xs = torch.randn(4, 260, generator=gen(7), device=DEV).to(torch.bfloat16)[:, 2:258]
    torch.testing.assert_close(quant_matmul(xs, p), quant_matmul(xs.contiguous(), p))


@pytest.mark.parametrize("layout", ["mma", "tiled"])
def test_dequantize_prepared_matches_reference(layout):
    for group in (64, 128):
        qt = make_weight(300, 640, 4, group, seed=9)
        w = dequantize_prepared(prepare(qt, layout=layout), torch.float32)
        torch.testing.assert_close(w, qt.dequantize(torch.float32), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["mma", "tiled"])
def test_dense_copy_serves_prefill_rows_only(layout):
    """prepare(dense=bf16) keeps the weight unpacked once: prefill-sized x (M > 64) multiply it
    and give the bits of the unpack-per-call path; decode-sized x still read the packed words;
    x of another dtype ignores a copy it cannot use."""
    qt = make_weight(320, 1024, 4, 64, seed=21)
    packed, dense = prepare(qt, layout=layout), prepare(qt, layout=layout, dense=torch.bfloat16)
    assert dense.dense is not None and dense.dense.shape == (320, 1024)
    torch.testing.assert_close(dense.dense, dequantize_prepared(packed), rtol=0, atol=0)
    for m in (8, 65, 300):
        x = torch.randn(m, 1024, generator=gen(m), device=DEV).to(torch.bfloat16)
        assert torch.equal(quant_matmul(x, dense), quant_matmul(x, packed))
        check_qmm(qt, m, seed=m, layout=layout)
    x16 = torch.randn(100, 1024, generator=gen(3), device=DEV).to(torch.float16)
    assert torch.equal(quant_matmul(x16, dense), quant_matmul(x16, packed))


# ----------------------------------------------------------------------------- GDN decode


def gdn_step_inputs(n, Hk, Hv, Dk, Dv, seed):
    g = gen(seed)
    q = torch.randn(n, Hk, Dk, generator=g, device=DEV).to(torch.bfloat16)
    k = torch.randn(n, Hk, Dk, generator=g, device=DEV).to(torch.bfloat16)
    v = torch.randn(n, Hv, Dv, generator=g, device=DEV).to(torch.bfloat16)
    decay = -torch.rand(n, Hv, generator=g, device=DEV) * 2  # log decay <= 0, fp32
    beta = torch.rand(n, Hv, generator=g, device=DEV).to(torch.bfloat16)
    return q, k, v, decay, beta


@pytest.mark.parametrize(
    "n,Hk,Hv,Dk,Dv",
    [(3, 2, 4, 32, 64), (1, 16, 48, 128, 128), (16, 16, 48, 128, 128), (5, 16, 16, 128, 128)],
)
def test_gdn_decode(n, Hk, Hv, Dk, Dv):
    slots_total = n + 3
    pool = torch.randn(slots_total, Hv, Dk, Dv, generator=gen(n), device=DEV)
    slots = torch.randperm(slots_total, generator=torch.Generator().manual_seed(n))[:n].to(DEV)
    fresh = torch.zeros(n, dtype=torch.bool, device=DEV)
    fresh[::2] = True
    pool[slots[fresh]] = float("nan")  # a fresh stream must ignore whatever its slot holds
    before = pool.clone()
    q, k, v, decay, beta = gdn_step_inputs(n, Hk, Hv, Dk, Dv, seed=n + Hv)
    state = torch.where(fresh[:, None, None, None], 0.0, before[slots])
    o_ref, s_ref = gated_delta_step(q, k, v, decay, beta, state)

    o = gdn_decode(q, k, v, decay, beta, slots, fresh, pool, out_dtype=torch.float32)
    assert rel_err(o, o_ref) <= 1e-4
    assert rel_err(pool[slots], s_ref) <= 1e-4
    untouched = torch.ones(slots_total, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert torch.equal(pool[untouched], before[untouched])

    # Default output dtype (v's) and strided q/k/v views, as the model passes them.
    mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=1)
    qv, kv, vv = torch.split(mixed, [Hk * Dk, Hk * Dk, Hv * Dv], dim=1)
    pool2 = before.clone()
    o16 = gdn_decode(
        qv.view(n, Hk, Dk), kv.view(n, Hk, Dk), vv.view(n, Hv, Dv), decay, beta, slots, fresh, pool2
    )
    assert o16.dtype == torch.bfloat16
    assert rel_err(o16, o_ref) <= 5e-3
    assert rel_err(pool2[slots], s_ref) <= 1e-4


# ----------------------------------------------------------------------------- GDN prefill


@pytest.mark.parametrize(
    "lens,Hk,Hv,D,first_fresh",
    [
        ([1, 37, 64, 130], 2, 4, 64, True),
        ([5, 200], 16, 48, 128, True),
        ([300], 16, 16, 128, True),
        ([31], 2, 4, 64, False),
    ],
)
def test_gdn_prefill_varlen(lens, Hk, Hv, D, first_fresh):
    """Several spans (FLA's varlen form) and one span (its plain form), fresh or continued."""
    pytest.importorskip("fla")
    N, T = len(lens), sum(lens)
    g = gen(T + Hv)
    q = torch.randn(T, Hk, D, generator=g, device=DEV).to(torch.bfloat16)
    k = torch.randn(T, Hk, D, generator=g, device=DEV).to(torch.bfloat16)
    v = torch.randn(T, Hv, D, generator=g, device=DEV).to(torch.bfloat16)
    decay = torch.nn.functional.logsigmoid(torch.randn(T, Hv, generator=g, device=DEV))
    beta = torch.rand(T, Hv, generator=g, device=DEV).to(torch.bfloat16)
    cu = torch.tensor([0] + lens, device=DEV).cumsum(0)
    pool = torch.randn(N + 2, Hv, D, D, generator=g, device=DEV) * 0.1
    slots = torch.arange(N, device=DEV).flip(0) + 1
    fresh = torch.zeros(N, dtype=torch.bool, device=DEV)
    fresh[0] = first_fresh
    if first_fresh:
        pool[slots[0]] = float("nan")
    before = pool.clone()

    o = gdn_prefill_varlen(q, k, v, decay, beta, cu, slots, fresh, pool)
    assert o.shape == (T, Hv, D) and o.dtype == torch.bfloat16
    for i in range(N):
        a, b = cu[i].item(), cu[i + 1].item()
        s0 = torch.zeros_like(before[0]) if fresh[i] else before[slots[i]]
        o_ref, s_ref = recurrent_gated_delta(q[a:b], k[a:b], v[a:b], decay[a:b], beta[a:b], s0)
        assert rel_err(o[a:b], o_ref) <= 2e-2, f"seq {i}"
        assert rel_err(pool[slots[i]], s_ref) <= 2e-2, f"seq {i}"
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[-1], before[-1])


@pytest.mark.parametrize(
    "lens,L,Hk,Hv,D", [([31, 7, 1, 16], 32, 16, 48, 128), ([100], 128, 2, 4, 64)]
)
def test_gdn_padded(lens, L, Hk, Hv, D):
    """New streams padded to L rows (FLA's batched form) with zero decay and beta on the
    padding rows: each stream's outputs and final state as its rows alone give them."""
    from headstart.ops.gated_delta.fla import gdn_padded

    pytest.importorskip("fla")
    N = len(lens)
    g = gen(N * L + Hv)
    q = torch.randn(N, L, Hk, D, generator=g, device=DEV).to(torch.bfloat16)
    k = torch.randn(N, L, Hk, D, generator=g, device=DEV).to(torch.bfloat16)
    v = torch.randn(N, L, Hv, D, generator=g, device=DEV).to(torch.bfloat16)
    decay = torch.nn.functional.logsigmoid(torch.randn(N, L, Hv, generator=g, device=DEV))
    beta = torch.rand(N, L, Hv, generator=g, device=DEV).to(torch.bfloat16)
    valid = torch.arange(L, device=DEV)[None, :] < torch.tensor(lens, device=DEV)[:, None]
    decay, beta = (torch.where(valid[..., None], t, 0) for t in (decay, beta))
    pool = torch.full((N + 1, Hv, D, D), float("nan"), device=DEV)
    slots = torch.arange(N, device=DEV) + 1
    o = gdn_padded(q, k, v, decay, beta, slots, pool)
    for j, n in enumerate(lens):
        zero = torch.zeros(Hv, D, D, device=DEV)
        o_ref, s_ref = recurrent_gated_delta(
            q[j, :n], k[j, :n], v[j, :n], decay[j, :n], beta[j, :n], zero
        )
        assert rel_err(o[j, :n], o_ref) <= 2e-2 and rel_err(pool[j + 1], s_ref) <= 2e-2, j
    assert pool[0].isnan().all()


@pytest.mark.parametrize(
    "lens,L,Hk,Hv,D",
    [([31] * 15 + [7], 32, 16, 48, 128), ([20, 32, 1], 32, 16, 16, 128), ([17, 9], 24, 2, 4, 64)],
)
def test_gdn_fresh_padded_equals_flas_chunked_form(lens, L, Hk, Hv, D):
    """Several new prompts of one chunk through FLA's solve and our outputs and final states
    (``gdn_fresh_padded``, what ``gdn_padded`` takes for them) against FLA's whole chunked form
    (``fla.gdn_padded``) and the recurrent reference; other slots untouched."""
    from headstart.ops.gated_delta import triton as gpu_gdn
    from headstart.ops.gated_delta.fla import gdn_fresh_padded, gdn_padded

    pytest.importorskip("fla")
    N = len(lens)
    assert gpu_gdn.fresh_padded_fits(N, L, D, D)
    g = gen(7 * N + L)
    q = torch.randn(N, L, Hk, D, generator=g, device=DEV).to(torch.bfloat16)
    k = torch.randn(N, L, Hk, D, generator=g, device=DEV).to(torch.bfloat16)
    v = torch.randn(N, L, Hv, D, generator=g, device=DEV).to(torch.bfloat16)
    decay = torch.nn.functional.logsigmoid(torch.randn(N, L, Hv, generator=g, device=DEV))
    beta = torch.rand(N, L, Hv, generator=g, device=DEV).to(torch.bfloat16)
    valid = torch.arange(L, device=DEV)[None, :] < torch.tensor(lens, device=DEV)[:, None]
    decay, beta = (torch.where(valid[..., None], t, 0) for t in (decay, beta))
    pools = [torch.full((N + 2, Hv, D, D), float("nan"), device=DEV) for _ in range(3)]
    slots = torch.arange(N, device=DEV).flip(0) + 1
    got = gdn_fresh_padded(q, k, v, decay, beta, slots, pools[0])
    fla_o = gdn_padded(q, k, v, decay, beta, slots, pools[1])
    via_padded = gpu_gdn.gdn_padded(q, k, v, decay, beta, slots, pools[2])
    for j, n in enumerate(lens):
        s = slots[j]
        assert rel_err(got[j, :n], fla_o[j, :n]) <= 1e-2, j
        assert rel_err(pools[0][s], pools[1][s]) <= 1e-2, j
        zero = torch.zeros(Hv, D, D, device=DEV)
        o_ref, s_ref = recurrent_gated_delta(
            q[j, :n], k[j, :n], v[j, :n], decay[j, :n], beta[j, :n], zero
        )
        assert rel_err(got[j, :n], o_ref) <= 2e-2 and rel_err(pools[0][s], s_ref) <= 2e-2, j
    assert torch.equal(via_padded, got) and torch.equal(pools[2][slots], pools[0][slots])
    for p in pools:
        assert p[0].isnan().all() and p[-1].isnan().all()


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize(
    "nh,nkv,hd,max_tokens,lens",
    [
        (8, 2, 64, 300, [1, 77, 300]),
        (24, 4, 256, 32768, [1, 5000, 32768]),
        (16, 4, 128, 4096, [63, 64, 65, 4095]),
    ],
)
@pytest.mark.parametrize("splits", [None, 1, 64])
def test_decode_attention(nh, nkv, hd, max_tokens, lens, splits):
    n = len(lens)
    g = gen(hd + n)
    slots_total = n + 1
    keys = torch.randn(slots_total, nkv, max_tokens, hd, generator=g, device=DEV).to(torch.bfloat16)
    values = torch.randn(slots_total, nkv, max_tokens, hd, generator=g, device=DEV).to(
        torch.bfloat16
    )
    q = torch.randn(n, nh, hd, generator=g, device=DEV).to(torch.bfloat16)
    slots = torch.arange(n, device=DEV).flip(0) + 1
    lengths = torch.tensor(lens, device=DEV, dtype=torch.int32)
    ref = attend_decode(q.float(), keys[slots].float(), values[slots].float(), lengths)
    for i, s in enumerate(slots.tolist()):  # rows past the length must never be read
        keys[s, :, lens[i] :] = float("nan")
        values[s, :, lens[i] :] = float("nan")
    out = decode_attention(q, keys, values, slots, lengths, num_splits=splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize(
    "nh,nkv,hd,max_tokens,width,start",
    [
        (8, 2, 64, 300, 2, 0),
        (8, 2, 64, 300, 130, 77),
        (24, 4, 256, 16384, 512, 12000),
        (24, 4, 256, 16384, 48, 9000),
        (16, 4, 128, 4096, 64, 1),
    ],
)
@pytest.mark.parametrize("splits", [None, 1, 8])
def test_chunk_attention(nh, nkv, hd, max_tokens, width, start, splits):
    """One stream's continued chunk (slot and start as device tensors) against the reference;
    the pool rows past the chunk and every other slot hold NaN, which must never be read."""
    g = gen(hd + width)
    shape = (3, nkv, max_tokens, hd)
    keys = torch.full(shape, float("nan"), device=DEV, dtype=torch.bfloat16)
    values = torch.full(shape, float("nan"), device=DEV, dtype=torch.bfloat16)
    end = start + width
    keys[2, :, :end] = torch.randn(nkv, end, hd, generator=g, device=DEV).to(torch.bfloat16)
    values[2, :, :end] = torch.randn(nkv, end, hd, generator=g, device=DEV).to(torch.bfloat16)
    q = torch.randn(width, nh, hd, generator=g, device=DEV).to(torch.bfloat16)
    slot, at = (torch.tensor([v], device=DEV) for v in (2, start))
    ref = attend_chunk(q.float(), keys.float(), values.float(), slot, at)
    out = chunk_attention(q, keys, values, slot, at, num_splits=splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-2


@pytest.mark.parametrize("nh,nkv,hd,lens", [(8, 2, 256, [31, 31, 14, 1]), (16, 4, 128, [300, 7])])
def test_fresh_prompts_attention(nh, nkv, hd, lens):
    """The GPU kernels' several-new-prompts attention (varlen flash by cu_seqlens, or SDPA
    under a block-diagonal mask) and the padded form, against the reference per prompt."""
    from headstart.kernels import gpu_kernels
    from headstart.ops.attention.reference import attend

    T, kernels = sum(lens), gpu_kernels()
    g = gen(T)
    q = torch.randn(T, nh, hd, generator=g, device=DEV).to(torch.bfloat16)
    k = torch.randn(T, nkv, hd, generator=g, device=DEV).to(torch.bfloat16)
    v = torch.randn(T, nkv, hd, generator=g, device=DEV).to(torch.bfloat16)
    cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    out = kernels.attn_fresh_spans(q, k, v, cu.to(DEV), cu)
    assert out.shape == q.shape and out.dtype == q.dtype
    L = max(lens)
    pad = [torch.zeros(len(lens), L, *t.shape[1:], dtype=t.dtype, device=DEV) for t in (q, k, v)]
    begin = 0
    for j, n in enumerate(lens):
        rows = slice(begin, begin + n)
        ref = attend(
            q[rows].float(), k[rows].float().transpose(0, 1), v[rows].float().transpose(0, 1), 0
        )
        assert rel_err(out[rows], ref) <= 1e-2
        for p, t in zip(pad, (q, k, v), strict=True):
            p[j, :n] = t[rows]
        begin += n
    padded = kernels.attn_padded(*pad)
    begin = 0
    for j, n in enumerate(lens):
        assert torch.allclose(padded[j, :n].float(), out[begin : begin + n].float(), atol=2e-2)
        begin += n


def test_continued_span_attention_over_the_pool():
    """A continued stream's chunk (bottom-right causal over its KV rows) on the GPU vs the
    reference, GQA at the 27B attention shape."""
    from headstart.kernels import gpu_kernels
    from headstart.ops.attention.reference import attend

    g = gen(7)
    start, T, nh, nkv, hd = 300, 77, 24, 4, 256
    q = torch.randn(T, nh, hd, generator=g, device=DEV).to(torch.bfloat16)
    k = torch.randn(nkv, start + T, hd, generator=g, device=DEV).to(torch.bfloat16)
    v = torch.randn(nkv, start + T, hd, generator=g, device=DEV).to(torch.bfloat16)
    out = gpu_kernels().attn_span(q, k, v, start)
    assert rel_err(out, attend(q.float(), k.float(), v.float(), start)) <= 1e-2
