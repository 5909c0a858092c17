"""The CPU kernel set's prefill attention (PyTorch's SDPA) against the reference, on fresh
random inputs: new prompts, continued spans over a history, several packed prompts, padded
prompts; and which set ``select_kernels`` picks."""

from __future__ import annotations

import pytest
import torch

from headstart.kernels import REFERENCE, cpu_kernels, select_kernels

CPU = cpu_kernels()


@pytest.mark.parametrize(
    "T,start,nh,nkv,hd",
    [
        (1, 0, 4, 2, 64),
        (37, 0, 4, 2, 64),
        (300, 0, 8, 1, 32),
        (64, 500, 4, 2, 64),
        (5, 77, 6, 3, 16),
    ],
)
def test_span_matches_the_reference(T, start, nh, nkv, hd):
    g = torch.Generator().manual_seed(T * 1000 + start)
    q = torch.randn(T, nh, hd, generator=g)
    k, v = (torch.randn(nkv, start + T, hd, generator=g) for _ in range(2))
    want = REFERENCE.attn_span(q, k, v, start)
    got = CPU.attn_span(q, k, v, start)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fresh_spans_and_padded_match_the_reference():
    g = torch.Generator().manual_seed(7)
    lengths = [3, 40, 1, 17]
    F, nh, nkv, hd = sum(lengths), 4, 2, 32
    q = torch.randn(F, nh, hd, generator=g)
    k, v = (torch.randn(F, nkv, hd, generator=g) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    want = REFERENCE.attn_fresh_spans(q, k, v, cu, cu)
    torch.testing.assert_close(CPU.attn_fresh_spans(q, k, v, cu, cu), want, rtol=1e-5, atol=1e-5)
    qp = torch.randn(3, 20, nh, hd, generator=g)
    kp, vp = (torch.randn(3, 20, nkv, hd, generator=g) for _ in range(2))
    torch.testing.assert_close(
        CPU.attn_padded(qp, kp, vp), REFERENCE.attn_padded(qp, kp, vp), rtol=1e-5, atol=1e-5
    )


def test_selection():
    assert select_kernels("cpu").name == "cpu"
    assert select_kernels("cpu", "reference").name == "reference"
    assert select_kernels("cpu", "cpu").name == "cpu"


@pytest.mark.parametrize("T,C", [(1, 768), (2, 64), (3, 40), (4, 7), (300, 768), (1000, 96)])
def test_the_span_convolution_equals_the_reference(T, C):
    """The CPU set's GDN convolution of a span (a C kernel) against the reference, on fresh
    random rows, tails and weights: the output and the new tail, chunks shorter than the tail
    included, rows taken as a strided view (as the model hands them over)."""
    from headstart.ops.conv import cpu as cpu_conv
    from headstart.ops.conv.reference import causal_conv

    gen = torch.Generator().manual_seed(T * 1000 + C)
    wide = torch.randn(T, C + 5, generator=gen)
    x = wide[:, 2 : 2 + C]  # not contiguous
    tail, weight = torch.randn(C, 3, generator=gen), torch.randn(C, 4, generator=gen)
    want_y, want_tail = causal_conv(x, tail, weight)
    y, new_tail = CPU.conv_span(x, tail, weight)
    assert CPU.conv_span is cpu_conv.causal_conv and cpu_conv.available()
    torch.testing.assert_close(y, want_y, rtol=1e-6, atol=1e-6)
    assert torch.equal(new_tail, want_tail)


def test_kernels_first_used_after_start_up_are_logged(monkeypatch, caplog):
    """After start-up, Triton's cache-miss hook logs each new kernel specialization (a shape
    the warm-up missed), the first ``limit`` of them, and lets Triton compile it as usual;
    autotuning passes print from then on."""
    import logging

    triton = pytest.importorskip("triton")
    from headstart.ops.triton_support import report_late_compiles

    runtime = triton.knobs.runtime
    monkeypatch.setattr(runtime, "jit_cache_hook", None)
    monkeypatch.setattr(triton.knobs.autotuning, "print", False)
    report_late_compiles(logging.getLogger("headstart.test"), limit=2)
    hook = runtime.jit_cache_hook
    assert hook is not None
    assert triton.knobs.autotuning.print  # late autotuning passes print Triton's lines
    fn = type("Info", (), {"name": "_kernel"})()
    with caplog.at_level(logging.WARNING, logger="headstart.test"):
        for i in range(3):  # the keywords JITFunction._call_hook passes (Triton 3.6)
            skip = hook(
                key=i,
                repr="_kernel[num_warps=4](x: *bf16)",
                fn=fn,
                compile={
                    "signature": {"x": "*bf16", "n": "i32", "W": "constexpr"},
                    "constants": {(2,): i},
                    "configs": [{(0,): [["tt.divisibility", 16]], (1,): [["tt.equal_to", 1]]}],
                    "num_warps": 4,
                    "num_stages": 3,
                },
                is_manual_warmup=False,
                already_compiled=False,
            )
            assert not skip  # a true result would make Triton skip the compile
    lines = [r.getMessage() for r in caplog.records]
    first = "kernel first used after start-up (not warmed): _kernel[warps=4, stages=3](W={}, "
    attrs = "x:[['tt.divisibility', 16]], n:[['tt.equal_to', 1]])"
    assert lines == [
        first.format(0) + attrs,
        first.format(1) + attrs,
        "further kernels first used after start-up are not logged",
    ]
