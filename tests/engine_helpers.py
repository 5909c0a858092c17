"""What the engine tests share: a sink for engine requests that records every event, and a
drafter that is right for every length of prefix."""

from __future__ import annotations

import threading

import torch

from headstart.engine.engine import Failed, Finish, Piece
from headstart.engine.spec.drafter import DFlashDrafter


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


class PartOracle(DFlashDrafter):
    """Proposes the target's greedy continuation, cut short: from a depth drawn from the
    anchor's position (0 .. block - 1) on, the drafts are wrong, so rounds accept every
    length. Overrides the device form (``propose_from``), which whole rounds and the host's
    proposals run; only where the engine runs no CUDA graphs (it reads the scheduler)."""

    def __init__(self, real: DFlashDrafter, engine=None, salt: int = 11):
        self.__dict__.update(real.__dict__)
        self.engine, self.salt = engine, salt  # salt: which depths which positions get

    def propose_from(self, pool, slot_t, anchor_t, position_t, block, rows=None):
        from headstart.generate import greedy_tokens

        vocab = self.target.cfg.vocab_size
        out = torch.zeros(slot_t.shape[0], block - 1, vocab)
        seqs = {s.slot: s for s in self.engine.scheduler.running} if self.engine else {}
        for n, (slot, position) in enumerate(
            zip(slot_t.tolist(), position_t.tolist(), strict=True)
        ):
            seq = seqs.get(slot)
            if seq is None:  # padding, or start-up's measurement
                continue
            cont = greedy_tokens(self.target, seq.prompt + seq.output, block - 1)
            cut = (position * 37 + self.salt) % 97 % block
            for d, t in enumerate(cont):
                out[n, d, t if d < cut else (t + 1) % vocab] = 1.0
        return out
