"""Attention: :mod:`.reference` (PyTorch, the spec) and :mod:`.triton` (flash-decoding from the
KV pool). Import them explicitly; nothing is re-exported here."""
