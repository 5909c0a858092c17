"""One forward's worth of work: rows from many streams, packed.

The scheduler (torch-free) describes each stream's part of a step as a :class:`SeqChunk`: which
slot, how many tokens that slot's state already holds (``start``, also the position of the first new
token), the new token ids, and how many of its last rows need logits. A prefill chunk, a single
decode row and (later) a verify window are all the same thing. :class:`ForwardBatch` packs a list
of them into tensors, in order, with ``cu_seqlens``-style offsets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    # A family's buffers for graphed verify windows (Qwen3.5: GDN inputs per layer).
    WindowRecords = Any


@dataclass(frozen=True)
class SeqChunk:
    slot: int
    start: int
    tokens: tuple[int, ...]
    logit_rows: int = 1  # logits for the last N rows of this chunk (0 = none)
    record: bool = False  # keep what is needed to roll the GDN state back to any row (verify)
    # A token tree instead of a sequence (tree verify windows): parents[i] < i is row i's parent
    # row (-1 for the root, row 0). Row i sits at position start + depth(i) and sees the
    # stream's committed rows plus its own ancestors.
    parents: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(self.tokens))
        if self.parents is not None:
            object.__setattr__(self, "parents", tuple(self.parents))
            assert len(self.parents) == len(self.tokens) and self.parents[0] == -1
            assert all(0 <= p < i for i, p in enumerate(self.parents) if i), "parents precede"
        assert self.tokens, "a chunk has at least one token"
        assert self.start >= 0 and 0 <= self.logit_rows <= len(self.tokens)


@dataclass(frozen=True)
class SeqSpan:
    """Where one chunk's rows sit in the packed batch."""

    slot: int
    start: int  # tokens already in the slot's state
    begin: int  # first packed row
    end: int  # one past the last packed row
    record: bool = False
    parents: tuple[int, ...] | None = None

    def depths(self) -> list[int]:
        if self.parents is None:
            return list(range(self.length))
        d = [0] * self.length
        for i in range(1, self.length):
            d[i] = d[self.parents[i]] + 1
        return d

    @property
    def length(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class DecodeRows:
    """The single-row chunks of a batch, gathered so the mixers can run them as one batch."""

    rows: torch.Tensor  # [n] packed row of each
    slots: torch.Tensor  # [n] its slot
    positions: torch.Tensor  # [n] its position (== tokens already in the slot)
    fresh: torch.Tensor  # [n] bool: position 0, the slot's old state must be ignored


@dataclass(frozen=True)
class MultiRows:
    """The multi-row spans (prefill chunks, verify windows), packed for a varlen kernel."""

    rows: torch.Tensor  # [Tm] packed row index of each of their rows, span after span
    cu_seqlens: torch.Tensor  # [N+1] int32 offsets into ``rows``
    cu_seqlens_cpu: torch.Tensor  # the same, on the host
    slots: torch.Tensor  # [N]
    fresh: torch.Tensor  # [N] bool: starts at position 0
    # Index tensors the layers derive from these once per forward (the model's memo: every
    # layer of the forward reuses them).
    memo: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class WindowRows:
    """Verify windows of ``W`` rows for ``n`` streams, in the form a CUDA graph can capture:
    slots and start positions are tensors, not Python ints (see engine/cuda_graph.py). The GDN
    layers run the rows as ``W`` one-row steps of every stream in one call; attention runs them
    as decode rows (a ``span``: as one chunk, ``Kernels.attn_chunk``).
    Recorded for rollback like a ``record`` span; records are keyed by stream index ``0..n-1``."""

    rows: torch.Tensor  # [n, W] packed row of each window row
    slots: torch.Tensor  # [n]
    as_decode: DecodeRows  # every row as a decode row (slot repeated, its own position)
    records: WindowRecords | None = None  # where to write the records (shared by graphs)
    # One stream's rows as one span through the kernels' span recurrence: a continued prefill
    # chunk (not recorded; logits of its last row only).
    span: bool = False
    # A span padded to W rows: its real rows are the first ``length`` ([1] tensor); the rows
    # after them leave the stream's state as its last real row left it (no decay and no
    # update in the GDN, the conv tail ending at the last real row; their KV rows, past the
    # stream's end, are never read) and its logits come from its last real row.
    length: torch.Tensor | None = None


@dataclass(frozen=True)
class PaddedRows:
    """New prompts of ``N`` streams, each at position 0 and padded to ``L`` rows, in the form a
    CUDA graph can capture (tensors only; see engine/cuda_graph.py's ``BurstGraphs``). Stream
    j's prompt is its first ``lengths[j]`` rows; the rows after it are padding, which must leave
    the stream's state as its last prompt row left it (the GDN layers give them no decay and no
    update, attention never reads their KV rows, the conv tail ends at the last prompt row).
    Logits come from each stream's last prompt row."""

    rows: torch.Tensor  # [N, L] packed row of each (stream-major)
    slots: torch.Tensor  # [N] (padding streams share the scratch slot)
    lengths: torch.Tensor  # [N] prompt rows of each stream, 1 <= length <= L
    valid: torch.Tensor  # [N * L] bool: a prompt row, not padding
    row_slots: torch.Tensor  # [N * L] the slot of each row (``slots`` repeated L times)


@dataclass(frozen=True)
class ForwardBatch:
    """Packed rows and the shapes the layers dispatch on. Invariants (checked on creation):
    every span is exactly one of a decode row (in ``decode``), a multi-row span (in
    ``multi_row``, packed as ``multi``) or a tree (in ``trees``); a batch of graph-capturable
    ``windows`` holds nothing else, and graph decode batches no spans (their rows are addressed
    by tensors)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each row in its stream
    spans: tuple[SeqSpan, ...]
    logit_index: torch.Tensor  # [R] packed rows whose logits are returned, in chunk order
    decode: DecodeRows | None  # spans of one row, batched
    multi_row: tuple[SeqSpan, ...]  # spans of several rows (prefill chunks, verify windows)
    multi: MultiRows | None = None
    trees: tuple[SeqSpan, ...] = ()  # tree verify windows, run one by one (reference ops)
    windows: WindowRows | None = None  # graph-capturable verify windows (alone in a batch)
    padded: PaddedRows | None = None  # graph-capturable new prompts (alone in a batch)

    def __post_init__(self) -> None:
        alone = [x for x in (self.windows, self.padded) if x is not None]
        if alone and (
            len(alone) > 1 or self.spans or self.decode is not None or self.multi_row or self.trees
        ):
            raise ValueError("a batch of graph-capturable windows or prompts holds nothing else")
        if (self.multi is None) != (not self.multi_row):
            raise ValueError("multi packs exactly the multi-row spans")
        singles = 0 if self.decode is None else self.decode.rows.shape[0]
        # (Graph batches carry their decode rows as tensors only, with no spans.)
        if self.spans and singles + len(self.multi_row) + len(self.trees) != len(self.spans):
            raise ValueError("every span is a decode row, a multi-row span or a tree")

    @property
    def all_decode(self) -> DecodeRows | None:
        """The decode rows when they are all the rows of the batch, in row order (by
        construction: :meth:`build` packs single-row chunks in order, windows are ``arange``), so
        per-row kernels may write their outputs whole, with no scatter; else None."""
        if self.multi_row or self.trees or self.padded is not None:
            return None
        if self.windows is not None:
            return self.windows.as_decode if self.decode is None else None
        return self.decode

    @classmethod
    def windows_of(
        cls,
        input_ids: torch.Tensor,
        slots: torch.Tensor,
        starts: torch.Tensor,
        width: int,
        records: WindowRecords | None = None,
        span: bool = False,
        length: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """``n`` verify windows of ``width`` rows: ``input_ids`` [n * width] stream after
        stream, window j at positions ``starts[j] ..`` of ``slots[j]``. Built from tensors
        only (no host values), so the static buffers of a graph can be passed in. ``span``: one
        continued prefill chunk instead, ``length``: of that many real rows, padded to
        ``width`` (see :class:`WindowRows`)."""
        n = slots.shape[0]
        dev = input_ids.device
        rows = torch.arange(n * width, device=dev).view(n, width)
        positions = (starts[:, None] + torch.arange(width, device=dev)).reshape(-1)
        decode = DecodeRows(
            rows=rows.reshape(-1),
            slots=slots.repeat_interleave(width),
            positions=positions,
            fresh=torch.zeros(n * width, dtype=torch.bool, device=dev),
        )
        assert not span or n == 1, "a span batch holds one stream"
        assert length is None or span, "only a span is padded"
        if length is not None:
            logit_index = rows[0][length - 1]
        else:
            logit_index = rows[:, -1] if span else rows.reshape(-1)
        return cls(
            input_ids=input_ids,
            positions=positions,
            spans=(),
            logit_index=logit_index,
            decode=None,
            multi_row=(),
            multi=None,
            windows=WindowRows(
                rows=rows,
                slots=slots,
                as_decode=decode,
                records=records,
                span=span,
                length=length,
            ),
        )

    @classmethod
    def padded_of(
        cls, input_ids: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, width: int
    ) -> ForwardBatch:
        """``n`` new prompts padded to ``width`` rows: ``input_ids`` [n * width] stream after
        stream, prompt j the first ``lengths[j]`` of its rows, at positions ``0 ..`` of
        ``slots[j]``. Built from tensors only (graph-capturable); see :class:`PaddedRows`."""
        n, dev = slots.shape[0], input_ids.device
        rows = torch.arange(n * width, device=dev).view(n, width)
        column = torch.arange(width, device=dev)
        return cls(
            input_ids=input_ids,
            positions=column.repeat(n),
            spans=(),
            logit_index=rows[:, 0] + lengths - 1,
            decode=None,
            multi_row=(),
            padded=PaddedRows(
                rows=rows,
                slots=slots,
                lengths=lengths,
                valid=(column[None, :] < lengths[:, None]).reshape(-1),
                row_slots=slots.repeat_interleave(width),
            ),
        )

    @classmethod
    def build(cls, chunks: Sequence[SeqChunk], device: torch.device | str = "cpu") -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        logit_rows: list[int] = []
        slots = [c.slot for c in chunks]
        assert len(set(slots)) == len(slots), "a slot appears at most once per batch"
        for c in chunks:
            begin = len(ids)
            ids.extend(c.tokens)
            span = SeqSpan(c.slot, c.start, begin, begin + len(c.tokens), c.record, c.parents)
            positions.extend(c.start + d for d in span.depths())
            spans.append(span)
            logit_rows.extend(range(len(ids) - c.logit_rows, len(ids)))
        singles = [s for s in spans if s.length == 1 and not s.record and s.parents is None]
        decode = None
        if singles:

            def t(values: list[int]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.int64, device=device)

            decode = DecodeRows(
                rows=t([s.begin for s in singles]),
                slots=t([s.slot for s in singles]),
                positions=t([s.start for s in singles]),
                fresh=torch.tensor([s.start == 0 for s in singles], device=device),
            )
        multi_spans = tuple(s for s in spans if (s.length > 1 or s.record) and s.parents is None)
        multi = None
        if multi_spans:
            cu = [0]
            for s in multi_spans:
                cu.append(cu[-1] + s.length)
            cu_cpu = torch.tensor(cu, dtype=torch.int32)
            multi = MultiRows(
                rows=torch.cat([torch.arange(s.begin, s.end) for s in multi_spans]).to(device),
                cu_seqlens=cu_cpu.to(device),
                cu_seqlens_cpu=cu_cpu,
                slots=torch.tensor([s.slot for s in multi_spans], dtype=torch.int64, device=device),
                fresh=torch.tensor([s.start == 0 for s in multi_spans], device=device),
            )
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            spans=tuple(spans),
            logit_index=torch.tensor(logit_rows, dtype=torch.int64, device=device),
            decode=decode,
            multi_row=multi_spans,
            multi=multi,
            trees=tuple(s for s in spans if s.parents is not None),
        )
