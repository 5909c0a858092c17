import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py builds the reference checkpoints
sys.path.insert(1, str(Path(__file__).parent.parent))  # the training/ package (not installed)

torch.set_num_threads(2)
# Servers the tests start compile no CPU decode steps (a minute of start-up each for a new
# model's shapes): tests/test_cpu_programs.py checks them on purpose.
os.environ.setdefault("HEADSTART_CPU_COMPILE", "off")
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


class Engines:
    """Builds engines: ``engines(model, tokenizer, eos_ids, config, drafter=None)`` takes
    :class:`~headstart.engine.engine.Engine`'s arguments and returns it started
    (``start=False``: the test starts it itself). :meth:`stop_all` stops every one still
    running."""

    def __init__(self) -> None:
        self.made = []

    def __call__(self, *args, start: bool = True, **kwargs):
        from headstart.engine.engine import Engine  # after TRITON_INTERPRET is set (above)

        e = Engine(*args, **kwargs)
        self.made.append(e)
        if start:
            e.start()
        return e

    def stop_all(self) -> None:
        for e in reversed(self.made):
            if e._thread.is_alive():  # started, and not stopped by the test already
                e.stop()


@pytest.fixture
def engines():
    """A factory of started engines, each stopped at teardown whether the test passed or not."""
    made = Engines()
    yield made
    made.stop_all()


@pytest.fixture(scope="module")
def module_engines():
    """:func:`engines` for module-scoped fixtures: stopped when the module's tests are done."""
    made = Engines()
    yield made
    made.stop_all()


@pytest.fixture
def servers():
    """A factory of `headstart serve` processes: ``servers(*args, env=None)`` takes
    :class:`server_proc.ServerProcess`'s arguments (call ``wait_ready()`` as usual); every one
    is stopped at teardown (stopping one the test already stopped does nothing)."""
    from server_proc import ServerProcess

    made = []

    def make(*args: str, env: dict | None = None) -> ServerProcess:
        srv = ServerProcess(*args, env=env)
        made.append(srv)
        return srv

    yield make
    for srv in reversed(made):
        srv.stop()
