"""Nemotron-H's Mamba2 mixer core (ops/ssd/reference.py): the forms against each other, against
direct formulas, and composed into the mixer against transformers' NemotronHMamba2Mixer."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from headstart.ops.ssd.reference import (
    NO_LIMIT,
    causal_conv_bias,
    causal_conv_bias_step,
    gated_group_rms_norm,
    mamba_dt,
    split_projection,
    split_xbc,
    ssd_chunked,
    ssd_recurrent,
    ssd_step,
)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    """Max error within ``tol`` of b's largest magnitude (relative, but not blown up by the
    entries that happen to sit near zero)."""
    return bool((a - b).abs().max() <= tol * b.abs().max().clamp(min=1.0))


def ssd_inputs(T, H, P, G, N, seed, lead=None):
    """Random scan inputs; ``lead`` replaces T's axis (n streams for the step form)."""
    g = torch.Generator().manual_seed(seed)
    rows = lead if lead is not None else T
    x = torch.randn(rows, H, P, generator=g)
    dt = F.softplus(torch.randn(rows, H, generator=g) - 1)  # what mamba_dt yields: positive
    A = -torch.exp(torch.randn(H, generator=g) * 0.5)
    B = torch.randn(rows, G, N, generator=g) / math.sqrt(N)
    C = torch.randn(rows, G, N, generator=g) / math.sqrt(N)
    D = torch.randn(H, generator=g)
    state_shape = (H, P, N) if lead is None else (lead, H, P, N)
    state = torch.randn(*state_shape, generator=g)
    return x, dt, A, B, C, D, state


@pytest.mark.parametrize("T,chunk", [(1, 16), (5, 16), (16, 16), (37, 16), (70, 32)])
@pytest.mark.parametrize("H,G", [(4, 1), (4, 2), (4, 4)])
def test_chunked_equals_recurrent(T, chunk, H, G):
    """Chunk-parallel == step by step, from a nonzero state, with grouped B/C, for T below,
    at and past the chunk (padded tails must leave the final state alone)."""
    inputs = ssd_inputs(T, H, 6, G, 8, seed=T * 13 + G)
    y_ref, s_ref = ssd_recurrent(*inputs)
    y, s = ssd_chunked(*inputs, chunk=chunk)
    assert y.shape == (T, H, 6) and s.shape == (H, 6, 8)
    assert y.dtype == s.dtype == torch.float32
    assert close(y, y_ref)
    assert close(s, s_ref)


def test_recurrent_matches_direct_formula():
    """The recurrence written out per head in float64, heads reading group h // (H // G)."""
    x, dt, A, B, C, D, state = ssd_inputs(4, 4, 3, 2, 5, seed=7)
    y, s = ssd_recurrent(x, dt, A, B, C, D, state)
    for h in range(4):
        S = state[h].double()
        grp = h // 2
        for t in range(4):
            S = math.exp(dt[t, h].item() * A[h].item()) * S + dt[t, h].item() * torch.outer(
                x[t, h].double(), B[t, grp].double()
            )
            direct = S @ C[t, grp].double() + D[h].double() * x[t, h].double()
            assert torch.allclose(y[t, h].double(), direct, atol=1e-5)
        assert torch.allclose(s[h].double(), S, atol=1e-5)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_state_carries_across_calls(form):
    """Two calls carrying the state == one call (the split lands mid-chunk)."""
    scan = ssd_recurrent if form == "recurrent" else lambda *a: ssd_chunked(*a, chunk=8)
    x, dt, A, B, C, D, state = ssd_inputs(29, 4, 6, 2, 8, seed=3)
    y_whole, s_whole = scan(x, dt, A, B, C, D, state)
    y1, s1 = scan(x[:11], dt[:11], A, B[:11], C[:11], D, state)
    y2, s2 = scan(x[11:], dt[11:], A, B[11:], C[11:], D, s1)
    assert close(torch.cat([y1, y2]), y_whole)
    assert close(s2, s_whole)


def test_step_equals_recurrent_per_stream():
    """One row for n streams at once == each stream's one-row recurrence."""
    n = 5
    x, dt, A, B, C, D, states = ssd_inputs(1, 4, 6, 2, 8, seed=11, lead=n)
    y, s = ssd_step(x, dt, A, B, C, D, states)
    assert y.shape == (n, 4, 6) and s.shape == (n, 4, 6, 8)
    for i in range(n):
        y_ref, s_ref = ssd_recurrent(
            x[i : i + 1], dt[i : i + 1], A, B[i : i + 1], C[i : i + 1], D, states[i]
        )
        assert close(y[i], y_ref[0])
        assert close(s[i], s_ref)


def test_conv_bias_pieces_step_and_direct():
    """Pieces == whole; the step == a one-row call; a fresh stream == nn.Conv1d's padded conv
    (how the model runs it); one position by the formula silu(b + sum_j w_j x_{t-K+1+j})."""
    g = torch.Generator().manual_seed(5)
    Cn, K, T = 10, 4, 19
    x = torch.randn(T, Cn, generator=g)
    w = torch.randn(Cn, K, generator=g)
    b = torch.randn(Cn, generator=g)
    whole, whole_tail = causal_conv_bias(x, torch.zeros(Cn, K - 1), w, b)
    parts, tail = [], torch.zeros(Cn, K - 1)
    for lo, hi in ((0, 2), (2, 9), (9, T)):
        y, tail = causal_conv_bias(x[lo:hi], tail, w, b)
        parts.append(y)
    assert close(torch.cat(parts), whole)
    assert torch.equal(tail, whole_tail)
    assert torch.equal(whole_tail, x[-(K - 1) :].T)  # the tail is the last pre-conv rows

    padded = F.conv1d(x.T[None], w[:, None], b, padding=K - 1, groups=Cn)[0, :, :T]
    assert close(whole, F.silu(padded).T)
    direct = F.silu(b + (w * x[7 - (K - 1) : 8].T).sum(-1))
    assert close(whole[7], direct)

    tails = torch.randn(3, Cn, K - 1, generator=g)
    rows = torch.randn(3, Cn, generator=g)
    y, new_tails = causal_conv_bias_step(rows, tails, w, b)
    for i in range(3):
        y_ref, t_ref = causal_conv_bias(rows[i : i + 1], tails[i], w, b)
        assert close(y[i], y_ref[0])
        assert torch.equal(new_tails[i], t_ref)


def test_mamba_dt_softplus_and_limit():
    g = torch.Generator().manual_seed(2)
    raw = torch.randn(6, 4, generator=g) * 5
    bias = torch.tensor([-9.0, -1.0, 0.0, 3.0])
    assert torch.equal(mamba_dt(raw, bias), F.softplus(raw + bias))  # (0, inf): no clamp
    dt = mamba_dt(raw, bias, (1e-3, 0.5))
    assert dt.min() >= 1e-3 and dt.max() <= 0.5
    inside = (F.softplus(raw + bias) > 1e-3) & (F.softplus(raw + bias) < 0.5)
    assert torch.equal(dt[inside], F.softplus(raw + bias)[inside])


def test_gated_norm_matches_transformers_and_formula():
    """Gate first, then RMS over each contiguous group, then the weight: against HF's
    Zamba2RMSNormGated (what NemotronHMamba2Mixer.norm is) and a per-group formula."""
    from transformers.models.zamba2.modeling_zamba2 import Zamba2RMSNormGated

    g = torch.Generator().manual_seed(4)
    width, groups, eps = 24, 3, 1e-5
    y = torch.randn(5, width, generator=g)
    z = torch.randn(5, width, generator=g)
    w = 1 + 0.5 * torch.randn(width, generator=g)
    ours = gated_group_rms_norm(y, z, w, eps, groups)
    hf = Zamba2RMSNormGated(width, group_size=width // groups, eps=eps)
    with torch.no_grad():
        hf.weight.copy_(w)
        assert close(ours, hf(y, z))
    gated = y * F.silu(z)
    for k in range(groups):
        s = slice(k * 8, (k + 1) * 8)
        direct = gated[:, s] / torch.sqrt(gated[:, s].pow(2).mean(-1, keepdim=True) + eps)
        assert close(ours[:, s], direct * w[s])


# The mixer against transformers. Tiny: hidden 64, 4 heads of 16, state 8, 2 groups, kernel 4;
# HF's chunk_size 8 so its chunked path runs several (padded) chunks.
H, P, N, G, K, HIDDEN = 4, 16, 8, 2, 4, 64
CONV_DIM = H * P + 2 * G * N


def hf_mixer(seed: int, dt_bias: list[float]):
    """transformers' NemotronHMamba2Mixer in float32 with spread-out random weights (HF's
    initialisation makes D and the norm weight all ones and dt_bias all zeros)."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    config = NemotronHConfig(
        hidden_size=HIDDEN,
        mamba_num_heads=H,
        mamba_head_dim=P,
        ssm_state_size=N,
        n_groups=G,
        conv_kernel=K,
        chunk_size=8,
        layers_block_type=["mamba"],
    )
    mixer = NemotronHMamba2Mixer(config, layer_idx=0).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        mixer.in_proj.weight.copy_(torch.randn(mixer.in_proj.weight.shape, generator=g) / 8)
        mixer.conv1d.weight.copy_(torch.randn(mixer.conv1d.weight.shape, generator=g) * 0.5)
        mixer.conv1d.bias.copy_(torch.randn(CONV_DIM, generator=g) * 0.5)
        mixer.dt_bias.copy_(torch.tensor(dt_bias))
        mixer.A_log.copy_(torch.randn(H, generator=g) * 0.5)
        mixer.D.copy_(torch.randn(H, generator=g))
        mixer.norm.weight.copy_(1 + 0.5 * torch.randn(H * P, generator=g))
        mixer.out_proj.weight.copy_(torch.randn(mixer.out_proj.weight.shape, generator=g) / 8)
    return mixer


def mixer_core(mixer, u, tail, state, limit, chunk=16):
    """Our ops composed into the mixer for one sequence u [T, hidden], continuing from a conv
    tail [CONV_DIM, K-1] and an SSM state [H, P, N]. Returns (out, tail, state)."""
    z, xbc, dt_raw = split_projection(F.linear(u, mixer.in_proj.weight), H, P, G, N)
    xbc, tail = causal_conv_bias(xbc, tail, mixer.conv1d.weight[:, 0], mixer.conv1d.bias)
    x, B, C = split_xbc(xbc, H, P, G, N)
    dt = mamba_dt(dt_raw, mixer.dt_bias, limit)
    A = -torch.exp(mixer.A_log.float())
    y, state = ssd_chunked(x, dt, A, B, C, mixer.D, state, chunk=chunk)
    eps = mixer.norm.variance_epsilon
    normed = gated_group_rms_norm(y.reshape(len(u), H * P), z, mixer.norm.weight, eps, G)
    return F.linear(normed, mixer.out_proj.weight), tail, state


def fresh():
    return torch.zeros(CONV_DIM, K - 1), torch.zeros(H, P, N)


@torch.no_grad()
@pytest.mark.parametrize("T", [1, 7, 21])
def test_mixer_matches_transformers(T):
    """The composed ops == HF's torch forward over a whole sequence. Head 0's dt_bias is so
    negative that its dt falls under time_step_min, where HF's prefill clamps it: matching
    needs the limit HF uses, (time_step_min, inf), not the config's time_step_limit."""
    mixer = hf_mixer(seed=T, dt_bias=[-9.0, -1.0, 0.5, 2.0])
    u = torch.randn(1, T, HIDDEN, generator=torch.Generator().manual_seed(100 + T))
    expected = mixer(u)[0]
    limit = (mixer.config.time_step_min, math.inf)
    assert mixer.time_step_limit == limit  # what transformers 5.17 does; see mamba_dt
    out, _, _ = mixer_core(mixer, u[0], *fresh(), limit)
    assert (out - expected).abs().max() <= 1e-4 * expected.abs().max()
    # The clamp is really exercised: without it some dt sits below time_step_min.
    dt_raw = split_projection(F.linear(u[0], mixer.in_proj.weight), H, P, G, N)[2]
    assert (mamba_dt(dt_raw, mixer.dt_bias, NO_LIMIT) < limit[0]).any()


@torch.no_grad()
def test_mixer_prefill_in_pieces_equals_whole():
    """Prefill in two pieces carrying the conv tail and SSM state == one piece == HF's
    two-piece prefill through its cache."""
    from transformers import DynamicCache

    mixer = hf_mixer(seed=1, dt_bias=[-9.0, -1.0, 0.5, 2.0])
    u = torch.randn(1, 23, HIDDEN, generator=torch.Generator().manual_seed(9))
    limit = (mixer.config.time_step_min, math.inf)
    whole, whole_tail, whole_state = mixer_core(mixer, u[0], *fresh(), limit)
    a, tail, state = mixer_core(mixer, u[0, :10], *fresh(), limit)
    b, tail, state = mixer_core(mixer, u[0, 10:], tail, state, limit)
    assert close(torch.cat([a, b]), whole)
    assert torch.equal(tail, whole_tail)
    assert close(state, whole_state)

    cache = DynamicCache(config=mixer.config)
    hf = torch.cat(
        [mixer(u[:, :10], cache_params=cache), mixer(u[:, 10:], cache_params=cache)], dim=1
    )
    assert (torch.cat([a, b]) - hf.reshape(23, HIDDEN)).abs().max() <= 1e-4 * hf.abs().max()
    assert close(cache.layers[0].recurrent_states[0][0], state)


@torch.no_grad()
def test_mixer_decode_steps_match_transformers():
    """Prefill, then decode rows one at a time with the step forms (conv step, ssd_step), over
    n = 1: == HF's cached one-token path. dt_bias here keeps every dt above time_step_min,
    because HF's one-token path does not clamp (its prefill does)."""
    from transformers import DynamicCache

    mixer = hf_mixer(seed=2, dt_bias=[-2.0, -1.0, 0.5, 2.0])
    u = torch.randn(1, 14, HIDDEN, generator=torch.Generator().manual_seed(12))
    limit = (mixer.config.time_step_min, math.inf)
    cache = DynamicCache(config=mixer.config)
    mixer(u[:, :10], cache_params=cache)
    _, tail, state = mixer_core(mixer, u[0, :10], *fresh(), limit)
    tails, states = tail[None], state[None]
    A = -torch.exp(mixer.A_log.float())
    for t in range(10, 14):
        expected = mixer(u[:, t : t + 1], cache_params=cache)[0, 0]
        z, xbc, dt_raw = split_projection(
            F.linear(u[0, t : t + 1], mixer.in_proj.weight), H, P, G, N
        )
        xbc, tails = causal_conv_bias_step(xbc, tails, mixer.conv1d.weight[:, 0], mixer.conv1d.bias)
        x, B, C = split_xbc(xbc, H, P, G, N)
        dt = mamba_dt(dt_raw, mixer.dt_bias, limit)
        assert (dt > limit[0]).all()  # the clamp cannot matter (see the docstring)
        y, states = ssd_step(x, dt, A, B, C, mixer.D, states)
        eps = mixer.norm.variance_epsilon
        normed = gated_group_rms_norm(y.reshape(1, H * P), z, mixer.norm.weight, eps, G)
        out = F.linear(normed, mixer.out_proj.weight)[0]
        assert (out - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert close(cache.layers[0].recurrent_states[0], states)
