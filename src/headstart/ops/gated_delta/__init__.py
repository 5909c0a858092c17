"""The gated delta rule: :mod:`.reference` (PyTorch recurrent, chunked and one-step forms, the
spec), :mod:`.triton` (the in-place decode step by slot) and :mod:`.fla` (flash-linear-attention's
chunked kernel over packed spans). Import them explicitly; nothing is re-exported here."""
