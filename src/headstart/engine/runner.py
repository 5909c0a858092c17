"""The model side of the engine: the model, its state pool and every graph of its forward.

:class:`ModelRunner` is the only caller of the target model: it warms up and captures graphs at
start-up (:meth:`ModelRunner.warm_up`; on a CPU, compiles decode programs instead), runs each
step (:meth:`ModelRunner.run`), choosing in one place between a compiled CPU decode step,
graph replays, a graphed verify-window batch and one eager forward, and afterwards
commits what a verify round accepted (:meth:`ModelRunner.rollback`,
:meth:`ModelRunner.commit_tree`). The engine describes a step as a :class:`Step`; whichever path
runs it, the outputs come back laid out as the eager forward's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch

from headstart.batch import ForwardBatch, SeqChunk
from headstart.collector import collector_paused
from headstart.engine.config import EngineConfig
from headstart.engine.cpu_programs import DecodePrograms, offered, verify_widths
from headstart.engine.scheduler import Work
from headstart.engine.spec.proposal import Speculator
from headstart.engine.spec.verification import Draft
from headstart.models.contract import CausalLM, ForwardOutput
from headstart.parallel.peers import Call, lockstep
from headstart.parallel.snapshots import SnapshotTwins

log = logging.getLogger("headstart.engine")


# Every batch shape the runner can capture; a model's ``kernels.graph_shapes`` may name fewer.
GRAPH_SHAPES = frozenset({"decode", "prompts", "continuations", "windows"})


@contextmanager
def _phase(what: str, device: torch.device) -> Iterator[None]:
    """Log how long a start-up phase took (what start-up is spent on) and, on a GPU, the
    memory it leaves on ``device`` (what sizes the margin beside the state pool: serve's
    dense copies)."""
    started = time.monotonic()
    yield
    log.info("%s in %.1fs%s", what, time.monotonic() - started, gpu_memory_note(device))


def gpu_memory_note(device: torch.device) -> str:
    """On a CUDA ``device`` (its context made): its free memory and the peak the caching
    allocator has reserved on it so far; empty elsewhere. The device is named, not taken as
    the current one, which a model on ``cuda:1`` leaves at 0 (a context there costs memory)."""
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return ""
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_reserved(device)
    gib = 2**30
    return f" (GPU: {free / gib:.2f} of {total / gib:.2f} GiB free, peak reserved {peak / gib:.2f})"


def chunk_of(w: Work, draft: Draft | None = None) -> SeqChunk:
    """A work item's rows as the forward takes them: with a draft, the verify window (the
    pending row then the drafted tokens, every row's logits, recorded for rollback when a
    chain); without, its own rows and the last row's logits when it samples."""
    if draft is None:
        return SeqChunk(w.seq.slot, w.start, w.tokens, int(w.samples))
    tokens = w.tokens + draft.tokens
    return SeqChunk(
        w.seq.slot,
        w.start,
        tokens,
        len(tokens),
        record=draft.parents is None,
        parents=draft.window_parents,
    )


@dataclass(frozen=True)
class Step:
    """One forward: ``chunks`` (one per stream, each slot at most once), and whether the
    drafter's features (the tapped layers' rows) are wanted from an eager forward. A chunk is a
    verify window when it is recorded or a tree. The forward's ``logits`` hold every chunk's
    logit rows, chunk after chunk, and ``taps`` (when present) every row."""

    chunks: tuple[SeqChunk, ...]
    taps: bool = False

    @classmethod
    def of(cls, work: Sequence[Work], drafts: dict[int, Draft], taps: bool) -> Step:
        """The step of ``work``, item j a verify window when ``drafts`` has j."""
        return cls(tuple(chunk_of(w, drafts.get(j)) for j, w in enumerate(work)), taps)

    @cached_property
    def _layout(self) -> tuple[list[int], list[tuple[int, int]]]:
        ends, spans, row, begin = [], [], 0, 0
        for c in self.chunks:
            row += c.logit_rows
            ends.append(row)
            spans.append((begin, begin + len(c.tokens)))
            begin += len(c.tokens)
        return ends, spans

    def last_row(self, j: int) -> int:
        """The logits row of chunk j's last row (meaningful when it has logit rows)."""
        return self._layout[0][j] - 1

    def logit_rows(self, j: int) -> slice:
        end = self._layout[0][j]
        return slice(end - self.chunks[j].logit_rows, end)

    def rows(self, j: int) -> slice:
        """Chunk j's rows in the packed batch (its rows of ``taps``)."""
        return slice(*self._layout[1][j])


def _is_window(c: SeqChunk) -> bool:
    return c.record or c.parents is not None


@dataclass(frozen=True)
class _GraphPlan:
    """A step as graph replays, chunks by index: decode rows (one replay), groups of new
    prompts (one replay each) and continued chunks (one replay each)."""

    decode: list[int]
    prompts: list[list[int]]
    continued: list[int]


class ModelRunner:
    """Owns the model, the state pool (with graphs, one extra slot: the scratch slot, where
    padding rows and graph captures write) and every graph. Engine-thread only.

    With a tensor-parallel model, rank 0's runner (``peers`` set) sends each call marked
    ``lockstep`` to the other ranks' runners, which run it on their heads' state, and ``twins``
    keeps their part of the prompt cache's snapshots; graphs are not captured there."""

    # At most this many prompt or continued-chunk replays in a step; a step that needs more goes
    # eager, where its chunks share one batched forward.
    MAX_GRAPH_PREFILLS = 4

    def __init__(
        self, model: CausalLM, config: EngineConfig, spec: Speculator | None = None
    ) -> None:
        self.model, self.spec = model, spec
        self.num_slots, self.context = config.num_slots, config.context
        self.prefill_chunk = config.scheduling.prefill_chunk
        self.graph_config = g = config.graphs
        self.graphed = (
            g.enabled
            if g.enabled is not None
            else model.kernels.graphs and model.device.type == "cuda"
        )
        self.peers = getattr(model, "peers", None)  # rank 0 of a tensor-parallel group
        self.threads = config.threads if model.device.type == "cpu" else None
        self._threads_now = 0  # what torch.set_num_threads was last given here (0: not yet)
        if self.graphed and getattr(model, "tp", None) is not None:
            log.info("CUDA graphs off: tensor-parallel forwards run eagerly")
            self.graphed = False
        # On a CPU, decode steps from compiled programs (cpu_programs.py), where asked.
        self.compiled = (
            config.cpu_programs is not False
            and offered(model)
            and not self.graphed
            and self.peers is None
        )
        self.cpu_programs: DecodePrograms | None = None
        scratch = int(self.graphed or self.compiled)
        self.pool = model.new_state_pool(self.num_slots + scratch, self.context)
        self.twins = SnapshotTwins(self.peers) if self.peers is not None else None
        if self.peers is not None:
            self.peers.call(Call("worker", "start_runner", (config,)))
        self.scratch = self.num_slots
        self.taps: tuple[int, ...] = spec.taps if spec is not None else ()
        self.decode_graphs = self.prompt_graphs = self.continuation_graphs = None
        self.window_graphs = self.rollback_graphs = self.round_graphs = None
        # Of the last step: slot -> its chunk, GDN record, and (graphed windows) the padded
        # width and index in the window batch, for rollback / commit_tree.
        self._chunks: dict[int, SeqChunk] = {}
        self._records: dict = {}
        self._ran_rows: dict[int, tuple[int, int]] = {}

    # -- start-up ---------------------------------------------------------------------------
    def warm_up(self) -> None:
        """With graphs: run the eager paths once, then capture every graph (the speculator's
        draft graphs too). Then, with a drafter, measure what the planner weighs, as steps will
        run (so no timing includes compilation)."""
        if self.graphed:
            from headstart.engine.cuda_graph import sharded

            with sharded(self.graph_config.shard):
                with _phase("warm-up of the eager paths", self.model.device):
                    self.warm_eager(self.scratch)
                # A collection inside a capture runs the finalizers of the dead objects it finds
                # (an earlier engine's graphs and buffers), and a CUDA free among them breaks the
                # capture; torch stopped collecting at each capture's start (slow for many).
                with collector_paused():
                    self._capture()
        if self.compiled:
            with _phase("CPU decode steps compiled", self.model.device):
                self.cpu_programs = DecodePrograms(
                    self.model,
                    self.pool,
                    self.num_slots,
                    self.scratch,
                    taps=self.taps,
                    verify=verify_widths(self.spec.block) if self.spec is not None else (),
                )
        if self.spec is not None and self.spec.block >= 2:
            features = self._forward([SeqChunk(0, 0, (0,) * 8, 1)]).taps
            rg, s = self.round_graphs, self.scratch
            whole = (lambda: rg.run([s], [0], [1], [1])) if rg is not None else None
            self.spec.measure(self._runnable, features, whole)

    def warm_eager(self, scratch: int) -> None:
        """Run each eager path once on the ``scratch`` slot (slot 0 beside it; for several
        decode rows, slots 1, 2, .. too: a stream that starts there overwrites their state)
        so the first request pays no kernel compilation or autotuning: prefill chunks of a few
        sizes, a continued chunk, 1, 2, 4, .. decode rows beside a chunk, two chunks in one
        step and, with a drafter, a recorded verify window, its rollback and a draft."""
        from headstart.engine.cuda_graph import buckets_for, mine  # mine: a shard's only

        sizes = sorted(
            {min(n, self.context - 1) for n in (7, 14, 16, 31, 32, 64, 128, self.prefill_chunk)},
            reverse=True,  # the longest first: dealt out to shards, the longest go apart
        )
        steps = [[SeqChunk(scratch, 0, (0,) * n, 1)] for n in sizes]
        short = min(16, self.context // 4)
        if short >= 2:
            # A chunk that continues a stream (masked attention from position > 0, as after a
            # snapshot boundary or a cache hit); the varlen kernels (two chunks in one step).
            steps.append([SeqChunk(scratch, short, (0,) * short, 1)])
            if self.num_slots >= 2:
                # Decode rows beside a chunk at the decode graphs' batch sizes: kernels pick
                # their launch by the number of rows (the one-row GDN step's value slice, for
                # one), so a step of many decoding streams beside a new prompt compiled its own
                # variant on its first use (2B on an H100: a 316 ms gap, BENCHMARKS.md).
                others = [s for s in range(1, self.num_slots) if s != scratch]
                for k in buckets_for(1 + len(others)):
                    decode = [scratch, *others[: k - 1]]
                    rows = [SeqChunk(slot, 2 * short, (0,), 1) for slot in decode]
                    steps.append([*rows, SeqChunk(0, 0, (0,) * short, 1)])
                steps.append(
                    [SeqChunk(scratch, 0, (0,) * short, 1), SeqChunk(0, 0, (0,) * short, 1)]
                )
        for chunks in steps:
            if mine():
                self._forward(chunks)
        if self.spec is not None and self.spec.block >= 2:
            b = self.spec.block
            out = self._forward([SeqChunk(scratch, 1, (0,) * b, b, record=True)])
            self.model.rollback(self.pool, scratch, out.records[scratch], 1)
            self.spec.warm_up(out.taps)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def _capture(self) -> None:
        from headstart.engine.cuda_graph import ContinuationGraphs, DecodeGraphs, PromptGraphs

        g, model, pool, s, taps = self.graph_config, self.model, self.pool, self.scratch, self.taps
        shapes = getattr(model.kernels, "graph_shapes", GRAPH_SHAPES)
        with _phase("decode graphs", self.model.device):
            self.decode_graphs = DecodeGraphs(
                model, pool, self.num_slots, s, taps, capture=g.capture
            )
        mempool = self.decode_graphs.mempool  # shared: no two graphs replay at once
        if g.prefill_tokens >= 1 and "prompts" in shapes:
            with _phase("prompt graphs", self.model.device):
                self.prompt_graphs = PromptGraphs(
                    model,
                    pool,
                    self.num_slots,
                    min(g.prefill_tokens, self.context - 1),
                    max(g.prefill_rows, g.prefill_tokens),
                    s,
                    taps,
                    capture=g.capture,
                    mempool=mempool,
                )
        if g.continuations and g.continuation_tokens >= 2 and "continuations" in shapes:
            with _phase("continuation graphs", self.model.device):
                self.continuation_graphs = ContinuationGraphs(
                    model, pool, g.continuation_tokens, s, taps, capture=g.capture, mempool=mempool
                )
        if g.windows and self.spec is not None and self.spec.block >= 2 and "windows" in shapes:
            with _phase("speculative graphs", self.model.device):
                self._capture_rounds(mempool)

    def _capture_rounds(self, mempool: object) -> None:
        """A speculative round's graphs: chain verify windows, their rollbacks, proposals, and
        (where the model rolls back from device tensors) whole greedy rounds."""
        from headstart.engine.cuda_graph import RollbackGraphs, RoundGraphs, WindowGraphs

        g, spec, s = self.graph_config, self.spec, self.scratch
        self.window_graphs = WindowGraphs(
            self.model,
            self.pool,
            self.num_slots,
            range(2, spec.block + 1),
            s,
            self.taps,
            capture=g.capture,
            mempool=mempool,
        )
        self.rollback_graphs = RollbackGraphs(
            self.model,
            self.pool,
            self.window_graphs.records,
            spec.block,
            s,
            capture=g.capture,
            mempool=mempool,
        )
        spec.capture_graphs(self.num_slots, g.capture, mempool)
        if g.rounds and hasattr(self.model, "rollback_windows"):
            self.round_graphs = RoundGraphs(
                self.model,
                self.pool,
                spec,
                self.window_graphs.records,
                self.num_slots,
                s,
                self.taps,
                spec.vocab_size,
                capture=g.capture,
                mempool=mempool,
            )

    def _runnable(self, chunk: SeqChunk) -> Callable[[], object]:
        """``chunk``'s forward as steps run it, to be timed: when rounds run from graphs (window
        graphs captured), decode rows and chain windows replay on the scratch slot; the rest
        is an eager forward on ``chunk.slot`` (on every rank of a tensor-parallel group)."""
        if self.peers is not None:
            return lambda: self._forward([chunk])
        progs = self.cpu_programs
        if progs is not None and chunk.parents is None:
            n = len(chunk.tokens)
            if n == 1 and progs.bucket(1) is not None:
                return lambda: progs.run(list(chunk.tokens), [chunk.start], [chunk.slot])
            if n > 1 and progs.verify_width(n) is not None:

                def verify() -> None:
                    progs.run_verify(chunk.tokens, chunk.start, chunk.slot)
                    progs.forget()  # measured, not committed

                return verify
        wg = self.window_graphs
        if wg is not None and chunk.parents is None:
            if len(chunk.tokens) == 1:
                return lambda: self.decode_graphs.run([0], [1], [self.scratch])
            return lambda: wg.run([list(chunk.tokens)], [chunk.start], [self.scratch])
        batch = ForwardBatch.build([chunk], self.model.device)
        return lambda: self.model.forward_ex(batch, self.pool, self.taps)

    # -- steps --------------------------------------------------------------------------------
    @lockstep("runner")
    def run(self, step: Step) -> ForwardOutput:
        """Run ``step``: from graph replays when every chunk is a decode row, a new prompt (or
        its first chunk) within the prompt graphs' lengths, or a continued chunk of a captured
        length (at most MAX_GRAPH_PREFILLS prompt and chunk replays); from one window-graph replay
        when every chunk is a chain window that fits the captured widths and the pool; else as
        one eager forward. Outputs are laid out as :class:`Step` says; views of graph outputs
        are valid until the next run."""
        self._chunks, self._records, self._ran_rows = {}, {}, {}
        if self.cpu_programs is not None:
            self.cpu_programs.forget()
        chunks = step.chunks
        if self.threads is not None:
            self._size_threads(chunks)
        plan = self._graph_plan(chunks)
        # The programs return the taps too when the engine has a drafter (compiled with them).
        compiled = (
            self._compiled_decode(chunks)
            or self._compiled_window(chunks)
            or self._compiled_verify(chunks)
        )
        if compiled is not None:
            out = compiled
        elif plan is not None:
            out = self._graph_forward(chunks, plan)
        elif self._windows_fit(chunks):
            out = self._window_forward(chunks)
        else:
            out = self._forward(chunks, step.taps)
        self._chunks, self._records = {c.slot: c for c in chunks}, out.records
        return out

    def warm_engine_thread(self) -> torch.Tensor:
        """On the engine thread, before its first step; returns one row of logits from it (for
        the engine to warm its sampler on). A new prompt's forward on slot 0; on a CPU with
        thread counts set, instead, new prompts' forwards at the prefill count, the step
        budget's chunk continued, each compiled window and decode program (nothing runs yet;
        a stream at position 0 ignores what its slot held). OpenMP keeps a team of threads
        per calling thread, so this cannot run at start-up on another thread; without it the
        first request paid the team's start and the kernels' first calls (a 1,000-token
        prompt: 885 ms as the first request, 189 ms after, on this project's 2-core machine).
        """
        if self.threads is None:
            chunk = SeqChunk(0, 0, (0,) * min(16, self.context - 1), 1)
            return self._forward([chunk]).logits[-1:]
        sizes = {min(n, self.context - 1) for n in (16, 256, self.prefill_chunk)}
        for n in sorted(sizes):
            chunk = SeqChunk(0, 0, (0,) * n, 1)
            self._size_threads([chunk])
            logits = self._forward([chunk]).logits[-1:]
        # A chunk that continues the stream (a long prompt's second chunk attends over the
        # first), and each compiled window: their first calls on this thread cost as much
        # again as a warm one (a 30-token prompt: 90 ms as the first request, 9 ms after).
        n = max(sizes)
        if 2 * n < self.context:
            chunk = SeqChunk(0, n, (0,) * n, 1)
            self._size_threads([chunk])
            self._forward([chunk])
        programs = self.cpu_programs
        if programs is not None:
            for w in sorted(programs.windows):
                self._size_threads([SeqChunk(0, 0, (0,) * w, 1)])
                programs.run_window((0,) * w, 0, 0)
            for w in sorted(programs.verifiers):  # at position 1: nothing is committed
                self._size_threads([SeqChunk(0, 1, (0,) * w, w, record=True)])
                programs.run_verify((0,) * w, 1, 0)
            programs.forget()
        self._size_threads([SeqChunk(0, 1, (0,), 1)])
        if programs is not None:  # decode rows at position 1 of slots no stream holds yet
            for b in sorted(b for b in programs.ready if b <= self.num_slots):
                programs.run([0] * b, [1] * b, list(range(b)))
        return logits

    def _size_threads(self, chunks: Sequence[SeqChunk]) -> None:
        """On a CPU: the prefill thread count for a step with a prompt chunk of several rows
        or of at least ``wide_rows`` rows, the decode count otherwise (verify windows too:
        the speculative planner's costs were measured at it). Set on the engine thread,
        which runs the forward: OpenMP's thread count is per calling thread."""
        t = self.threads
        prompt = any(len(c.tokens) > 1 and not _is_window(c) for c in chunks)
        wide = t.wide_rows is not None and len(chunks) >= t.wide_rows
        want = t.prefill if prompt or wide else t.decode
        if want != self._threads_now:
            torch.set_num_threads(want)
            self._threads_now = want

    def rounds_fit(self, starts: Sequence[int]) -> bool:
        """Whether streams with pending tokens at ``starts`` can take a whole greedy round
        from one graph replay (:meth:`launch_rounds`)."""
        rg = self.round_graphs
        return rg is not None and rg.covers(len(starts), starts)

    def launch_rounds(
        self,
        slots: Sequence[int],
        anchors: Sequence[int],
        starts: Sequence[int],
        rooms: Sequence[int],
    ) -> None:
        """Start a whole greedy round per stream (``engine/spec/round.py``): each stream's
        pending token ``anchors[j]`` at ``starts[j]`` of ``slots[j]``, at most ``rooms[j]``
        tokens out; it commits each slot and drafter ring itself. Work queued after it (on the
        device's stream) sees the committed state; :meth:`collect_rounds` gives its tokens."""
        self._chunks, self._records, self._ran_rows = {}, {}, {}
        self.round_graphs.launch(slots, anchors, starts, rooms)

    def collect_rounds(self) -> list[list[int]]:
        """The tokens each stream of the launched rounds emits, once they are done."""
        return self.round_graphs.collect()

    @lockstep("runner")
    def commit(self, slot: int, path: Sequence[int]) -> None:
        """After the last step: keep the accepted ``path`` (window rows from the anchor, 0
        first) of ``slot``'s verify window in its state and undo the rest: a chain keeps its
        first ``len(path)`` rows (:meth:`rollback`), a tree its path (:meth:`commit_tree`)."""
        if self._chunks[slot].parents is not None:
            self.commit_tree(slot, path)
        else:
            self.rollback(slot, len(path))

    @lockstep("runner")
    def rollback(self, slot: int, keep: int) -> None:
        """After the last step: keep the first ``keep`` rows of ``slot``'s chain window in its
        state (the GDN state is replayed over them; KV rows past them are never read)."""
        progs = self.cpu_programs
        if progs is not None and progs.verified(slot):  # the state after each row is kept
            progs.commit(slot, keep)
            return
        ran = self._ran_rows.get(slot)
        if ran is not None:  # a graphed window: roll back from the shared records
            width, index = ran
            if keep < width:  # padding rows count as rejected rows
                self.rollback_graphs.run(slot, index, keep)
        elif keep < len(self._chunks[slot].tokens):
            self.model.rollback(self.pool, slot, self._records.pop(slot), keep)

    @lockstep("runner")
    def commit_tree(self, slot: int, path: Sequence[int]) -> None:
        """After the last step: make ``slot`` hold the state after its tree window's accepted
        ``path`` (window rows from the anchor)."""
        chunk = self._chunks[slot]
        self.model.commit_tree(self.pool, slot, chunk.start, self._records.pop(slot), path)

    @lockstep("runner")
    def _forward(self, chunks: Sequence[SeqChunk], taps: bool = True) -> ForwardOutput:
        return self.model.forward_ex(
            ForwardBatch.build(chunks, self.model.device), self.pool, self.taps if taps else ()
        )

    def _compiled_decode(self, chunks: Sequence[SeqChunk]) -> ForwardOutput | None:
        """A step of decode rows only, from a compiled CPU program (None: not such a step, or
        no program ready for its stream count yet)."""
        progs = self.cpu_programs
        if progs is None or not all(
            len(c.tokens) == 1 and c.logit_rows and not _is_window(c) for c in chunks
        ):
            return None
        return progs.run(
            [c.tokens[0] for c in chunks], [c.start for c in chunks], [c.slot for c in chunks]
        )

    def _compiled_window(self, chunks: Sequence[SeqChunk]) -> ForwardOutput | None:
        """A step of one stream's short prompt chunk, from a compiled CPU window (None: not
        such a step, or no window ready for it)."""
        progs = self.cpu_programs
        if progs is None or len(chunks) != 1:
            return None
        (c,) = chunks
        if len(c.tokens) < 2 or c.logit_rows > 1 or _is_window(c):
            return None
        out = progs.run_window(c.tokens, c.start, c.slot)
        if out is not None and not c.logit_rows:
            out = ForwardOutput(out.logits[:0], None, {})
        return out

    def _compiled_verify(self, chunks: Sequence[SeqChunk]) -> ForwardOutput | None:
        """A step of one stream's chain verify window, from a compiled CPU verify program
        (None: not such a step, or no program ready for it); :meth:`rollback` then commits."""
        progs = self.cpu_programs
        if progs is None or len(chunks) != 1:
            return None
        (c,) = chunks
        if not c.record or c.parents is not None or c.logit_rows != len(c.tokens):
            return None
        return progs.run_verify(c.tokens, c.start, c.slot)

    def _graph_plan(self, chunks: Sequence[SeqChunk]) -> _GraphPlan | None:
        """How the whole step replays graphs (chunks by index), or None when it cannot."""
        g, pg, cg = self.decode_graphs, self.prompt_graphs, self.continuation_graphs
        if g is None or any(_is_window(c) for c in chunks):
            return None
        decode = [
            j for j, c in enumerate(chunks) if len(c.tokens) == 1 and c.start > 0 and c.logit_rows
        ]
        fresh = [j for j, c in enumerate(chunks) if c.start == 0]
        continued = [
            j
            for j, c in enumerate(chunks)
            if c.start > 0 and cg is not None and cg.covers(len(c.tokens), c.start)
        ]
        groups: list[list[int]] = []
        if fresh:
            split = pg.groups([len(chunks[j].tokens) for j in fresh]) if pg is not None else None
            if split is None:
                return None
            groups = [[fresh[i] for i in group] for group in split]
        if (
            len(decode) + len(fresh) + len(continued) != len(chunks)
            or len(groups) + len(continued) > self.MAX_GRAPH_PREFILLS
            or len(decode) > self.num_slots
        ):
            return None
        return _GraphPlan(decode, groups, continued)

    def _graph_forward(self, chunks: Sequence[SeqChunk], plan: _GraphPlan) -> ForwardOutput:
        logits: dict[int, torch.Tensor] = {}
        taps: dict[int, torch.Tensor | None] = {}
        for group in plan.prompts:
            out = self.prompt_graphs.run(
                [chunks[j].tokens for j in group], [chunks[j].slot for j in group]
            )
            row = 0
            for r, j in enumerate(group):
                n = len(chunks[j].tokens)
                logits[j] = out.logits[r : r + 1] if chunks[j].logit_rows else out.logits[:0]
                taps[j] = out.taps[row : row + n] if out.taps is not None else None
                row += n
        for j in plan.continued:
            c = chunks[j]
            out = self.continuation_graphs.run(c.tokens, c.start, c.slot)
            # Cloned: another chunk of the same width in this step replays the same graph.
            logits[j] = out.logits.clone() if c.logit_rows else out.logits[:0]
            n = len(c.tokens)
            taps[j] = out.taps[:n].clone() if out.taps is not None else None
        if plan.decode:
            out = self.decode_graphs.run(
                [chunks[j].tokens[0] for j in plan.decode],
                [chunks[j].start for j in plan.decode],
                [chunks[j].slot for j in plan.decode],
            )
            for r, j in enumerate(plan.decode):
                logits[j] = out.logits[r : r + 1]
                taps[j] = out.taps[r : r + 1] if out.taps is not None else None
        order = range(len(chunks))
        tapped = [taps[j] for j in order]
        return ForwardOutput(
            torch.cat([logits[j] for j in order]),
            torch.cat(tapped) if all(t is not None for t in tapped) else None,
            {},
        )

    def _windows_fit(self, chunks: Sequence[SeqChunk]) -> bool:
        wg = self.window_graphs
        if wg is None or not all(c.record and c.parents is None for c in chunks):
            return False
        width = max(len(c.tokens) for c in chunks)
        # Padded windows write rows up to start + width: they must stay inside the pool.
        return wg.covers(len(chunks), width) and all(
            c.start + width <= self.pool.max_tokens for c in chunks
        )

    def _window_forward(self, chunks: Sequence[SeqChunk]) -> ForwardOutput:
        """Every chunk a chain window: one replay at the widest window's width (shorter ones
        padded; the padding rows are rolled back like rejected drafts)."""
        width = max(len(c.tokens) for c in chunks)
        out = self.window_graphs.run(
            [c.tokens + (0,) * (width - len(c.tokens)) for c in chunks],
            [c.start for c in chunks],
            [c.slot for c in chunks],
        )
        rows = torch.cat(
            [torch.arange(j * width, j * width + len(c.tokens)) for j, c in enumerate(chunks)]
        ).to(out.logits.device)
        self._ran_rows = {c.slot: (width, j) for j, c in enumerate(chunks)}
        return ForwardOutput(
            out.logits[rows], out.taps[rows] if out.taps is not None else None, out.records
        )
