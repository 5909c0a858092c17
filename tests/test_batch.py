"""ForwardBatch: the shapes the layers dispatch on, and the invariants that keep them apart."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from headstart.batch import ForwardBatch, SeqChunk


def test_build_sorts_every_chunk_into_exactly_one_shape():
    b = ForwardBatch.build(
        [
            SeqChunk(0, 5, (1,)),
            SeqChunk(1, 0, (2, 3, 4)),
            SeqChunk(2, 7, (5, 6, 7), parents=(-1, 0, 0)),
            SeqChunk(3, 9, (8,), record=True),
        ]
    )
    assert b.decode.slots.tolist() == [0]
    assert [s.slot for s in b.multi_row] == [1, 3]  # a recorded single row runs as a span
    assert [s.slot for s in b.trees] == [2]
    assert b.all_decode is None


def test_inconsistent_batches_are_refused():
    b = ForwardBatch.build([SeqChunk(0, 0, (1, 2))])
    with pytest.raises(ValueError, match="multi packs"):
        dataclasses.replace(b, multi=None)
    with pytest.raises(ValueError, match="every span"):
        dataclasses.replace(b, spans=b.spans * 2)
    w = ForwardBatch.windows_of(
        torch.zeros(4, dtype=torch.int64), torch.tensor([0, 1]), torch.tensor([3, 4]), 2
    )
    with pytest.raises(ValueError, match="windows"):
        dataclasses.replace(w, spans=b.spans)
