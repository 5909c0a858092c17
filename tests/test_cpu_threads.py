"""`headstart serve` sizes torch's CPU threads: every core but one (the HTTP loop's), at least
one, and every core for the decode steps of a model of large weights; --threads overrides; GPU
devices and tensor parallelism keep their own sizing."""

from __future__ import annotations

import argparse

import pytest
import torch

from headstart.engine.config import ThreadConfig
from headstart.errors import HeadstartError
from headstart.server import serve


def test_cpu_threads_leave_one_core_and_keep_at_least_one():
    assert [serve.cpu_threads(n) for n in (1, 2, 4, 16)] == [1, 1, 3, 15]
    assert serve.usable_cores() >= 1


@pytest.fixture
def threads_kept():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"device": "cpu", "tensor_parallel": 1, "threads": None, **kw})


def test_size_threads_on_cpu_default_and_override(threads_kept, monkeypatch):
    monkeypatch.setattr(serve, "usable_cores", lambda: 4)
    serve._size_threads(_args())
    assert torch.get_num_threads() == 3
    serve._size_threads(_args(threads=2))
    assert torch.get_num_threads() == 2


def test_size_threads_leaves_gpu_and_tensor_parallel_alone(threads_kept):
    torch.set_num_threads(2)
    serve._size_threads(_args(device="cuda:0", threads=1))
    serve._size_threads(_args(tensor_parallel=2, threads=1))
    assert torch.get_num_threads() == 2


def _flags(**changed) -> argparse.Namespace:
    """serve's flags that ``_check_args`` reads, at their defaults but for ``changed``."""
    flags = dict(
        port=8888,
        max_body_mib=8.0,
        body_timeout=30.0,
        tensor_parallel=1,
        header_timeout=10.0,
        keep_alive_timeout=5.0,
        shutdown_timeout=10.0,
    )
    return argparse.Namespace(**{**flags, **changed})


def test_threads_below_one_is_refused():
    with pytest.raises(HeadstartError, match="--threads must be >= 1"):
        serve._check_args(_flags(threads=0))


@pytest.mark.parametrize("ms", [0.0, -1.0, float("nan"), 2000.0])
def test_switch_interval_out_of_range_is_refused(ms):
    with pytest.raises(HeadstartError, match="--switch-interval-ms must be in"):
        serve._check_args(_flags(switch_interval_ms=ms))
    serve._check_args(_flags(switch_interval_ms=0.5))


def test_size_threads_returns_the_steps_thread_counts(threads_kept, monkeypatch):
    monkeypatch.setattr(serve, "usable_cores", lambda: 4)
    assert serve._size_threads(_args()) == ThreadConfig(decode=3, prefill=4)
    assert serve._size_threads(_args(threads=2, threads_batch=3)) == ThreadConfig(2, 3)
    assert serve._size_threads(_args(device="cuda:0")) is None


def test_a_model_of_large_weights_decodes_on_every_core():
    small = ThreadConfig(decode=3, prefill=4)
    big = serve.WIDE_DECODE_BYTES
    assert serve.decode_threads(small, big, None) == ThreadConfig(decode=4, prefill=4)
    # the embedded default's case: only steps past the 4-bit kernel's rows on every core
    wide = ThreadConfig(decode=3, prefill=4, wide_rows=serve.WIDE_DECODE_ROWS)
    assert serve.decode_threads(small, big - 1, None) == wide
    assert serve.decode_threads(small, big, 3) == small  # --threads was given
    assert serve.decode_threads(ThreadConfig(2, 1), big, None) == ThreadConfig(2, 1)


def _counting_engine(engines, threads, slots):
    """A started engine with ``threads`` and ``slots`` slots, and the (rows, threads) of
    each forward it runs, its warm-up's included."""
    from headstart.engine.config import EngineConfig
    from headstart.loading import load

    loaded = load()
    model = loaded.model
    seen: list[tuple[int, int]] = []
    forward_ex = model.forward_ex

    def counting(batch, pool, *a, **kw):
        seen.append((int(batch.input_ids.shape[0]), torch.get_num_threads()))
        return forward_ex(batch, pool, *a, **kw)

    model.forward_ex = counting
    config = EngineConfig(slots, 128, threads=threads)
    return engines(model, loaded.tokenizer, loaded.eos_token_ids, config), seen


def _threads_seen(engines, threads, prompts):
    """(rows, threads) of each forward of an engine with ``threads`` serving ``prompts`` at
    once, after its warm-up."""
    from engine_helpers import Collector

    from headstart.engine.engine import EngineRequest, Finish
    from headstart.sampling import SamplingParams

    engine, seen = _counting_engine(engines, threads, len(prompts))
    c0 = Collector()
    engine.submit(EngineRequest("w", [5, 6], SamplingParams(max_tokens=1), 1, c0))
    assert c0.done.wait(60)
    seen.clear()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    collectors = [Collector() for _ in prompts]
    for i, (p, c) in enumerate(zip(prompts, collectors, strict=True)):
        engine.submit(EngineRequest(f"r{i}", p, params, 4, c))
    for c in collectors:
        assert c.done.wait(60) and isinstance(c.events[-1], Finish)
    return seen


def test_decode_steps_of_wide_rows_run_with_the_batch_threads(threads_kept, engines):
    """With ``wide_rows``, decode steps of at least that many rows take the prefill count,
    narrower ones the decode count."""
    threads = ThreadConfig(decode=1, prefill=2, wide_rows=2)
    seen = _threads_seen(engines, threads, [list(range(5, 25)), list(range(7, 30))])
    decode = [s for s in seen if s[0] <= 2]
    assert (2, 2) in decode and all(t == (2 if rows == 2 else 1) for rows, t in decode), seen


def test_prompt_steps_run_with_the_batch_threads_and_decode_steps_without(threads_kept, engines):
    """The engine thread's forwards see ``prefill`` threads in the steps that run prompt rows
    and ``decode`` threads in decode-only steps (the count is per calling thread in OpenMP,
    so it is read inside the forward, on the engine thread)."""
    from engine_helpers import Collector

    from headstart.engine.engine import EngineRequest, Finish
    from headstart.sampling import SamplingParams

    engine, seen = _counting_engine(engines, ThreadConfig(decode=1, prefill=2), 2)
    c0 = Collector()  # the engine thread warmed its prompt steps before this first request
    engine.submit(EngineRequest("w", [5, 6], SamplingParams(max_tokens=1), 1, c0))
    assert c0.done.wait(60)
    assert seen[:2] == [(16, 2), (127, 2)], seen
    seen.clear()
    c = Collector()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.submit(EngineRequest("t", list(range(5, 25)), params, 4, c))
    assert c.done.wait(60) and isinstance(c.events[-1], Finish)
    assert seen[0] == (20, 2)  # the prompt
    assert seen[1:] and all(s == (1, 1) for s in seen[1:])  # its decode steps
