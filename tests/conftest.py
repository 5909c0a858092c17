import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py builds the reference checkpoints
sys.path.insert(1, str(Path(__file__).parent.parent))  # the training/ package (not installed)

torch.set_num_threads(2)
if not torch.cuda.is_available():
    # Triton kernels (where Triton is installed) run on the CPU through Triton's interpreter;
    # read when a kernel is defined, so it must be set before headstart.ops imports Triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
