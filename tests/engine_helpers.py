"""A sink for engine requests that records every event (shared by the engine tests)."""

from __future__ import annotations

import threading

from headstart.engine.engine import Failed, Finish, Piece


class Collector:
    """Records events; ``done`` is set on the final one. With a drafter, notes how many draft
    forwards had run when the first token arrived; ``on_first`` runs at that moment."""

    def __init__(self, drafter=None, on_first=None):
        self.events, self.done = [], threading.Event()
        self.drafter, self.on_first = drafter, on_first
        self.forwards_at_first = None

    def __call__(self, ev):
        if isinstance(ev, Piece) and self.forwards_at_first is None:
            self.forwards_at_first = self.drafter.forwards if self.drafter else 0
            if self.on_first:
                self.on_first()
        self.events.append(ev)
        if isinstance(ev, (Finish, Failed)):
            self.done.set()

    @property
    def tokens(self):
        return [e.token_id for e in self.events if isinstance(e, Piece)]

    @property
    def finish(self):
        return self.events[-1]
