"""GDN's causal depthwise conv: :mod:`.reference` (PyTorch, the spec; the decode step's kernel is
``pointwise.triton.conv_step_rows``). Import it explicitly; nothing is re-exported here."""
