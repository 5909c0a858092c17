"""CUDA graphs of the decode forward, one per stream-count bucket; the only module that captures.

A decode step (one row per stream) has the same kernels every time for a given number of
streams, so it is captured once per bucket (1, 2, 4, 8, 16, ... up to the slot count) at load and
replayed afterwards: the launch overhead of a few hundred small kernels disappears. Inputs live
in static buffers; a step with fewer streams than its bucket pads with rows that point at a
scratch slot of the state pool (fresh, position 0), so they compute harmlessly and are dropped.
Prefill chunks and verify windows stay eager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from headstart.batch import DecodeRows, ForwardBatch
from headstart.model import ForwardOutput, Qwen35Model
from headstart.state import StatePool


def buckets_for(max_streams: int) -> list[int]:
    sizes, n = [], 1
    while n < max_streams:
        sizes.append(n)
        n *= 2
    return sizes + [max_streams]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    out: ForwardOutput


class DecodeGraphs:
    def __init__(self, model: Qwen35Model, pool: StatePool, max_streams: int, scratch_slot: int,
                 taps: Sequence[int] = ()) -> None:
        self.model, self.pool, self.taps = model, pool, tuple(taps)
        self.scratch = scratch_slot
        dev = model.device
        self.ids = torch.zeros(max_streams, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_streams, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_streams,), scratch_slot, dtype=torch.int64, device=dev)
        self.fresh = torch.ones(max_streams, dtype=torch.bool, device=dev)
        self.rows = torch.arange(max_streams, device=dev)
        self.graphs: dict[int, _Captured] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        for n in sorted(buckets_for(max_streams), reverse=True):  # largest first: shared pool
            self.graphs[n] = self._capture(n)

    def _batch(self, n: int) -> ForwardBatch:
        rows = self.rows[:n]
        return ForwardBatch(
            input_ids=self.ids[:n], positions=self.positions[:n], spans=(), logit_index=rows,
            decode=DecodeRows(rows=rows, slots=self.slots[:n], positions=self.positions[:n],
                              fresh=self.fresh[:n]),
            multi_row=(), multi=None)

    def _capture(self, n: int) -> _Captured:
        batch = self._batch(n)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: autotuning and lazy init happen outside capture
            for _ in range(2):
                self.model.forward_ex(batch, self.pool, self.taps)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self.model.forward_ex(batch, self.pool, self.taps)
        return _Captured(graph, out)

    def bucket(self, n: int) -> int | None:
        return min((b for b in self.graphs if b >= n), default=None)

    def run(self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int]
            ) -> ForwardOutput:
        """Replay the decode forward for ``n`` streams (``tokens[i]`` at ``positions[i]`` of
        ``slots[i]``); returns views of the static outputs, valid until the next replay."""
        n = len(tokens)
        b = self.bucket(n)
        assert b is not None, "more streams than captured"
        pad = b - n
        ids = torch.tensor(list(tokens) + [0] * pad, dtype=torch.int64)
        pos = torch.tensor(list(positions) + [0] * pad, dtype=torch.int64)
        sl = torch.tensor(list(slots) + [self.scratch] * pad, dtype=torch.int64)
        self.ids[:b].copy_(ids, non_blocking=True)
        self.positions[:b].copy_(pos, non_blocking=True)
        self.slots[:b].copy_(sl, non_blocking=True)
        self.fresh[:b].copy_(pos == 0, non_blocking=True)
        cap = self.graphs[b]
        cap.graph.replay()
        taps = cap.out.taps[:n] if cap.out.taps is not None else None
        return ForwardOutput(cap.out.logits[:n], taps, {})
