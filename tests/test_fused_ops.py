"""The fused per-row kernels (``ops/pointwise/triton.py``, the gated GDN step) against their
PyTorch references (``ops/pointwise/reference.py``) on fresh random inputs, and a model whose
decode steps run them against the reference model.

On a GPU they run as compiled; without one, under Triton's CPU interpreter (conftest sets
``TRITON_INTERPRET=1``) when Triton is installed, else the module skips. Tolerances: the kernels
round where the references round, except inside the conv step and RoPE (fp32 products instead of
bf16-rounded ones), reduction order, and, under the interpreter only, its fp32 -> bf16
conversion (toward zero): within 2 bf16 ulps (``rtol=atol=1.6e-2``) elementwise;
in-place state updates are compared whole, slots that must not change exactly.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from headstart.kernels import REFERENCE, _ref_gdn_decode_gates, _ref_gdn_padded
from headstart.ops.gated_delta import triton as gpu_gdn
from headstart.ops.gated_delta.triton import gdn_decode_gates
from headstart.ops.pointwise import reference as pointwise
from headstart.ops.pointwise import triton as gpu_fused

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Triton's interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest even as torch does.
EXACT = DEV.type == "cuda"
BF = torch.bfloat16


def rand(*shape, seed, scale=1.0, dtype=BF):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def close(out, ref, tol=1.6e-2):
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("residual", [True, False])
def test_add_rms_norm(residual):
    x, r = rand(3, 300, seed=1), rand(3, 300, seed=2)
    scale = rand(300, seed=3, dtype=torch.float32) * 0.1 + 1
    got = gpu_fused.add_rms_norm(x, r if residual else None, scale, 1e-6)
    want = pointwise.add_rms_norm(x, r if residual else None, scale, 1e-6)
    if EXACT:
        assert torch.equal(got[0], want[0])  # one rounding of the same fp32 sum
    close(got[0], want[0])
    close(got[1], want[1])


def test_gated_rms_norm_on_a_strided_gate():
    core = rand(2, 3, 32, seed=4)
    proj = rand(2, 3 * 32 + 7, seed=5)
    z = proj[:, 7:].view(2, 3, 32)
    w = rand(32, seed=6, dtype=torch.float32)
    close(gpu_fused.gated_rms_norm(core, z, w, 1e-6), pointwise.gated_rms_norm(core, z, w, 1e-6))


def test_gated_rms_norm_reads_gates_by_row():
    core = rand(3, 2, 32, seed=14)
    proj = rand(5, 2 * 32 + 3, seed=15)
    z = proj[:, 3:].view(5, 2, 32)
    w = rand(32, seed=16, dtype=torch.float32)
    rows = torch.tensor([4, 0, 2], device=core.device)
    got = gpu_fused.gated_rms_norm(core, z, w, 1e-6, gate_rows=rows)
    want = pointwise.gated_rms_norm(core, z[rows], w, 1e-6)
    close(got, want)
    close(pointwise.gated_rms_norm(core, z, w, 1e-6, gate_rows=rows), want)


def test_silu_mul_and_sigmoid_mul():
    gu = rand(3, 2 * 100, seed=7, scale=3)
    close(gpu_fused.silu_mul(gu), pointwise.silu_mul(gu))
    qg = rand(3, 4, 2 * 16, seed=8, scale=3)
    x = rand(3, 4 * 16, seed=9)
    gate = qg[..., 16:]
    close(gpu_fused.sigmoid_mul(x, gate), pointwise.sigmoid_mul(x, gate))


@pytest.mark.parametrize("weights", [torch.float32, BF])
def test_gdn_gates_on_strided_rows(weights):
    # a and b as the GDN layer passes them: row-strided views of the in_proj output. a spans
    # softplus's three regimes (far below zero: the series for log1p; above 20: x itself).
    H = 6
    proj = rand(5, 2 * H + 3, seed=17, scale=12)
    a, b = proj[:, 3 : 3 + H], proj[:, 3 + H :]
    a_log = rand(H, seed=18, dtype=weights)
    dt_bias = rand(H, seed=19, dtype=weights)
    g, beta = gpu_fused.gdn_gates(a, b, a_log, dt_bias)
    want_g, want_beta = pointwise.gdn_gates(a, b, a_log, dt_bias)
    assert g.dtype == want_g.dtype == torch.float32 and beta.dtype == want_beta.dtype == BF
    # Relative at every scale. exp(A_log) is rounded to A_log's dtype, as the reference does;
    # a bf16 rounding toward zero under the interpreter is one bf16 step (2^-8) off.
    rtol = 2e-5 if EXACT or weights is torch.float32 else 2**-7
    torch.testing.assert_close(g, want_g, rtol=rtol, atol=1e-30)
    if EXACT:
        assert torch.equal(beta, want_beta)
    close(beta, want_beta)
    assert gpu_fused.gdn_gates(a[:0], b[:0], a_log, dt_bias)[0].shape == (0, H)
    # Padding rows (valid False) get no decay and no update; the others are as above.
    valid = torch.tensor([True, False, True, True, False], device=a.device)
    g_v, beta_v = gpu_fused.gdn_gates(a, b, a_log, dt_bias, valid)
    assert torch.equal(g_v[~valid], torch.zeros_like(g_v[~valid]))
    assert torch.equal(beta_v[~valid], torch.zeros_like(beta_v[~valid]))
    torch.testing.assert_close(g_v[valid], want_g[valid], rtol=rtol, atol=1e-30)
    close(beta_v[valid], want_beta[valid])
    want_gv, want_bv = pointwise.gdn_gates(a, b, a_log, dt_bias, valid)
    assert torch.equal(want_gv[~valid], g_v[~valid]) and torch.equal(
        want_bv[~valid], beta_v[~valid]
    )


def _pools(seed):
    tails = rand(4, 40, 3, seed=seed)
    tails[1] = float("nan")  # a fresh stream's slot may hold anything
    return tails


def test_conv_step_rows_updates_tails_in_place():
    mixed = rand(5, 40, seed=10)
    weight = rand(40, 4, seed=11, scale=0.5)
    rows = torch.tensor([2, 4, 0], device=DEV)
    slots = torch.tensor([3, 1, 0], device=DEV)
    fresh = torch.tensor([False, True, False], device=DEV)
    got_tails, want_tails = _pools(12), _pools(12)
    got = gpu_fused.conv_step_rows(mixed, rows, weight, got_tails, slots, fresh)
    want = pointwise.conv_step_rows(mixed, rows, weight, want_tails, slots, fresh)
    close(got, want)
    assert torch.equal(got_tails[[0, 1, 3]], want_tails[[0, 1, 3]])
    assert torch.equal(got_tails[2], want_tails[2])  # untouched slot


@pytest.mark.parametrize("with_norm", [None, "in kernel", "separate"])
def test_gdn_decode_gates_reads_rows_and_updates_states(with_norm, monkeypatch):
    if with_norm == "separate":  # as for many streams: the norm runs as its own kernel
        monkeypatch.setattr(gpu_gdn, "norm_fold_limit", lambda device: 0)
    n, T, Hk, Hv, D = 3, 5, 2, 4, 16
    q, k = rand(n, Hk, D, seed=13), rand(n, Hk, D, seed=14)
    v = rand(n, Hv, D, seed=15)
    a, b = rand(T, Hv, seed=16, scale=4), rand(T, Hv, seed=17, scale=2)
    a[4, 0] = 30.0  # softplus past its linear threshold
    A_log = rand(Hv, seed=18, dtype=torch.float32)
    dt_bias = rand(Hv, seed=19, dtype=torch.float32)
    rows = torch.tensor([4, 0, 2], device=DEV)
    slots = torch.tensor([2, 0, 3], device=DEV)
    fresh = torch.tensor([False, True, False], device=DEV)
    states = rand(4, Hv, D, D, seed=20, dtype=torch.float32)
    states[0] = float("nan")
    want_states = states.clone()
    proj = rand(T, Hv * D + 3, seed=21, scale=2)
    norm = (
        (proj[:, 3:].view(T, Hv, D), rand(D, seed=22, dtype=torch.float32), 1e-6)
        if with_norm
        else None
    )
    got = gdn_decode_gates(q, k, v, a, b, rows, A_log, dt_bias, slots, fresh, states, norm=norm)
    want = _ref_gdn_decode_gates(
        q, k, v, a, b, rows, A_log, dt_bias, slots, fresh, want_states, norm=norm
    )
    close(got, want)
    tol = 1e-4 if EXACT else 1.6e-2  # beta rounds toward zero under the interpreter
    torch.testing.assert_close(states, want_states, rtol=tol, atol=tol)
    assert torch.equal(states[1], want_states[1])


@pytest.mark.parametrize("W", [2, 5])
def test_conv_window_equals_one_row_steps_and_keeps_each_rows_tail(W):
    """A verify window's conv (W rows of each stream in one launch) against the same kernel's
    W one-row steps: bit for bit, and the tail after each row (``row_tails``) is the tail each
    step leaves; both against the reference."""
    n, C, K = 3, 40, 4
    mixed = rand(n * W + 2, C, seed=30)
    weight = rand(C, K, seed=31, scale=0.5)
    rows = torch.randperm(n * W + 2, generator=torch.Generator().manual_seed(32))[: n * W]
    rows = rows.to(DEV)
    slots = torch.tensor([3, 0, 2], device=DEV)
    kept = torch.zeros(n, dtype=torch.bool, device=DEV)
    pools = [rand(4, C, K - 1, seed=33) for _ in range(3)]
    # The first as windows get it: a slice of records as wide as the widest window.
    row_tails = [torch.zeros(n, W + 2, C, K - 1, dtype=BF, device=DEV)[:, :W]]
    row_tails.append(torch.empty(n, W, C, K - 1, dtype=BF, device=DEV))
    got = gpu_fused.conv_step_rows(
        mixed, rows, weight, pools[0], slots, kept, width=W, row_tails=row_tails[0]
    )
    steps = []
    for t in range(W):
        at = rows.view(n, W)[:, t].contiguous()
        steps.append(gpu_fused.conv_step_rows(mixed, at, weight, pools[1], slots, kept))
        row_tails[1][:, t] = pools[1][slots]
    assert torch.equal(got, torch.stack(steps, 1).flatten(0, 1))
    assert torch.equal(pools[0], pools[1]) and torch.equal(row_tails[0], row_tails[1])
    want = pointwise.conv_step_rows(mixed, rows, weight, pools[2], slots, kept, width=W)
    close(got, want)
    close(pools[0], pools[2])


@pytest.mark.parametrize(
    "with_norm,W", [(None, 4), ("in kernel", 4), ("separate", 4), ("in kernel", 3)]
)
def test_gdn_window_equals_one_row_steps_and_keeps_each_rows_state(with_norm, W, monkeypatch):
    """A verify window's GDN (W rows of each stream in one launch, the state held between
    rows) against the same kernel's W one-row steps: bit for bit, outputs, final states and the
    state after each row (``row_states``); and against the reference."""
    if with_norm == "separate":
        monkeypatch.setattr(gpu_gdn, "norm_fold_limit", lambda device: 0)
    n, Hk, Hv, D = 2, 2, 4, 16
    T = n * W + 1
    q, k = rand(n * W, Hk, D, seed=40), rand(n * W, Hk, D, seed=41)
    v = rand(n * W, Hv, D, seed=42)
    a, b = rand(T, Hv, seed=43, scale=4), rand(T, Hv, seed=44, scale=2)
    A_log = rand(Hv, seed=45, dtype=torch.float32)
    dt_bias = rand(Hv, seed=46, dtype=torch.float32)
    rows = torch.tensor([T - 1, 0, 2, 1, 3, 5, 4, 7][: n * W], device=DEV)
    slots = torch.tensor([2, 0], device=DEV)
    kept = torch.zeros(n, dtype=torch.bool, device=DEV)
    states = [rand(3, Hv, D, D, seed=47, dtype=torch.float32) for _ in range(3)]
    row_states = [torch.zeros(n, W + 3, Hv, D, D, device=DEV)[:, :W]]  # as in wider records
    row_states.append(torch.empty(n, W, Hv, D, D, device=DEV))
    proj = rand(T, Hv * D + 3, seed=48, scale=2)
    norm = (
        (proj[:, 3:].view(T, Hv, D), rand(D, seed=49, dtype=torch.float32), 1e-6)
        if with_norm
        else None
    )
    common = (a, b, rows, A_log, dt_bias, slots, kept, states[0])
    got = gdn_decode_gates(q, k, v, *common, norm=norm, width=W, row_states=row_states[0])
    steps = []
    for t in range(W):
        step = [x.view(n, W, *x.shape[1:])[:, t] for x in (q, k, v)]
        at = rows.view(n, W)[:, t].contiguous()
        steps.append(
            gdn_decode_gates(*step, a, b, at, A_log, dt_bias, slots, kept, states[1], norm=norm)
        )
        row_states[1][:, t] = states[1][slots]
    assert torch.equal(got, torch.stack(steps, 1).flatten(0, 1))
    assert torch.equal(states[0], states[1]) and torch.equal(row_states[0], row_states[1])
    want = _ref_gdn_decode_gates(
        q, k, v, a, b, rows, A_log, dt_bias, slots, kept, states[2], norm=norm, width=W
    )
    # Under the interpreter, beta's rounding toward zero compounds over the window's rows.
    close(got, want, tol=1.6e-2 if EXACT else 8e-2)
    tol = 1e-4 if EXACT else 1.6e-2
    torch.testing.assert_close(states[0], states[2], rtol=tol, atol=tol)


def _padded_prompts(lens, L, D, seed):
    """New prompts of ``lens`` rows padded to L (zero decay and beta on the padding rows), 2
    key heads and 4 value heads of D, their slots, and two state pools of NaN."""
    N, Hk, Hv = len(lens), 2, 4
    q, k = rand(N, L, Hk, D, seed=seed), rand(N, L, Hk, D, seed=seed + 1)
    v = rand(N, L, Hv, D, seed=seed + 2)
    g = torch.nn.functional.logsigmoid(rand(N, L, Hv, seed=seed + 3, dtype=torch.float32))
    beta = torch.sigmoid(rand(N, L, Hv, seed=seed + 4, dtype=torch.float32)).to(BF)
    valid = torch.arange(L, device=DEV)[None, :] < torch.tensor(lens, device=DEV)[:, None]
    g, beta = (torch.where(valid[..., None], t, 0) for t in (g, beta))
    slots = torch.tensor([3, 0, 2][:N], device=DEV)
    pools = [torch.full((4, Hv, D, D), float("nan"), device=DEV) for _ in range(2)]
    return q, k, v, g, beta, slots, pools


@pytest.mark.parametrize("lens,L", [([5, 1, 8], 8), ([3, 16], 16)])
def test_gdn_padded_as_one_row_steps_equals_the_reference(lens, L):
    """New prompts padded to L rows (zero decay and beta on the padding rows) through the step
    kernel (:func:`gdn_padded` at <= RECURRENT_MAX_ROWS rows): every real row's output and the
    final state against the chunked reference; the slots' old contents (NaN) never read."""
    assert L <= gpu_gdn.RECURRENT_MAX_ROWS
    N, Hv, D = len(lens), 4, 16
    q, k, v, g, beta, slots, pools = _padded_prompts(lens, L, D, seed=60)
    got = gpu_gdn.gdn_padded(q, k, v, g, beta, slots, pools[0])
    want = _ref_gdn_padded(q, k, v, g, beta, slots, pools[1])
    assert got.dtype == torch.float32 and got.shape == (N, L, Hv, D)
    for j, n in enumerate(lens):
        close(got[j, :n], want[j, :n], tol=1.6e-2 if EXACT else 8e-2)
    tol = 1e-4 if EXACT else 1.6e-2
    torch.testing.assert_close(pools[0][slots], pools[1][slots], rtol=tol, atol=tol)
    assert pools[0][1].isnan().all()


@pytest.mark.parametrize("lens,L", [([17, 1, 32], 32), ([20, 24], 24), ([5, 16], 16)])
def test_gdn_fresh_chunk_equals_the_reference(lens, L):
    """New prompts of up to 32 rows as one fused chunk (two 16-row blocks solved blockwise):
    every real row's output and the final state against the chunked reference, with value
    heads sharing key heads; the slots' old contents (NaN) never read."""
    N, Hv, D = len(lens), 4, 32
    q, k, v, g, beta, slots, pools = _padded_prompts(lens, L, D, seed=70)
    got = gpu_gdn.gdn_fresh_chunk(q, k, v, g, beta, slots, pools[0])
    want = _ref_gdn_padded(q, k, v, g, beta, slots, pools[1])
    assert got.dtype == torch.float32 and got.shape == (N, L, Hv, D)
    tol = 1e-2 if EXACT else 1e-3  # the GPU's products are tf32
    for j, n in enumerate(lens):
        close(got[j, :n], want[j, :n], tol=tol)
    torch.testing.assert_close(pools[0][slots], pools[1][slots], rtol=tol, atol=tol)
    assert pools[0][1].isnan().all()


def test_gdn_padded_takes_the_fused_chunk_for_one_new_prompt_of_17_to_32_rows():
    """The fused chunk where it measured faster than FLA (one prompt of 17..32 rows) and its
    tiles fit the heads; the one-row steps below, FLA for more prompts or other heads."""
    fits = gpu_gdn.fresh_chunk_fits
    assert fits(1, 32, 128, 128) and fits(1, 17, 16, 32)
    assert not fits(2, 32, 128, 128)  # FLA: one program per head and slice loses at 16 streams
    assert not fits(1, 16, 128, 128) and not fits(1, 33, 128, 128)
    assert not fits(1, 32, 96, 128) and not fits(1, 32, 128, 8)
    q, k, v, g, beta, slots, pools = _padded_prompts([20], 24, 32, seed=80)
    got = gpu_gdn.gdn_padded(q, k, v, g, beta, slots, pools[0])
    want = gpu_gdn.gdn_fresh_chunk(q, k, v, g, beta, slots, pools[1])
    assert torch.equal(got, want) and torch.equal(pools[0][slots], pools[1][slots])


def _wy_solved(q, k, v, g, beta):
    """What FLA's l2norm, chunk_local_cumsum and intra-chunk solve hand :func:`fresh_outputs`,
    in PyTorch: q and k L2-normalised (eps 1e-6 on the sum of squares), g as log2 cumulative
    decay, and u = (I + tril(beta_i k_i.k_j 2^(g_i - g_j), -1))^-1 (beta v) per head."""
    qn, kn = (t.float() / (t.float().square().sum(-1, keepdim=True) + 1e-6).sqrt() for t in (q, k))
    gc = g.float().cumsum(1) / math.log(2)
    L, Hv = g.shape[1:]
    rep = Hv // k.shape[2]
    kh = kn.repeat_interleave(rep, dim=2)  # [N, L, Hv, D]
    kk = torch.einsum("nihd,njhd->nhij", kh, kh)
    decay = torch.exp2(gc.transpose(1, 2)[..., :, None] - gc.transpose(1, 2)[..., None, :])
    b = beta.float().transpose(1, 2)  # [N, Hv, L]
    a = torch.tril(b[..., :, None] * kk * decay, -1)
    eye = torch.eye(L, device=q.device)
    bv = b[..., None] * v.float().transpose(1, 2)  # [N, Hv, L, Dv]
    u = torch.linalg.solve_triangular(eye + a, bv, upper=False, unitriangular=True)
    return qn, kn, gc, u.transpose(1, 2).contiguous()


@pytest.mark.parametrize("lens,L", [([17, 1, 32], 32), ([30, 32], 32), ([5, 20], 24)])
def test_fresh_outputs_after_the_wy_solve_equal_the_reference(lens, L):
    """New prompts of one chunk from a zero state: the outputs and final states from the WY
    values (as FLA's solve gives them) against the chunked reference from the raw inputs, with
    value heads sharing key heads; the slots' old contents (NaN) never read."""
    N, Hv, D = len(lens), 4, 32
    q, k, v, g, beta, slots, pools = _padded_prompts(lens, L, D, seed=90)
    qn, kn, gc, u = _wy_solved(q, k, v, g, beta)
    dt = BF if EXACT else torch.float32  # the interpreter's tl.dot misreads bf16 operands
    got = gpu_gdn.fresh_outputs(qn.to(dt), kn.to(dt), u.to(dt), gc, slots, pools[0], D**-0.5)
    want = _ref_gdn_padded(q, k, v, g, beta, slots, pools[1])
    assert got.dtype == dt and got.shape == (N, L, Hv, D)
    tol = 3e-2 if EXACT else 1e-3  # bf16 operands on the GPU, as FLA's
    for j, n in enumerate(lens):
        close(got[j, :n], want[j, :n], tol=tol)
    torch.testing.assert_close(pools[0][slots], pools[1][slots], rtol=tol, atol=tol)
    assert pools[0][1].isnan().all()


def test_gdn_padded_takes_flas_solve_and_our_outputs_for_several_prompts_of_one_chunk():
    fits = gpu_gdn.fresh_padded_fits
    assert fits(2, 32, 128, 128) and fits(16, 17, 128, 128) and fits(16, 32, 16, 32)
    assert not fits(1, 32, 128, 128)  # one prompt: the fused chunk (fresh_chunk_fits)
    assert not fits(16, 16, 128, 128)  # the one-row steps
    assert not fits(16, 33, 128, 128) and not fits(2, 64, 128, 128)  # FLA's chunked form
    assert not fits(16, 32, 96, 128) and not fits(16, 32, 128, 8)


def test_attn_decode_inputs_writes_kv_and_returns_q():
    nh, nkv, hd, rd = 4, 2, 32, 8
    T = 4
    qkv = rand(T, 2 * nh * hd + 2 * nkv * hd, seed=21)
    rows = torch.tensor([3, 0, 1], device=DEV)
    slots = torch.tensor([1, 2, 0], device=DEV)
    positions = torch.tensor([5, 0, 15], device=DEV)
    q_scale = rand(hd, seed=22, dtype=torch.float32) * 0.1 + 1
    k_scale = rand(hd, seed=23, dtype=torch.float32) * 0.1 + 1
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, rd, 2, device=DEV).float() / rd))
    pools = [rand(3, nkv, 16, hd, seed=24 + i) for i in range(2)]
    pools += [t.clone() for t in pools]
    got = gpu_fused.attn_decode_inputs(
        qkv, rows, nh, nkv, q_scale, k_scale, 1e-6, inv_freq, pools[0], pools[1], slots, positions
    )
    want = pointwise.attn_decode_inputs(
        qkv, rows, nh, nkv, q_scale, k_scale, 1e-6, inv_freq, pools[2], pools[3], slots, positions
    )
    close(got, want)
    close(pools[0], pools[2])
    assert torch.equal(pools[1], pools[3])  # values are copied, not computed


FUSED = replace(
    REFERENCE,
    gdn_decode_gates=gdn_decode_gates,
    add_rms_norm=gpu_fused.add_rms_norm,
    gated_rms_norm=gpu_fused.gated_rms_norm,
    silu_mul=gpu_fused.silu_mul,
    sigmoid_mul=gpu_fused.sigmoid_mul,
    gdn_gates=gpu_fused.gdn_gates,
    conv_step_rows=gpu_fused.conv_step_rows,
    attn_decode_inputs=gpu_fused.attn_decode_inputs,
)


def test_model_decode_with_fused_kernels_matches_reference(tmp_path):
    """Two streams prefilled by the reference, then batched decode steps (one stream fresh at
    position 0, as a new request can be) through the fused kernels. bf16 has no exact reference:
    the fused model's logit error against the fp32 reference is held to 1.5x that of the same
    reference path run in bf16."""
    import tiny

    from headstart.batch import ForwardBatch, SeqChunk
    from headstart.models.qwen35.model import Qwen35Model

    ckpt = tiny.save_text_only(tiny.causal_lm(seed=5, linear_value_head_dim=16), tmp_path / "ckpt")
    exact = Qwen35Model.load(ckpt, dtype=torch.float32, device=DEV, kernels=REFERENCE)
    ref = Qwen35Model.load(ckpt, dtype=BF, device=DEV, kernels=REFERENCE)
    fused = Qwen35Model(ref.cfg, dict(ref.w), BF, DEV, kernels=FUSED)  # consumes its dict
    fused.head = ref.head
    models = (exact, ref, fused)
    pools = [m.new_state_pool(3, 64) for m in models]
    prompt = tuple(range(3, 12))
    for m, pool in zip(models, pools, strict=True):  # the prefill: reference kernels only
        (exact if m is exact else ref).forward(
            ForwardBatch.build([SeqChunk(0, 0, prompt)], DEV), pool
        )
    for step in range(3):
        chunks = [SeqChunk(0, len(prompt) + step, (7 + step,)), SeqChunk(2, step, (9 + step,))]
        want, bf16, got = (
            m.forward(ForwardBatch.build(chunks, DEV), pool).float()
            for m, pool in zip(models, pools, strict=True)
        )
        assert (got - want).abs().max() <= 1.5 * (bf16 - want).abs().max() + 1e-3, step


# -- the GDN convolution of prefill rows (ops/conv/triton.py) against ops/conv/reference.py ---


def _conv_inputs(T, C=40, K=4, seed=0):
    return rand(T, C, seed=seed), rand(C, K, seed=seed + 1), rand(C, K - 1, seed=seed + 2)


@pytest.mark.parametrize("T", [1, 2, 3, 5, 37])
def test_conv_span_kernel(T):
    """One span from a nonzero tail and from a zero one; spans shorter than the tail too."""
    from headstart.ops.conv import reference as ref
    from headstart.ops.conv import triton as gpu_conv

    x, w, tail = _conv_inputs(T, seed=T)
    for t in (tail, torch.zeros_like(tail)):
        y, new = gpu_conv.causal_conv(x, t, w)
        want_y, want_new = ref.causal_conv(x, t, w)
        close(y, want_y)
        assert torch.equal(new, want_new)


def test_conv_upto_kernel_on_a_strided_x():
    """A padded span (real rows first ``length``) read from a column slice of a wider row, as
    the GDN's projection gives it: real rows and the tail ending at the last real row."""
    from headstart.ops.conv import reference as ref
    from headstart.ops.conv import triton as gpu_conv

    wide = rand(9, 50, seed=3)
    x, w, tail = wide[:, 4:44], rand(40, 4, seed=4), rand(40, 3, seed=5)
    for n in (1, 2, 4, 9):
        length = torch.tensor([n], device=DEV)
        y, new = gpu_conv.causal_conv_upto(x, tail, w, length)
        want_y, want_new = ref.causal_conv_upto(x, tail, w, length)
        close(y[:n], want_y[:n])
        assert torch.equal(new, want_new)


def test_conv_padded_kernel():
    from headstart.ops.conv import reference as ref
    from headstart.ops.conv import triton as gpu_conv

    lengths = torch.tensor([5, 1, 2, 8], device=DEV)
    x, w = rand(4, 8, 40, seed=6), rand(40, 4, seed=7)
    y, tails = gpu_conv.causal_conv_padded(x, lengths, w)
    want_y, want_tails = ref.causal_conv_padded(x, lengths, w)
    for j, n in enumerate(lengths.tolist()):
        close(y[j, :n], want_y[j, :n])
    assert torch.equal(tails, want_tails)
    # The tails written straight into a pool's slots (fp32 pool, bf16 rows); other slots kept.
    slots = torch.tensor([3, 0, 5, 1], device=DEV)
    pool = rand(6, 40, 3, seed=8, dtype=torch.float32)
    want_pool = pool.clone()
    want_pool[slots] = want_tails.float()
    y2, none = gpu_conv.causal_conv_padded(x, lengths, w, (pool, slots))
    assert none is None and torch.equal(y2, y) and torch.equal(pool, want_pool)
    ref_pool = rand(6, 40, 3, seed=8, dtype=torch.float32)
    assert ref.causal_conv_padded(x, lengths, w, (ref_pool, slots))[1] is None
    assert torch.equal(ref_pool, want_pool)
    # q, k and v (channels [0, 12), [12, 24), [24, 40)) as three dense tensors.
    (q, k, v), _ = gpu_conv.causal_conv_padded(x, lengths, w, split=12)
    want = ref.causal_conv_padded(x, lengths, w, split=12)[0]
    for got, part, a, b in zip((q, k, v), want, (0, 12, 24), (12, 24, 40), strict=True):
        assert got.is_contiguous() and got.shape == (4, 8, b - a)
        assert torch.equal(got, y[..., a:b]) and torch.equal(part, want_y[..., a:b])


@pytest.mark.parametrize("lengths", [[5, 1, 2, 9], [1, 1], [3, 17]])
def test_conv_spans_kernel(lengths):
    """Several spans in one pass, fresh (zero tail) and continued, shorter and longer than
    the tail."""
    from headstart.ops.conv import reference as ref
    from headstart.ops.conv import triton as gpu_conv

    x, w = rand(sum(lengths), 40, seed=8), rand(40, 4, seed=9)
    tails = rand(len(lengths), 40, 3, seed=10)
    tails[0] = 0.0
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEV)
    plan = [t.to(DEV) for t in ref.conv_spans_plan(lengths, 3)]
    y, new = gpu_conv.causal_conv_spans(x, tails, w, lambda: plan, cu)
    want_y, want_new = ref.causal_conv_spans(x, tails, w, lambda: plan, cu)
    close(y, want_y)
    assert torch.equal(new, want_new)


def test_model_prefill_with_the_conv_kernels_matches_reference(tmp_path):
    """Prefill through the conv kernels: a new prompt alone, then one new and one continued
    stream in one forward (several spans), then a continued chunk alone. Logit error against
    the fp32 reference held to 1.5x that of the reference path in bf16, as above."""
    import tiny

    from headstart.batch import ForwardBatch, SeqChunk
    from headstart.models.qwen35.model import Qwen35Model
    from headstart.ops.conv import triton as gpu_conv

    ckpt = tiny.save_text_only(tiny.causal_lm(seed=6, linear_value_head_dim=16), tmp_path / "ckpt")
    exact = Qwen35Model.load(ckpt, dtype=torch.float32, device=DEV, kernels=REFERENCE)
    ref = Qwen35Model.load(ckpt, dtype=BF, device=DEV, kernels=REFERENCE)
    conv_set = replace(
        REFERENCE,
        conv_span=gpu_conv.causal_conv,
        conv_upto=gpu_conv.causal_conv_upto,
        conv_padded=gpu_conv.causal_conv_padded,
        conv_spans=gpu_conv.causal_conv_spans,
    )
    fused = Qwen35Model(ref.cfg, dict(ref.w), BF, DEV, kernels=conv_set)
    fused.head = ref.head
    models = (exact, ref, fused)
    pools = [m.new_state_pool(3, 64) for m in models]
    steps = (
        [SeqChunk(0, 0, tuple(range(3, 12)))],
        [SeqChunk(1, 0, tuple(range(20, 25))), SeqChunk(0, 9, (40, 41))],
        [SeqChunk(1, 5, tuple(range(50, 57)))],
    )
    for n, chunks in enumerate(steps):
        want, bf16, got = (
            m.forward(ForwardBatch.build(chunks, DEV), pool).float()
            for m, pool in zip(models, pools, strict=True)
        )
        assert (got - want).abs().max() <= 1.5 * (bf16 - want).abs().max() + 1e-3, n
    # The first GDN layer's tails are copies of rows computed by reference kernels alike.
    assert torch.equal(pools[2].conv[0][:2], pools[1].conv[0][:2])


@pytest.mark.parametrize("num_q,num_k,hd,block", [(4, 2, 64, 8), (8, 2, 32, 3)])
def test_qk_norm_rope_in_place_equals_the_reference(num_q, num_k, hd, block):
    """A drafted block's q and k heads normed and rotated in place in the fused projection
    (positions past 2**15 included: the angle's fp32 product), against the reference; the v
    heads untouched."""
    n = 3
    qkv = rand(n * block, (num_q + 2 * num_k) * hd, seed=11)
    weight = rand(num_q + num_k, hd, seed=12, dtype=torch.float32) * 0.2 + 1
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device=DEV).float() / hd))
    starts = torch.tensor([1, 700, 40_000], device=DEV)
    want_q, want_k = pointwise.qk_norm_rope(
        qkv, num_q, num_k, weight, inv_freq, starts, block, 1e-6
    )
    v_before = qkv[:, (num_q + num_k) * hd :].clone()
    got_q, got_k = gpu_fused.qk_norm_rope(qkv, num_q, num_k, weight, inv_freq, starts, block, 1e-6)
    # Three roundings, each toward zero under the interpreter (values up to ~4: ulp 1.6e-2).
    tol = 1.6e-2 if EXACT else 3e-2
    close(got_q, want_q, tol)
    close(got_k, want_k, tol)
    assert got_q.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(qkv[:, (num_q + num_k) * hd :], v_before)


@pytest.mark.parametrize(
    "nh,nkv,hd,block,causal,window",
    [(4, 2, 64, 8, False, 0), (4, 1, 32, 5, True, 0), (2, 2, 64, 4, False, 6)],
)
def test_block_attention_equals_the_reference(nh, nkv, hd, block, causal, window):
    """The drafter's block attention read from the ring by slot (Triton) against the reference
    (gather, mask, SDPA): streams whose context is empty, short, fills the ring, and has
    wrapped it; rows at or past a block's start and empty rows holding NaN are never read."""
    from headstart.ops.attention import triton as gpu_attention
    from headstart.ops.attention.reference import attend_block

    # bf16 on a GPU; fp32 under the interpreter, whose tl.dot misreads bf16 operands.
    dt = BF if EXACT else torch.float32
    R, slots_n = 96, 5
    ring_k = rand(slots_n, nkv, R, hd, seed=21, dtype=dt)
    ring_v = rand(slots_n, nkv, R, hd, seed=22, dtype=dt)
    ring_pos = torch.full((slots_n, R), -1, dtype=torch.int64, device=DEV)
    # slot 0: empty; 1: 7 rows; 2: 96 rows (full, not wrapped); 3: wrapped (positions 50..249);
    # 4: 10 rows, then rows at and past the block's start (stale: must not be seen).
    ring_pos[1, :7] = torch.arange(7)
    ring_pos[2] = torch.arange(R)
    wrapped = torch.arange(250 - R, 250)
    ring_pos[3, wrapped % R] = wrapped.to(DEV)
    ring_pos[4, :14] = torch.arange(14)
    ring_pos[4, 3] = 10 + R  # a row that wrapped past the block's start (within its rows)
    ring_v[0] = float("nan")  # empty rows may hold anything
    ring_v[1, :, 7:] = float("nan")
    slots = torch.tensor([1, 3, 2, 0, 4], device=DEV)
    starts = torch.tensor([7, 250, 96, 1, 10], device=DEV)
    n = slots.shape[0]
    q = rand(n, block, nh, hd, seed=23, dtype=dt)
    bk, bv = rand(n, block, nkv, hd, seed=24, dtype=dt), rand(n, block, nkv, hd, seed=25, dtype=dt)
    args = (q, bk, bv, ring_k, ring_v, ring_pos, slots, starts, causal, window)
    want = attend_block(*(a.float() if a.is_floating_point() else a for a in args[:6]), *args[6:])
    got = gpu_attention.block_attention(*args)
    assert got.dtype == q.dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_drafter_proposal_with_the_kernels_matches_the_reference(tmp_path, causal):
    """A DFlash proposal whose norms, q/k RoPE and block attention run the Triton kernels
    (``drafter_ops`` on a GPU) against the reference ops, for streams whose context is short,
    fills the ring, and has wrapped it. On a GPU the kernels' logit error against an fp32
    reference is held to 1.5x that of the reference ops in bf16; under the interpreter
    (fp32 only) the two agree within 1e-3."""
    import tiny

    from headstart.engine.spec.drafter import REFERENCE_OPS, DFlashDrafter, DrafterOps
    from headstart.models.qwen35.model import Qwen35Model
    from headstart.ops.attention.triton import block_attention

    target_cfg = tiny.causal_lm(seed=7, linear_value_head_dim=16)
    ckpt = tiny.save_text_only(target_cfg, tmp_path / "ckpt")
    dfile = tiny.save_drafter(tmp_path / "d", target_cfg.config, block=6, causal=causal)
    kernels = DrafterOps(gpu_fused.add_rms_norm, gpu_fused.qk_norm_rope, block_attention)
    dtypes = (torch.float32, BF) if EXACT else (torch.float32,)
    contexts = {0: 5, 1: 45, 2: 32}  # slot: rows of context; the ring holds 32
    feats = torch.randn(max(contexts.values()), 2 * 64, generator=torch.Generator().manual_seed(8))
    logits = []
    for dt in dtypes:
        target = Qwen35Model.load(ckpt, dtype=dt, device=DEV, kernels=REFERENCE)
        drafter = DFlashDrafter.load(dfile, target)
        ring = drafter.new_pool(4, 32)
        assert feats.shape[1] == len(drafter.cfg.target_layer_ids) * target.cfg.hidden_size
        for slot, rows in contexts.items():
            drafter.add_context(ring, slot, feats[:rows].to(DEV, dt), 0)
        t = lambda v: torch.tensor(v, device=DEV)  # noqa: E731
        args = (ring, t(list(contexts)), t([5, 9, 11]), t(list(contexts.values())), 6)
        for ops in (REFERENCE_OPS, kernels) if dt is BF or not EXACT else (REFERENCE_OPS,):
            drafter.ops = ops
            logits.append(drafter.propose_from(*args).float())
    if EXACT:
        want, bf16, got = logits
        assert (got - want).abs().max() <= 1.5 * (bf16 - want).abs().max() + 1e-3
    else:
        want, got = logits
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
