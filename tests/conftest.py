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


def _interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds a kernel's scalars (program ids, integer arguments) as
    1-element numpy arrays and gives ``tl.range`` their ``int(array)``, which numpy 2.4 refuses
    (ndim > 0): a loop over runtime bounds then fails. Take the element with ``.item()``."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_scalar_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patch_lang_tensor._scalar_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


if os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True"):
    _interpreter_scalar_index()


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
