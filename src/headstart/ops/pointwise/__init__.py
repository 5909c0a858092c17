"""The per-row pieces around the matmuls: :mod:`.reference` (PyTorch, the spec) and
:mod:`.triton` (one kernel per piece, same signatures). Import them explicitly; nothing is
re-exported here."""
