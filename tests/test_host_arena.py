"""The host tier's arena: byte-range bookkeeping against a brute-force model, the pinned
regions' sizes, snapshots packed into blocks, and a host tier under a tight budget that reuses
its blocks without leaking any."""

from __future__ import annotations

import random

import pytest
import torch

from headstart.engine.host_arena import (
    ALIGN,
    MIN_REGION,
    ByteRanges,
    HostArena,
    aligned,
    region_sizes,
)
from headstart.engine.prompt_cache import Snapshot


@pytest.mark.parametrize("seed", range(6))
def test_byte_ranges_match_a_brute_force_model(seed):
    """First fit over a bitmap: the same offsets, never overlapping, merged when freed."""
    rng = random.Random(seed)
    size = rng.choice([64, 257, 1000])
    ranges = ByteRanges(size)
    used = [False] * size
    held: dict[int, int] = {}
    for _ in range(400):
        if held and rng.random() < 0.45:
            offset = rng.choice(list(held))
            ranges.release(offset)
            for i in range(offset, offset + held.pop(offset)):
                used[i] = False
            continue
        n = rng.randint(1, size // 3)
        want = next(
            (o for o in range(size - n + 1) if not any(used[o : o + n])), None
        )  # the lowest offset with n free bytes
        got = ranges.reserve(n)
        assert got == want
        if got is not None:
            held[got] = n
            for i in range(got, got + n):
                used[i] = True
        assert ranges.free_bytes == used.count(False)
    for offset in list(held):
        ranges.release(offset)
    assert ranges.free_bytes == ranges.largest_free == size  # merged back into one range
    with pytest.raises(KeyError):
        ranges.release(0 if 0 not in held else size)  # nothing reserved there


def test_region_sizes():
    mib = 1 << 20
    assert region_sizes(49152 * mib, pin=True) == [32768 * mib, 16384 * mib]
    assert region_sizes(2000 * mib, pin=True) == [n * mib for n in (1024, 512, 256, 128, 64, 16)]
    assert sum(region_sizes(3 * mib + 5, pin=True)) == 3 * mib  # the rest is left unused
    assert region_sizes(MIN_REGION - 1, pin=True) == []
    assert region_sizes(3 * mib + 5, pin=False) == [3 * mib + 5]  # unpinned: no rounding
    assert region_sizes(0, pin=False) == []


def test_reserve_prefers_small_regions_and_aligns():
    arena = HostArena(3 * MIN_REGION, pin=False)
    block = arena.reserve(10)
    assert block is not None and block.nbytes == ALIGN and block.offset % ALIGN == 0
    assert arena.tensor(block).numel() == ALIGN
    assert arena.free_bytes == 3 * MIN_REGION - ALIGN
    assert arena.reserve(3 * MIN_REGION) is None  # larger than what is free
    arena.release(block)
    assert arena.free_bytes == arena.capacity


def snapshot(seed: int, length: int) -> Snapshot:
    g = torch.Generator().manual_seed(seed)
    state = {
        "recurrent": torch.randn(3, 5, generator=g),  # 60 bytes: the next tensor is realigned
        "keys": torch.randn(length, 7, generator=g).to(torch.bfloat16),
        "step": torch.arange(3, dtype=torch.int64),
    }
    return Snapshot(length, state, torch.randn(11, generator=g), torch.randn(2, 3, generator=g))


def test_a_snapshot_packed_into_a_block_equals_its_source():
    src = snapshot(0, 9)
    assert src.host_bytes() == sum(aligned(t.numel() * t.element_size()) for t in src._tensors())
    buf = torch.full((src.host_bytes(),), 255, dtype=torch.uint8)
    host = src.to_host(into=buf)
    assert host.fingerprint() == src.fingerprint()
    ptrs = [t.data_ptr() for t in host._tensors()]
    assert all(buf.data_ptr() <= p < buf.data_ptr() + buf.numel() for p in ptrs)
    assert all((p - buf.data_ptr()) % ALIGN == 0 for p in ptrs)
    with pytest.raises(ValueError, match="host buffer"):
        src.to_host(into=buf[:-1])
