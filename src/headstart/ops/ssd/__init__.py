"""Nemotron-H's Mamba2 mixer core (causal conv with bias, dt, the SSD scan, the grouped gated
norm): :mod:`.reference` (PyTorch, the spec future kernels are tested against). Import it
explicitly; nothing is re-exported here."""
