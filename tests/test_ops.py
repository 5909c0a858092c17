"""Reference ops against each other and against direct formulas, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from headstart.ops.attention.reference import attend
from headstart.ops.conv.reference import (
    causal_conv,
    causal_conv_padded,
    causal_conv_spans,
    conv_spans_plan,
)
from headstart.ops.gated_delta.reference import chunked_gated_delta, recurrent_gated_delta
from headstart.quant import dequantize, pack, quantize, unpack


def gdn_inputs(T, Hk, Hv, Dk, Dv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hk, Dk, generator=g)
    k = torch.randn(T, Hk, Dk, generator=g)
    v = torch.randn(T, Hv, Dv, generator=g)
    decay = -torch.rand(T, Hv, generator=g) * 2  # log decay <= 0
    beta = torch.rand(T, Hv, generator=g)
    state = torch.randn(Hv, Dk, Dv, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("T,chunk", [(1, 64), (5, 16), (64, 64), (100, 32), (130, 64)])
@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4), (1, 3)])
def test_chunked_equals_recurrent(T, chunk, Hk, Hv):
    inputs = gdn_inputs(T, Hk, Hv, 8, 12, seed=T * 31 + Hv)
    o_ref, s_ref = recurrent_gated_delta(*inputs)
    o, s = chunked_gated_delta(*inputs, chunk=chunk)
    assert (o - o_ref).abs().max() <= 1e-4
    assert (s - s_ref).abs().max() <= 1e-4


def test_recurrent_matches_closed_form():
    q, k, v, decay, beta, state = gdn_inputs(3, 1, 1, 4, 5, seed=0)
    o, s = recurrent_gated_delta(q, k, v, decay, beta, state)
    S = state[0].double()
    for t in range(3):
        kt = k[t, 0].double() / k[t, 0].double().norm()
        qt = q[t, 0].double() / q[t, 0].double().norm() / 2.0  # Dk^-0.5 with Dk = 4
        b = beta[t, 0].double()
        S = decay[t, 0].double().exp() * (
            torch.eye(4, dtype=torch.float64) - b * torch.outer(kt, kt)
        ) @ S + b * torch.outer(kt, v[t, 0].double())
        assert torch.allclose(o[t, 0].double(), S.T @ qt, atol=1e-5)
    assert torch.allclose(s[0].double(), S, atol=1e-5)


def test_causal_conv_in_pieces_equals_whole():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 6, generator=g)
    w = torch.randn(6, 4, generator=g)
    tail = torch.zeros(6, 3)
    whole, whole_tail = causal_conv(x, tail, w)
    parts, t = [], tail
    for a, b in ((0, 1), (1, 8), (8, 20)):
        y, t = causal_conv(x[a:b], t, w)
        parts.append(y)
    assert torch.allclose(torch.cat(parts), whole, atol=1e-6)
    assert torch.equal(t, whole_tail)
    # Direct formula at one position: y[t, c] = silu(sum_j w[c, j] * x[t - 3 + j, c]).
    direct = torch.nn.functional.silu((w[:, :] * x[5 - 3 : 6].T).sum(-1))
    assert torch.allclose(whole[5], direct, atol=1e-6)


@pytest.mark.parametrize("lengths", [[5, 1, 2, 9], [3], [1, 1]])
def test_causal_conv_spans_equals_each_span_alone(lengths):
    """Several spans (shorter and longer than the tail) in one pass, from zero and from
    nonzero tails: every row and every new tail as the one-span conv gives them."""
    g = torch.Generator().manual_seed(len(lengths) + sum(lengths))
    C, K = 7, 4
    x = torch.randn(sum(lengths), C, generator=g)
    w = torch.randn(C, K, generator=g)
    tails = torch.randn(len(lengths), C, K - 1, generator=g)
    tails[0] = 0.0  # a fresh stream
    got, got_tails = causal_conv_spans(x, tails, w, lambda: conv_spans_plan(lengths, K - 1))
    begin = 0
    for j, n in enumerate(lengths):
        want, want_tail = causal_conv(x[begin : begin + n], tails[j], w)
        assert torch.allclose(got[begin : begin + n], want, atol=1e-6)
        assert torch.equal(got_tails[j], want_tail)
        begin += n


def test_causal_conv_padded_equals_each_stream_alone():
    """Streams padded to one length (zero tails): each stream's rows and new tail as its own
    rows alone give them, lengths shorter than the tail included."""
    g = torch.Generator().manual_seed(4)
    lengths, L, C, K = [5, 1, 2, 8], 8, 6, 4
    x = torch.randn(len(lengths), L, C, generator=g)
    w = torch.randn(C, K, generator=g)
    y, tails = causal_conv_padded(x, torch.tensor(lengths), w)
    for j, n in enumerate(lengths):
        want, want_tail = causal_conv(x[j, :n], torch.zeros(C, K - 1), w)
        assert torch.allclose(y[j, :n], want, atol=1e-6)
        assert torch.equal(tails[j], want_tail)


@pytest.mark.parametrize("varlen", [False, True])
def test_sdpa_prefill_attention_equals_the_reference(monkeypatch, varlen):
    """The GPU set's prefill attention (PyTorch's fused SDPA kernels, no materialized masks
    where it can) run on the CPU against the reference, GQA: a new stream, a continued one
    (bottom-right causal), new streams packed by cu_seqlens (the mask fallback; varlen when
    this PyTorch runs it on the CPU) and new streams padded to one length."""
    from headstart.ops.attention import sdpa

    if not varlen:
        monkeypatch.setattr(sdpa, "_varlen", lambda: None)
    g = torch.Generator().manual_seed(3)
    nh, nkv, hd = 6, 2, 8
    for start, T in ((0, 7), (5, 4)):
        q = torch.randn(T, nh, hd, generator=g)
        k, v = torch.randn(2, nkv, start + T, hd, generator=g)
        assert torch.allclose(sdpa.attn_span(q, k, v, start), attend(q, k, v, start), atol=1e-5)
    lengths = [4, 1, 6]
    cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    q = torch.randn(11, nh, hd, generator=g)
    k, v = torch.randn(2, 11, nkv, hd, generator=g)
    try:
        got = sdpa.attn_fresh_spans(q, k, v, cu, cu)
    except (RuntimeError, NotImplementedError):  # varlen flash attention: CUDA only
        assert varlen
        pytest.skip("varlen_attn does not run on the CPU")
    begin = 0
    for n in lengths:
        rows = slice(begin, begin + n)
        want = attend(q[rows], k[rows].transpose(0, 1), v[rows].transpose(0, 1), 0)
        assert torch.allclose(got[rows], want, atol=1e-5)
        begin += n
    q = torch.randn(3, 5, nh, hd, generator=g)
    k, v = torch.randn(2, 3, 5, nkv, hd, generator=g)
    got = sdpa.attn_padded(q, k, v)
    for j in range(3):
        want = attend(q[j], k[j].transpose(0, 1), v[j].transpose(0, 1), 0)
        assert torch.allclose(got[j], want, atol=1e-5)


def test_attend_matches_dense_causal_softmax():
    g = torch.Generator().manual_seed(2)
    start, T, nh, nkv, hd = 5, 4, 6, 2, 8
    q = torch.randn(T, nh, hd, generator=g)
    k = torch.randn(nkv, start + T, hd, generator=g)
    v = torch.randn(nkv, start + T, hd, generator=g)
    out = attend(q, k, v, start)
    for h in range(nh):
        kv = h // (nh // nkv)
        for t in range(T):
            n = start + t + 1
            p = torch.softmax(q[t, h] @ k[kv, :n].T / hd**0.5, -1)
            assert torch.allclose(out[t, h], p @ v[kv, :n], atol=1e-5)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip_and_nibble_order(bits):
    codes = torch.randint(0, 2**bits, (3, 64), generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    assert packed.shape == (3, 64 * bits // 32)
    assert torch.equal(unpack(packed, bits), codes.to(torch.int32))
    if bits == 4:  # element i sits in word i // 8 at nibble i % 8, least significant first
        word = int(packed[0, 0]) & 0xFFFFFFFF
        assert [(word >> (4 * j)) & 0xF for j in range(8)] == codes[0, :8].tolist()


def test_quantize_dequantize_error_bounded():
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(3))
    qt = quantize(w, bits=4, group_size=64)
    err = (dequantize(qt.packed, qt.scales, qt.biases, 4, 64) - w).abs()
    step = qt.scales.float().repeat_interleave(64, dim=1)
    assert (err <= step * 0.51 + 1e-2).all()


def test_batched_step_equals_per_stream_recurrence():
    from headstart.ops.gated_delta.reference import gated_delta_step

    streams = [gdn_inputs(1, 2, 6, 8, 12, seed=s) for s in range(5)]
    o, s = gated_delta_step(
        *(
            torch.cat([x[i] for x in streams]) if i < 5 else torch.stack([x[5] for x in streams])
            for i in range(6)
        )
    )
    for n, inputs in enumerate(streams):
        o_ref, s_ref = recurrent_gated_delta(*inputs)
        assert torch.allclose(o[n], o_ref[0], atol=1e-5)
        assert torch.allclose(s[n], s_ref, atol=1e-5)


def test_conv_step_equals_conv():
    from headstart.ops.conv.reference import causal_conv_step

    g = torch.Generator().manual_seed(4)
    x, tails, w = (
        torch.randn(3, 6, generator=g),
        torch.randn(3, 6, 3, generator=g),
        torch.randn(6, 4, generator=g),
    )
    y, new = causal_conv_step(x, tails, w)
    for n in range(3):
        y_ref, t_ref = causal_conv(x[n : n + 1], tails[n], w)
        assert torch.allclose(y[n], y_ref[0], atol=1e-6) and torch.equal(new[n], t_ref)


def test_attend_decode_equals_attend():
    from headstart.ops.attention.reference import attend_decode

    g = torch.Generator().manual_seed(5)
    n, nh, nkv, hd, L = 4, 6, 2, 8, 9
    q = torch.randn(n, nh, hd, generator=g)
    k = torch.randn(n, nkv, L, hd, generator=g)
    v = torch.randn(n, nkv, L, hd, generator=g)
    lengths = torch.tensor([1, 9, 4, 6])
    out = attend_decode(q, k, v, lengths)
    for i in range(n):
        m = int(lengths[i])
        ref = attend(q[i : i + 1], k[i, :, :m], v[i, :, :m], m - 1)
        assert torch.allclose(out[i], ref[0], atol=1e-5)
