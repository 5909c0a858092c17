"""Target features waiting for a stream's drafter ring.

The drafter reads the target's tapped hidden states of a stream's committed rows. They are
produced by every forward (prompt chunks, decode rows, accepted window rows) but enter the ring
only when the stream drafts, so each drafting stream queues them in a :class:`FeatureQueue`.
"""

from __future__ import annotations

import torch


class FeatureQueue:
    """The newest ``window`` rows of committed features not yet handed to the drafter's ring,
    for positions ``start .. start + held - 1``, in position order and without gaps.

    Rows are kept as a list of pieces and joined only when read: while a stream does not draft,
    rows arrive one per step, and joining on every step would copy up to the whole window each
    time. Added rows are copied (they may be views of a graph's static output)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.pieces: list[torch.Tensor] = []
        self.held = 0  # rows in pieces
        self.start = 0  # position of the first held row

    @property
    def rows(self) -> torch.Tensor | None:
        """The held rows joined, None when nothing is held."""
        if not self.pieces:
            return None
        if len(self.pieces) > 1:
            self.pieces = [torch.cat(self.pieces)]
        return self.pieces[0]

    def add(self, rows: torch.Tensor, start: int) -> None:
        """Queue ``rows`` (positions ``start ..``), keeping the newest ``window`` rows; raises
        AssertionError when they do not follow the held rows."""
        if self.held and self.start + self.held != start:
            raise AssertionError("features must arrive in position order, without gaps")
        if rows.shape[0] >= self.window:  # the new rows alone fill the window
            drop = rows.shape[0] - self.window
            self.pieces, self.held, self.start = [rows[drop:].clone()], self.window, start + drop
            return
        rows = rows.clone()
        if self.held == 0:
            self.pieces, self.held, self.start = [rows], rows.shape[0], start
        else:
            self.pieces.append(rows)
            self.held += rows.shape[0]
        excess = self.held - self.window
        while excess > 0:  # drop the oldest rows (whole pieces, then part of one: a view)
            first = self.pieces[0]
            cut = min(excess, first.shape[0])
            if cut == first.shape[0]:
                self.pieces.pop(0)
            else:
                self.pieces[0] = first[cut:]
            self.start += cut
            self.held -= cut
            excess -= cut

    def take(self) -> tuple[torch.Tensor | None, int]:
        """Hand the held rows over (to the drafter's ring): returns them with their first
        position and leaves the queue empty, continuing after them."""
        rows, start = self.rows, self.start
        self.pieces, self.held, self.start = [], 0, start + self.held
        return rows, start

    def load(self, rows: torch.Tensor, end: int) -> None:
        """Replace the queue with ``rows`` (a copy), the features of positions before ``end``
        (a prompt-cache restore)."""
        self.pieces, self.held, self.start = [rows.clone()], rows.shape[0], end - rows.shape[0]

    def ending_at(self, end: int) -> torch.Tensor | None:
        """The held rows when they end exactly at position ``end`` (for a snapshot there)."""
        if self.held and self.start + self.held == end:
            return self.rows
        return None
