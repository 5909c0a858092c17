"""The CPU kernels' torch operators with their CPU kernels in C++ (``cpu_ops.cpp``).

``headstart::int4_matmul_f32`` and ``headstart::decode_attention_cpu`` are defined in Python,
with Python implementations (which call the C kernels through ctypes) registered as their
CompositeExplicitAutograd kernels. :func:`load` builds ``cpu_ops.cpp`` with the two C files at
first use (:func:`headstart.ops.c_build.torch_library`) and loads it: its CPU kernels then take
precedence over the Python ones, and a traced decode step calls the C kernels without entering
Python. Why: each call through the Python implementation cost about 8 us more (the
interpreter, ctypes' argument conversion), some 30 calls a decode step of the embedded default
model, whose whole step takes about 2 ms (BENCHMARKS.md); and a call that stays in C++ never
waits for the interpreter while the HTTP loop holds it. Without a C++ compiler the Python
implementations run, with the same results.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from headstart.ops import c_build

__all__ = ["load"]

log = logging.getLogger("headstart.kernels")

_HERE = Path(__file__).parent
SOURCE = _HERE / "cpu_ops.cpp"
C_SOURCES = (_HERE / "quant_matmul" / "int4_f32.c", _HERE / "attention" / "decode_f32.c")


@functools.cache
def load() -> bool:
    """Build (first use) and load the C++ kernels; whether they now serve the operators."""
    # The operators' schemas must exist before the library registers kernels for them.
    import headstart.ops.attention.cpu
    import headstart.ops.quant_matmul.cpu_f32  # noqa: F401

    path = c_build.torch_library(SOURCE, C_SOURCES)
    if path is None:
        return False
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        log.warning("%s did not load (%s): the Python operators run", path.name, e)
        return False
    return True
