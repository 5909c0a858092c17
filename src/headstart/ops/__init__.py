"""Tensor operations of the model, each a pure function over packed rows and state pools.

The functions here are the reference implementations (pure PyTorch, run anywhere); GPU kernels of a
later stage implement the same signatures and are tested against these.
"""
