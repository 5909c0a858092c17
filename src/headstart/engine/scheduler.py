"""Continuous batching bookkeeping: which streams run, and what each contributes to the next step.

Pure Python (no torch), so it tests in milliseconds. The rule is vLLM's: there are no prefill or
decode phases; every running sequence has ``computed`` tokens in its slot's state and chases
``len(prompt) + len(output)``. Each step gives every decoding sequence its one pending row, then
spends the rest of a token budget on prompt chunks in admission order, so a long prompt is fed in
pieces and never stalls the streams already decoding. A sequence holds exactly one slot from
admission until :meth:`Scheduler.finish`, which is idempotent, so a slot is released exactly once.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class QueueFull(Exception):
    """The admission queue is at its bound; the caller should retry later."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One stream: its prompt, what it has generated, and how much of that its slot holds."""

    id: str
    prompt: list[int]
    max_new_tokens: int
    status: Status = Status.WAITING
    slot: int | None = None
    computed: int = 0  # tokens whose effect is in the slot's state
    output: list[int] = field(default_factory=list)
    boundaries: tuple[int, ...] = ()  # prompt positions where a prefill chunk must end
    cached: int = 0  # prompt tokens restored from the prompt cache instead of computed

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)


@dataclass(frozen=True)
class Work:
    """One sequence's part of a step: rows ``start .. start+len(tokens)`` of its token stream."""

    seq: Sequence
    start: int
    tokens: tuple[int, ...]
    samples: bool  # the last row's logits pick the sequence's next token


class Scheduler:
    def __init__(
        self, num_slots: int, max_queue: int, prefill_chunk: int = 512, step_tokens: int = 2048
    ) -> None:
        assert num_slots >= 1 and max_queue >= 0 and 1 <= prefill_chunk <= step_tokens
        self.num_slots = num_slots
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.step_tokens = step_tokens
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; raises QueueFull when ``max_queue`` sequences already wait."""
        assert seq.status is Status.WAITING and seq.prompt and seq.max_new_tokens >= 1
        # Waiting sequences first take the free slots; beyond those, at most max_queue wait.
        if len(self.waiting) >= self.max_queue + len(self.free_slots):
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        self.waiting.append(seq)

    def schedule(self) -> list[Work]:
        """Admit what fits, then plan one step. Empty when there is nothing to do."""
        self.admit()
        return self.plan()

    def admit(self) -> list[Sequence]:
        """Give free slots to waiting sequences (FIFO); returns the newly admitted ones, whose
        ``computed`` the caller may still raise (prompt-cache restore) before :meth:`plan`."""
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.status = Status.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def plan(self) -> list[Work]:
        """One step's work: every decoding sequence's pending row, then prompt chunks within the
        token budget, each chunk ending at the next boundary (where a snapshot will be taken)."""
        work: list[Work] = []
        budget = self.step_tokens
        for seq in self.running:  # decode rows first: one pending token each
            if not seq.prefilling:
                pending = len(seq.prompt) + len(seq.output) - seq.computed
                assert pending in (0, 1), "a decoding sequence has at most one pending token"
                if not pending:  # restored whole; its first token comes from cached logits
                    continue
                work.append(Work(seq, seq.computed, (seq.output[-1],), samples=True))
                budget -= 1
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prefilling:
                n = min(len(seq.prompt) - seq.computed, self.prefill_chunk, budget)
                end = seq.computed + n
                end = min([end] + [b for b in seq.boundaries if seq.computed < b < end])
                work.append(
                    Work(
                        seq,
                        seq.computed,
                        tuple(seq.prompt[seq.computed : end]),
                        samples=end == len(seq.prompt),
                    )
                )
                budget -= end - seq.computed
        return work

    def step_done(self, work: list[Work]) -> None:
        """Record that a planned step ran: its rows are now in the slots' state."""
        for w in work:
            if w.seq.status is Status.RUNNING:
                w.seq.computed = w.start + len(w.tokens)

    def restored(self, seq: Sequence, n: int, boundaries: tuple[int, ...] | None = None) -> None:
        """The first ``n`` prompt tokens of a newly admitted sequence were restored into its
        slot (prompt cache) instead of computed; ``boundaries``: where the rest's chunks must
        end, if that changed. Call before :meth:`plan`."""
        assert seq.status is Status.RUNNING and 0 <= n <= len(seq.prompt)
        seq.computed = seq.cached = n
        if boundaries is not None:
            seq.boundaries = boundaries

    def accept(self, seq: Sequence, tokens: list[int], computed: int) -> None:
        """A verify round's outcome: ``tokens`` emitted, and the slot's state now holds the
        first ``computed`` tokens of the stream (the last emitted token is fed next)."""
        assert seq.status is Status.RUNNING and not seq.prefilling
        seq.output.extend(tokens)
        seq.computed = computed

    def append_token(self, seq: Sequence, token: int) -> None:
        """A sampled token that the sequence will continue from (fed in the next step)."""
        assert seq.status is Status.RUNNING and not seq.prefilling
        seq.output.append(token)

    def finish(self, seq: Sequence) -> bool:
        """End a sequence wherever it is; frees its slot. False if it had already finished."""
        if seq.status is Status.FINISHED:
            return False
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            assert seq.slot is not None and seq.slot not in self.free_slots
            self.free_slots.append(seq.slot)
        seq.status = Status.FINISHED
        return True

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
