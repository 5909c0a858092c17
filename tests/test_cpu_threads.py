"""`headstart serve` sizes torch's CPU threads: every core but one (the HTTP loop's), at least
one; --threads overrides; GPU devices and tensor parallelism keep their own sizing."""

from __future__ import annotations

import argparse

import pytest
import torch

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


def test_threads_below_one_is_refused():
    args = argparse.Namespace(
        port=8888,
        max_body_mib=8.0,
        body_timeout=30.0,
        tensor_parallel=1,
        threads=0,
        header_timeout=10.0,
        keep_alive_timeout=5.0,
        shutdown_timeout=10.0,
    )
    with pytest.raises(HeadstartError, match="--threads must be >= 1"):
        serve._check_args(args)
