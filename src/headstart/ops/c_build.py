"""Small C kernels for the CPU, built at first use with the machine's compiler and loaded with
ctypes (``ops/quant_matmul/int4_f32.c``).

Why not a torch C++ extension: compiling against torch's headers takes a minute on a small
machine, a plain C file a second. Each library is built once per source, flags and compiler
into headstart's per-user cache (``HEADSTART_CACHE``, else ``~/.cache/headstart``), with
``-march=native`` (so the cache is per machine); without a compiler :func:`library` is None and
callers keep their PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["cache_root", "function", "library"]

log = logging.getLogger("headstart.kernels")

FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")


def cache_root() -> Path:
    """headstart's per-user cache: ``HEADSTART_CACHE``, else ``~/.cache/headstart``."""
    return Path(os.environ.get("HEADSTART_CACHE") or Path.home() / ".cache" / "headstart")


def library(source: Path) -> ctypes.CDLL | None:
    """``source`` compiled and loaded (callers cache the result), None when it cannot be built
    here (logged)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: %s is not built, the PyTorch path runs instead", source.name)
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        key = hashlib.sha256(
            source.read_bytes() + " ".join(FLAGS).encode() + version.stdout.encode()
        ).hexdigest()[:16]
        target = cache_root() / "kernels" / f"{source.stem}-{key}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                subprocess.run(
                    [cc, *FLAGS, str(source), "-o", str(built)],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                os.replace(built, target)  # atomic: a concurrent build loses nothing
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("%s did not build (%s): the PyTorch path runs instead", source.name, e)
        return None


# A C function's parameter kinds, for :func:`function`.
POINTER, INT = ctypes.c_void_p, ctypes.c_int


@functools.cache
def function(source: Path, name: str, argtypes: tuple[type, ...]) -> Callable[..., int] | None:
    """``name`` of ``source``'s library (:func:`library`), returning a C int, with
    ``argtypes``; None when the library cannot be built here. Built once per process."""
    lib = library(source)
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int
    fn.argtypes = list(argtypes)
    return fn
