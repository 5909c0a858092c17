"""CUDA graphs of the forward; the only module that captures.

* :class:`DecodeGraphs`: a decode step (one row per stream) has the same kernels every time for a
  given number of streams, so it is captured once per bucket (1, 2, 4, 8, 16, ... up to the slot
  count) at load and replayed afterwards: the launch overhead of a few thousand small kernels
  disappears. Inputs live in static buffers; a step with fewer streams than its bucket pads with
  rows that point at a scratch slot of the state pool (fresh, position 0), so they compute
  harmlessly and are dropped.
* :class:`PromptGraphs`: new prompts, one or several streams per replay, each padded to a
  captured width (16, 32, ... tokens), the padding rows built to leave every stream's state as
  its last prompt row left it. Launched eagerly such a prefill costs hundreds of kernel
  launches per layer from Python, far more than its GPU work (figures: BENCHMARKS.md).

Also on by default (``GraphConfig(windows=False, continuations=False)`` turns them off),
each checked against eager replay on a GPU by ``tests/test_gpu_model.py``:

* :class:`WindowGraphs` (chain verify windows per stream bucket and width),
  :class:`DraftGraphs` (the drafter's proposal forward per stream bucket) and
  :class:`RollbackGraphs` (per kept length): a whole speculative round without eager launches.
* :class:`ContinuationGraphs`: prefill chunks of a stream past position 0, per length.

Tree windows and longer chunks stay eager. Every class takes ``capture=False`` to run the same
forward eagerly on the same static buffers, with the same slot bookkeeping: that is how the CPU
tests check everything here but the capture itself.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from headstart.batch import DecodeRows, ForwardBatch
from headstart.models.contract import CausalLM, ForwardOutput
from headstart.progress import progress
from headstart.state import StatePool

log = logging.getLogger("headstart.engine")


def buckets_for(max_streams: int) -> list[int]:
    sizes, n = [], 1
    while n < max_streams:
        sizes.append(n)
        n *= 2
    return sizes + [max_streams]


class _Replayable:
    """A forward over static buffers: captured in a CUDA graph, or (``capture=False``) run
    eagerly on each replay."""

    def __init__(
        self,
        fn: Callable[[], ForwardOutput],
        capture: bool,
        mempool: object | None,
        warmups: int = 2,
        launch: bool = True,
    ) -> None:
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: ForwardOutput | None = None
        # Seconds of the capture's warm-up runs, the capture itself and the first launch
        # (each to the GPU's end of it): what a start-up's graph phases are spent on.
        self.seconds = (0.0, 0.0, 0.0)
        if capture:
            started = time.perf_counter()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: autotuning and lazy init happen here
                for _ in range(warmups):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            warmed = time.perf_counter()
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (the server's, a test's) during a
            # capture must not invalidate it, only this thread's own.
            with torch.cuda.graph(self.graph, pool=mempool, capture_error_mode="thread_local"):
                self.out = fn()
            captured = time.perf_counter()
            # A graph's first launch uploads it to the device: the first request after start-up
            # spent 23 ms launching its prompt graph at 27B, later ones about 1 ms. Launch it
            # once now (``launch``), over the same static buffers its warm-up ran on (so
            # nothing new is written).
            if launch:
                self.graph.replay()
                torch.cuda.synchronize()
            self.seconds = (warmed - started, captured - warmed, time.perf_counter() - captured)

    def replay(self) -> ForwardOutput | None:
        if self.graph is None:
            # Like a graph, write into the same output tensors every time (so code that keeps
            # a view past the next replay fails here too).
            out = self.fn()
            if out is None:  # a graph with no outputs (a rollback)
                return None
            if self.out is None:
                self.out = ForwardOutput(
                    out.logits.clone(), None if out.taps is None else out.taps.clone(), {}
                )
            else:
                self.out.logits.copy_(out.logits)
                if out.taps is not None:
                    self.out.taps.copy_(out.taps)
            return ForwardOutput(self.out.logits, self.out.taps, out.records)
        self.graph.replay()
        return self.out  # None for a graph with no outputs (a rollback)


class Shard:
    """Of the shapes a start-up takes, in order, the every ``n``-th from the ``i``-th: those
    one of ``n`` compile-ahead processes warms and captures (server/compile_ahead.py).
    :meth:`mine` counts every shape it is asked about, so the shapes of all phases are dealt
    out in turn."""

    def __init__(self, i: int, n: int) -> None:
        if not 0 <= i < n:
            raise ValueError(f"shard {i} of {n}")
        self.i, self.n, self.seen = i, n, 0

    def mine(self) -> bool:
        self.seen += 1
        return (self.seen - 1) % self.n == self.i


# The shard of the start-up under way in this process (None: every shape); set by
# :func:`sharded` around a compile-ahead process's warm-up.
_SHARD: Shard | None = None


@contextlib.contextmanager
def sharded(shard: tuple[int, int] | None) -> Iterator[None]:
    """Within it, :func:`_capture_each` (and a runner's eager warm-up, through :func:`mine`)
    take only ``shard``'s shapes (None: all)."""
    global _SHARD
    before, _SHARD = _SHARD, None if shard is None else Shard(*shard)
    try:
        yield
    finally:
        _SHARD = before


def mine() -> bool:
    """Whether the next shape of the start-up is this process's to warm (always, unsharded)."""
    return _SHARD is None or _SHARD.mine()


def _capture_each(
    label: str,
    keys: Sequence[Any],
    forward: Callable[[Any], ForwardOutput],
    capture: bool,
    mempool: object | None,
    warmups: int = 2,
    rows: Callable[[Any], int] = lambda key: 0,
) -> dict[Any, _Replayable]:
    """One replayable ``forward(key)`` per key, in the given order (largest first, so a shared
    memory pool fits them all), with a progress bar on a terminal; under :func:`sharded`, the
    shard's keys only. Those of at most :data:`LAUNCHED_ROWS` ``rows`` are launched once at
    capture."""
    keys = [k for k in keys if mine()]
    graphs: dict[Any, _Replayable] = {}
    with progress(label, len(keys)) as tick:
        for key in keys:
            launch = rows(key) <= LAUNCHED_ROWS
            graphs[key] = _Replayable(
                lambda key=key: forward(key), capture, mempool, warmups, launch
            )
            tick()
    if capture and graphs:
        warm, held, launched = (sum(g.seconds[i] for g in graphs.values()) for i in range(3))
        log.info(
            "%s: %d captured; warm-up runs %.1fs, captures %.1fs, first launches %.1fs",
            label,
            len(graphs),
            warm,
            held,
            launched,
        )
    return graphs


# Graphs of at most this many rows are launched once right after capture, so that their first
# use does not pay the upload (about 20 ms at 27B, the work of a few short prompts). Wider ones
# compute for 100 ms and more at 27B, where the upload is a small share of the first use, and
# launching them all added about 6 s to a 27B start-up (BENCHMARKS.md).
LAUNCHED_ROWS = 512


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        pool: StatePool,
        max_streams: int,
        scratch_slot: int,
        taps: Sequence[int] = (),
        capture: bool = True,
    ) -> None:
        self.model, self.pool, self.taps = model, pool, tuple(taps)
        self.scratch = scratch_slot
        dev = model.device
        self.ids = torch.zeros(max_streams, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_streams, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_streams,), scratch_slot, dtype=torch.int64, device=dev)
        self.fresh = torch.ones(max_streams, dtype=torch.bool, device=dev)
        self.rows = torch.arange(max_streams, device=dev)
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        batches = {n: self._batch(n) for n in buckets_for(max_streams)}
        self.graphs = _capture_each(
            "decode graphs",
            sorted(batches, reverse=True),
            lambda n: model.forward_ex(batches[n], pool, self.taps),
            capture,
            self.mempool,
        )

    def _batch(self, n: int) -> ForwardBatch:
        rows = self.rows[:n]
        return ForwardBatch(
            input_ids=self.ids[:n],
            positions=self.positions[:n],
            spans=(),
            logit_index=rows,
            decode=DecodeRows(
                rows=rows, slots=self.slots[:n], positions=self.positions[:n], fresh=self.fresh[:n]
            ),
            multi_row=(),
            multi=None,
        )

    def bucket(self, n: int) -> int | None:
        return min((b for b in self.graphs if b >= n), default=None)

    def run(
        self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int]
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
        out = self.graphs[b].replay()
        taps = out.taps[:n] if out.taps is not None else None
        return ForwardOutput(out.logits[:n], taps, {})


def prompt_widths(max_tokens: int, smallest: int = 16) -> list[int]:
    """Padded prompt lengths: powers of two from ``smallest`` below ``max_tokens``, then it."""
    widths, w = [], smallest
    while w < max_tokens:
        widths.append(w)
        w *= 2
    return [*widths, max_tokens]


class PromptGraphs:
    """New prompts of up to ``max_tokens`` tokens, several streams in one replay: one graph per
    (stream bucket ``n``, width ``w``) with ``n * w <= max_rows``, each prompt padded to ``w``
    rows (``ForwardBatch.padded_of``: padding rows leave a stream's state as its last prompt row
    did), padding streams on the scratch slot. Slots are static tensors, so a replay writes
    every stream's own slot directly. Launched eagerly such a prefill costs a few milliseconds
    of Python and launches per layer, far more than its GPU work (BENCHMARKS.md).

    Shares the decode graphs' memory pool when given it: the two never replay at once."""

    def __init__(
        self,
        model: CausalLM,
        pool: StatePool,
        max_streams: int,
        max_tokens: int,
        max_rows: int,
        scratch_slot: int,
        taps: Sequence[int] = (),
        capture: bool = True,
        mempool: object | None = None,
    ) -> None:
        self.scratch = scratch_slot
        max_tokens = min(max_tokens, pool.max_tokens)
        dev = model.device
        self.widths = prompt_widths(max_tokens, min(16, max_tokens))
        shapes = [
            (n, w) for n in buckets_for(max_streams) for w in self.widths if n * w <= max_rows
        ]
        self.ids = torch.zeros(max(n * w for n, w in shapes), dtype=torch.int64, device=dev)
        self.slots = torch.full((max_streams,), scratch_slot, dtype=torch.int64, device=dev)
        self.lengths = torch.ones(max_streams, dtype=torch.int64, device=dev)
        if capture and mempool is None:
            mempool = torch.cuda.graph_pool_handle()

        def forward(shape: tuple[int, int]) -> ForwardOutput:
            n, w = shape
            batch = ForwardBatch.padded_of(self.ids[: n * w], self.slots[:n], self.lengths[:n], w)
            return model.forward_ex(batch, pool, tuple(taps))

        # One warm-up run each: the decode graphs and the engine's warm-up already initialised
        # everything lazy; the run compiles and tunes kernels for the shape.
        self.graphs = _capture_each(
            "prompt graphs",
            sorted(shapes, key=lambda s: -s[0] * s[1]),
            forward,
            capture,
            mempool,
            warmups=1,
            rows=lambda s: s[0] * s[1],
        )

    def shape_for(self, lengths: Sequence[int]) -> tuple[int, int] | None:
        """The smallest captured (streams, width) that holds prompts of ``lengths``."""
        need = max(lengths)
        fits = [s for s in self.graphs if s[0] >= len(lengths) and s[1] >= need]
        return min(fits, key=lambda s: (s[0] * s[1], s[0]), default=None)

    def groups(self, lengths: Sequence[int]) -> list[list[int]] | None:
        """Prompts (indices into ``lengths``) split into replays, longest first, each replay as
        many prompts as a captured shape of its longest one holds; None when one is too long."""
        order = sorted(range(len(lengths)), key=lambda j: -lengths[j])
        out: list[list[int]] = []
        while order:
            longest = lengths[order[0]]
            room = max((n for n, w in self.graphs if w >= longest), default=0)
            if not room:
                return None
            out.append(order[:room])
            order = order[room:]
        return out

    def run(self, prompts: Sequence[Sequence[int]], slots: Sequence[int]) -> ForwardOutput:
        """Prefill each of ``prompts`` as the first tokens of its slot (whatever it held): the
        last row's logits of each, and (with taps) every prompt row's taps, prompt after prompt.
        Fresh tensors, not views of the static outputs."""
        lengths = [len(p) for p in prompts]
        shape = self.shape_for(lengths)
        assert shape is not None, "no captured shape holds these prompts"
        n, w = shape
        pad = n - len(prompts)
        ids = [t for p in prompts for t in (*p, *(0,) * (w - len(p)))] + [0] * (pad * w)
        self.ids[: n * w].copy_(torch.tensor(ids, dtype=torch.int64), non_blocking=True)
        self.slots[:n].copy_(torch.tensor([*slots, *[self.scratch] * pad]), non_blocking=True)
        self.lengths[:n].copy_(torch.tensor(lengths + [1] * pad), non_blocking=True)
        out = self.graphs[n, w].replay()
        taps = None
        if out.taps is not None:
            rows = torch.cat([torch.arange(j * w, j * w + m) for j, m in enumerate(lengths)])
            taps = out.taps.index_select(0, rows.to(out.taps.device))
        return ForwardOutput(out.logits[: len(prompts)].clone(), taps, {})


class WindowGraphs:
    """Chain verify windows: one graph per (stream-count bucket, window width). The windows run
    as ``W`` batched one-row GDN steps and decode-style attention (``ForwardBatch.windows_of``),
    so slots and positions live in static tensors. Rows of padding streams point at the scratch
    slot (at position 1) and are dropped. The GDN records for rollback come back keyed by
    slot, as views of one set of window records (``model.new_window_records``) that every
    window graph writes; like every output they are valid until the next replay."""

    def __init__(
        self,
        model: CausalLM,
        pool: StatePool,
        max_streams: int,
        widths: Sequence[int],
        scratch_slot: int,
        taps: Sequence[int] = (),
        capture: bool = True,
        mempool: object | None = None,
    ) -> None:
        self.scratch = scratch_slot
        self.widths = sorted(set(widths))
        dev = model.device
        self.ids = torch.zeros(max_streams * max(self.widths), dtype=torch.int64, device=dev)
        self.slots = torch.full((max_streams,), scratch_slot, dtype=torch.int64, device=dev)
        self.starts = torch.ones(max_streams, dtype=torch.int64, device=dev)
        self.records = model.new_window_records(max(buckets_for(max_streams)), max(self.widths))
        if capture and mempool is None:
            mempool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Replayable] = {}
        for n in sorted(buckets_for(max_streams), reverse=True):
            for w in sorted(self.widths, reverse=True):
                # Built inside the captured function: its positions and repeated slots are
                # computed from the static buffers on every replay.
                self.graphs[n, w] = _Replayable(
                    lambda n=n, w=w: model.forward_ex(
                        ForwardBatch.windows_of(
                            self.ids[: n * w], self.slots[:n], self.starts[:n], w, self.records
                        ),
                        pool,
                        tuple(taps),
                    ),
                    capture,
                    mempool,
                )
        self.buckets = sorted({n for n, _ in self.graphs})

    def covers(self, n: int, width: int) -> bool:
        return width in self.widths and n <= self.buckets[-1]

    def run(
        self, windows: Sequence[Sequence[int]], starts: Sequence[int], slots: Sequence[int]
    ) -> ForwardOutput:
        """Windows of one width for ``len(windows)`` streams; logits and taps of every row,
        stream after stream, and the GDN records by slot."""
        n, w = len(windows), len(windows[0])
        b = min(x for x in self.buckets if x >= n)
        pad = b - n
        ids = [t for win in windows for t in win] + [0] * (pad * w)
        self.ids[: b * w].copy_(torch.tensor(ids, dtype=torch.int64), non_blocking=True)
        self.slots[:b].copy_(torch.tensor(list(slots) + [self.scratch] * pad), non_blocking=True)
        self.starts[:b].copy_(torch.tensor(list(starts) + [1] * pad), non_blocking=True)
        out = self.graphs[b, w].replay()
        taps = out.taps[: n * w] if out.taps is not None else None
        return ForwardOutput(
            out.logits[: n * w], taps, {slot: out.records[j] for j, slot in enumerate(slots)}
        )


class DraftGraphs:
    """The drafter's proposal forward (``DFlashDrafter.propose_from``) for full blocks, one
    graph per stream-count bucket. Padding streams read the ring's spare slot (empty: every row
    masked) and are dropped."""

    def __init__(
        self,
        drafter,
        pool,
        max_streams: int,
        spare_slot: int,
        block: int,
        capture: bool = True,
        mempool: object | None = None,
    ) -> None:
        self.drafter, self.block, self.spare = drafter, block, spare_slot
        dev = drafter.device
        self.slots = torch.full((max_streams,), spare_slot, dtype=torch.int64, device=dev)
        self.anchors = torch.zeros(max_streams, dtype=torch.int64, device=dev)
        self.positions = torch.ones(max_streams, dtype=torch.int64, device=dev)
        if capture and mempool is None:
            mempool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Replayable] = {}
        for n in sorted(buckets_for(max_streams), reverse=True):
            self.graphs[n] = _Replayable(
                lambda n=n: ForwardOutput(
                    drafter.propose_from(
                        pool, self.slots[:n], self.anchors[:n], self.positions[:n], block
                    ),
                    None,
                    {},
                ),
                capture,
                mempool,
            )

    def covers(self, n: int, block: int) -> bool:
        return block == self.block and n <= max(self.graphs)

    def run(
        self, slots: Sequence[int], anchors: Sequence[int], positions: Sequence[int]
    ) -> torch.Tensor:
        """Logits ``[n, block-1, vocab]``, a view of the static output (until the next replay)."""
        n = len(slots)
        b = min(x for x in self.graphs if x >= n)
        pad = b - n
        self.slots[:b].copy_(torch.tensor(list(slots) + [self.spare] * pad), non_blocking=True)
        self.anchors[:b].copy_(torch.tensor(list(anchors) + [0] * pad), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(list(positions) + [1] * pad), non_blocking=True)
        self.drafter.forwards += 1
        return self.graphs[b].replay().logits[:n]


class RollbackGraphs:
    """Rolling a stream back to the first ``keep`` rows of its last graphed window
    (``CausalLM.rollback_window`` over the window graphs' shared records), one graph per
    ``keep``. Eagerly, a rollback is tens of small kernels per GDN layer."""

    def __init__(
        self,
        model: CausalLM,
        pool: StatePool,
        records: Any,
        max_width: int,
        scratch_slot: int,
        capture: bool = True,
        mempool: object | None = None,
    ) -> None:
        dev = model.device
        # Start on the scratch slot: capturing runs the rollback.
        self.slot = torch.full((1,), scratch_slot, dtype=torch.int64, device=dev)
        self.window = torch.zeros(1, dtype=torch.int64, device=dev)
        if capture and mempool is None:
            mempool = torch.cuda.graph_pool_handle()
        self.graphs = {
            keep: _Replayable(
                lambda keep=keep: model.rollback_window(
                    pool, self.slot, records, self.window, keep
                ),
                capture,
                mempool,
            )
            for keep in range(1, max_width)
        }

    def run(self, slot: int, window: int, keep: int) -> None:
        self.slot.fill_(slot)
        self.window.fill_(window)
        self.graphs[keep].replay()


class RoundGraphs:
    """Whole greedy speculative rounds (:func:`headstart.engine.spec.round.greedy_round`), one
    graph per stream-count bucket, for full blocks: proposal, verify window, verdict, rollback
    and ring update in one replay, one read-back. Padding streams run on the scratch slot
    (the drafter ring's spare slot is the same index) with room 1."""

    def __init__(
        self,
        model: CausalLM,
        pool: StatePool,
        speculator: Any,
        records: Any,
        max_streams: int,
        scratch_slot: int,
        taps: Sequence[int],
        vocab: int,
        capture: bool = True,
        mempool: object | None = None,
    ) -> None:
        from headstart.engine.spec.round import greedy_round

        assert speculator.spare == scratch_slot, "padding rows share one slot index"
        self.scratch, self.block = scratch_slot, speculator.block
        self.drafter = speculator.drafter
        self.pool_tokens = pool.max_tokens
        dev = model.device
        b = self.block
        self.ids = torch.zeros(max_streams * b, dtype=torch.int64, device=dev)
        # Slots, anchors, starts and rooms by stream, in one buffer: one copy a round.
        self.inputs = torch.tensor(
            [[scratch_slot], [0], [1], [1]], dtype=torch.int64, device=dev
        ).repeat(1, max_streams)
        self.slots, self.anchors, self.starts, self.rooms = self.inputs
        if capture and mempool is None:
            mempool = torch.cuda.graph_pool_handle()

        def forward(n: int) -> ForwardOutput:
            said = greedy_round(
                model,
                pool,
                speculator.drafter,
                speculator.pool,
                records,
                self.ids[: n * b],
                self.slots[:n],
                self.anchors[:n],
                self.starts[:n],
                self.rooms[:n],
                b,
                vocab,
                tuple(taps),
            )
            return ForwardOutput(said, None, {})

        # The verdicts come back through pinned memory, copied as soon as a replay ends, so a
        # round can be launched and its verdict read later (:meth:`launch`, :meth:`collect`).
        cuda = dev.type == "cuda"
        self.verdicts = torch.zeros(max_streams, b + 1, dtype=torch.int64, pin_memory=cuda)
        self.copied = torch.cuda.Event() if cuda else None
        self.pending: int | None = None  # streams of the round launched and not yet collected
        self.graphs = _capture_each(
            "speculative rounds",
            sorted(buckets_for(max_streams), reverse=True),
            forward,
            capture,
            mempool,
        )

    def covers(self, n: int, starts: Sequence[int]) -> bool:
        """Whether ``n`` streams' rounds fit a graph: a bucket holds them and every window's
        rows stay inside the pool."""
        return n <= max(self.graphs) and all(s + self.block <= self.pool_tokens for s in starts)

    def run(
        self,
        slots: Sequence[int],
        anchors: Sequence[int],
        starts: Sequence[int],
        rooms: Sequence[int],
    ) -> list[list[int]]:
        """One round per stream; per stream the tokens it emits (1 .. min(block, room))."""
        self.launch(slots, anchors, starts, rooms)
        return self.collect()

    def launch(
        self,
        slots: Sequence[int],
        anchors: Sequence[int],
        starts: Sequence[int],
        rooms: Sequence[int],
    ) -> None:
        """Start one round per stream (as :meth:`run`) without waiting for it; at most one
        round is pending at a time."""
        assert self.pending is None, "the last round was not collected"
        n = len(slots)
        b = min(x for x in self.graphs if x >= n)
        pad = b - n
        values = torch.tensor(
            [
                [*slots, *[self.scratch] * pad],
                [*anchors, *[0] * pad],
                [*starts, *[1] * pad],
                [*rooms, *[1] * pad],
            ],
            dtype=torch.int64,
        )
        self.inputs[:, :b].copy_(values, non_blocking=True)
        self.drafter.forwards += 1
        self.verdicts[:b].copy_(self.graphs[b].replay().logits, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.pending = n

    def collect(self) -> list[list[int]]:
        """The pending round's tokens per stream, once it is done (the one wait for it)."""
        n, self.pending = self.pending, None
        assert n is not None, "no round was launched"
        if self.copied is not None:
            self.copied.synchronize()
        return [row[: row[-1]] for row in self.verdicts[:n].tolist()]


def continuation_widths(max_tokens: int, step: int = 128) -> list[int]:
    """The padded widths of continued-chunk graphs: 2, 4, 8, 16, ... up to ``2 * step``, then
    every ``step`` tokens, up to ``max_tokens`` (included): at most ``step`` rows of padding
    on a long chunk (a tool result of 520 tokens pads to 640, not 1024). Why no widths between
    the powers of two below ``2 * step``: a forward of that few rows costs about what reading
    the weights costs, whatever its rows (27B: 16 GB of dense copies, 256 rows 14 TFLOP), while
    each graph costs a capture at start-up (about 0.3 s at 27B)."""
    widths, p = {max_tokens}, 2
    while p < min(max_tokens, 2 * step):
        widths.add(p)
        p *= 2
    widths.update(range(2 * step, max_tokens, step))
    return sorted(w for w in widths if w >= 2)


class ContinuationGraphs:
    """Continued prefill chunks of 2 .. ``max_tokens`` tokens (a stream past position 0: the
    new turn after a prompt-cache hit, the later chunks of a long prompt), each padded to the
    next of :func:`continuation_widths`, one graph per width, with slot, start position and
    real length in static tensors (``ForwardBatch.windows_of(span=True, length=...)``).
    Attention runs over the pool by slot and start tensors (``Kernels.attn_chunk``: each key
    block read once per block of query rows); the GDN through the kernels' span recurrence;
    padding rows leave the stream's state as its last real row left it."""

    def __init__(
        self,
        model: CausalLM,
        pool: StatePool,
        max_tokens: int,
        scratch_slot: int,
        taps: Sequence[int] = (),
        capture: bool = True,
        mempool: object | None = None,
    ) -> None:
        dev = model.device
        self.max_tokens = min(max_tokens, pool.max_tokens - 1)
        self.pool_tokens = pool.max_tokens
        self.widths = continuation_widths(self.max_tokens) if self.max_tokens >= 2 else []
        self.ids = torch.zeros(max(self.max_tokens, 1), dtype=torch.int64, device=dev)
        self.slot = torch.full((1,), scratch_slot, dtype=torch.int64, device=dev)
        self.start = torch.ones(1, dtype=torch.int64, device=dev)
        self.length = torch.ones(1, dtype=torch.int64, device=dev)
        if capture and mempool is None:
            mempool = torch.cuda.graph_pool_handle()
        self.graphs = _capture_each(
            "continuation graphs",
            sorted(self.widths, reverse=True),
            lambda w: model.forward_ex(
                ForwardBatch.windows_of(
                    self.ids[:w], self.slot, self.start, w, span=True, length=self.length
                ),
                pool,
                tuple(taps),
            ),
            capture,
            mempool,
            warmups=1,
            rows=lambda w: w,
        )

    def width(self, n: int, start: int) -> int | None:
        """The graph width for ``n`` tokens at ``start``: the narrowest that holds them and
        whose padding rows stay inside the pool; None when there is none."""
        return next((w for w in self.widths if w >= n and start + w <= self.pool_tokens), None)

    def covers(self, n: int, start: int) -> bool:
        return n >= 2 and self.width(n, start) is not None

    def run(self, tokens: Sequence[int], start: int, slot: int) -> ForwardOutput:
        """Prefill ``tokens`` at positions ``start ..`` of ``slot``; the last real row's logits
        and every row's taps (padding rows' after the real ones), views valid until the next
        replay."""
        n = len(tokens)
        w = self.width(n, start)
        if w is None or n < 2:
            raise ValueError(f"no continuation graph for {n} tokens at {start}")
        self.ids[:w].zero_()
        self.ids[:n].copy_(torch.tensor(tokens, dtype=torch.int64), non_blocking=True)
        self.slot.fill_(slot)
        self.start.fill_(start)
        self.length.fill_(n)
        return self.graphs[w].replay()
