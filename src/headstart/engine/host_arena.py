"""Host memory for the prompt cache's host tier, allocated once and handed out in blocks.

Why not a tensor per snapshot: on CUDA the host tier's memory is pinned (page-locked) so that
restores copy at the bus's speed, and pinning is slow and serialises with the engine's own CUDA
calls. Allocated per demoted snapshot (hundreds of MB at the 27B shape), it stalled every step
that ran beside a demotion: BENCHMARKS.md records a burst of 16 new prompts taking 2.9 s instead
of 0.1 s with the host tier on. So the tier's whole budget is allocated at start-up and each
demotion reserves a block of it, as SGLang's and vLLM's host KV pools do.

Contract:

* :class:`ByteRanges` is the bookkeeping: first-fit reservations of byte ranges in ``[0, size)``,
  freed ranges merged with their free neighbours. No torch here.
* :class:`HostArena` owns the memory: ``regions`` of host memory summing to at most
  ``budget_bytes``. Pinned (``pin``), their sizes are powers of two, at least
  :data:`MIN_REGION` (torch's pinned allocator rounds every allocation up to a power of two, so
  other sizes would pin more than the budget); unpinned, one region of the whole budget.
  :meth:`reserve` gives a :class:`HostBlock` (None when no region has that many contiguous free
  bytes; the caller frees blocks and retries), :meth:`tensor` the block's bytes,
  :meth:`release` takes it back. One thread uses an arena (the engine's); a block handed to
  another thread (a copy in flight) must not be released until that thread is done with it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "ByteRanges", "HostArena", "HostBlock", "aligned", "region_sizes"]

ALIGN = 256  # bytes: every block and every tensor packed into one starts on this boundary
MIN_REGION = 1 << 20  # the smallest pinned region the budget is split into (the rest unused)


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


class ByteRanges:
    """First-fit reservations in ``[0, size)``: ``reserve`` gives the lowest offset with
    ``nbytes`` contiguous free bytes (None if there is none), ``release`` frees a range
    reserved before (merged with free neighbours)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts = [0] if size > 0 else []  # free ranges, sorted by start, disjoint
        self._ends = [size] if size > 0 else []
        self._reserved: dict[int, int] = {}  # offset -> nbytes

    @property
    def free_bytes(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    @property
    def largest_free(self) -> int:
        return max((e - s for s, e in zip(self._starts, self._ends, strict=True)), default=0)

    def reserve(self, nbytes: int) -> int | None:
        if nbytes <= 0:
            raise ValueError(f"reserve needs a positive size, got {nbytes}")
        for i, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
            if end - start >= nbytes:
                if end - start == nbytes:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = start + nbytes
                self._reserved[start] = nbytes
                return start
        return None

    def release(self, offset: int) -> None:
        nbytes = self._reserved.pop(offset)  # KeyError: not reserved (a double release)
        start, end = offset, offset + nbytes
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._ends[i - 1] == start:  # merge with the free range before
            i -= 1
            start = self._starts[i]
            del self._starts[i], self._ends[i]
        if i < len(self._starts) and self._starts[i] == end:  # and with the one after
            end = self._ends[i]
            del self._starts[i], self._ends[i]
        self._starts.insert(i, start)
        self._ends.insert(i, end)


def region_sizes(budget_bytes: int, pin: bool) -> list[int]:
    """The sizes of the regions a :class:`HostArena` of ``budget_bytes`` allocates: pinned,
    the budget's largest powers of two down to :data:`MIN_REGION`; else the budget whole."""
    left = max(0, budget_bytes)
    if not pin:
        return [left] if left else []
    sizes = []
    while left >= MIN_REGION:
        size = 1 << (left.bit_length() - 1)  # the largest power of two that fits
        sizes.append(size)
        left -= size
    return sizes


@dataclass(frozen=True)
class HostBlock:
    """``nbytes`` bytes at ``offset`` in region ``region`` of a :class:`HostArena`."""

    region: int
    offset: int
    nbytes: int


class HostArena:
    """The host tier's memory (see the module docstring)."""

    def __init__(self, budget_bytes: int, pin: bool) -> None:
        sizes = region_sizes(budget_bytes, pin)
        self.pinned = pin
        self.regions = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in sizes]
        self._ranges = [ByteRanges(n) for n in sizes]

    @property
    def capacity(self) -> int:
        return sum(r.size for r in self._ranges)

    @property
    def largest_region(self) -> int:
        return max((r.size for r in self._ranges), default=0)

    @property
    def free_bytes(self) -> int:
        return sum(r.free_bytes for r in self._ranges)

    def reserve(self, nbytes: int) -> HostBlock | None:
        """A block of at least ``nbytes`` (rounded up to :data:`ALIGN`), from the smallest
        region that has room (large regions stay whole for large snapshots); None if none has."""
        size = aligned(nbytes)
        for i in sorted(range(len(self._ranges)), key=lambda i: self._ranges[i].size):
            offset = self._ranges[i].reserve(size) if self._ranges[i].largest_free >= size else None
            if offset is not None:
                return HostBlock(i, offset, size)
        return None

    def release(self, block: HostBlock) -> None:
        self._ranges[block.region].release(block.offset)

    def tensor(self, block: HostBlock) -> torch.Tensor:
        """The block's bytes, a uint8 view of its region."""
        return self.regions[block.region][block.offset : block.offset + block.nbytes]
