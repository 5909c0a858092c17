"""Small C kernels for the CPU, built at first use with the machine's compiler and loaded with
ctypes (``ops/quant_matmul/int4_f32.c``, ``ops/attention/decode_f32.c``).

Why plain C files and not a torch C++ extension: compiling a whole extension against torch's
headers takes a minute on a small machine, a plain C file a second; the one C++ file
(:func:`torch_library`, the operators' registrations) includes only torch's core headers.
Each library is built once per source, flags and compiler into headstart's per-user
cache (``HEADSTART_CACHE``, else ``~/.cache/headstart``), with ``-march=native`` (so the cache
is per machine); without a compiler :func:`library` is None and callers keep their PyTorch
path.
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

__all__ = ["cache_root", "function", "library", "torch_library"]

log = logging.getLogger("headstart.kernels")

FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")


def cache_root() -> Path:
    """headstart's per-user cache: ``HEADSTART_CACHE``, else ``~/.cache/headstart``."""
    return Path(os.environ.get("HEADSTART_CACHE") or Path.home() / ".cache" / "headstart")


def _compiler(env: str, *names: str) -> str | None:
    return os.environ.get(env) or next(filter(None, map(shutil.which, names)), None)


def _version(compiler: str) -> bytes:
    return subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout.encode()


def _built(stem: str, key: bytes, build: Callable[[Path, Path], None]) -> Path:
    """The cached library ``stem`` for ``key`` (everything it is built from), made by
    ``build(tmp, target)`` in a scratch folder when it is not there yet."""
    target = cache_root() / "kernels" / f"{stem}-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            build(Path(tmp), built)
            os.replace(built, target)  # atomic: a concurrent build loses nothing
    return target


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)


def library(source: Path) -> ctypes.CDLL | None:
    """``source`` compiled and loaded (callers cache the result), None when it cannot be built
    here (logged)."""
    cc = _compiler("CC", "cc", "gcc")
    if cc is None:
        log.info("no C compiler: %s is not built, the PyTorch path runs instead", source.name)
        return None
    try:
        key = source.read_bytes() + " ".join(FLAGS).encode() + _version(cc)
        target = _built(
            source.stem, key, lambda tmp, out: _run([cc, *FLAGS, str(source), "-o", str(out)])
        )
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("%s did not build (%s): the PyTorch path runs instead", source.name, e)
        return None


def torch_library(cpp: Path, c_sources: tuple[Path, ...]) -> Path | None:
    """``cpp`` (registrations of torch operators' kernels) linked with ``c_sources`` against
    the installed torch, as a library for ``torch.ops.load_library``; None when it cannot be
    built here (logged). Only torch's core headers are included: about 8 s to build on this
    project's 2-core machine, where a whole extension takes a minute."""
    import torch

    cc, cxx = _compiler("CC", "cc", "gcc"), _compiler("CXX", "c++", "g++")
    if cc is None or cxx is None:
        log.info("no C++ compiler: %s is not built, the Python operators run", cpp.name)
        return None
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cxx_flags = [
        "-O2", "-std=c++20", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]  # fmt: skip
    links = [f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}"]

    def build(tmp: Path, out: Path) -> None:
        objects = []
        for src in c_sources:
            objects.append(str(tmp / f"{src.stem}.o"))
            _run([cc, *FLAGS[:2], "-fPIC", "-c", str(src), "-o", objects[-1]])
        _run([cxx, *cxx_flags, str(cpp), *objects, *links, "-o", str(out)])

    try:
        key = b"".join(p.read_bytes() for p in (cpp, *c_sources))
        key += " ".join([*FLAGS, *cxx_flags, torch.__version__]).encode()
        return _built(cpp.stem, key + _version(cc) + _version(cxx), build)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("%s did not build (%s): the Python operators run", cpp.name, e)
        return None


# A C function's parameter kinds, for :func:`function`.
POINTER, INT, INT64, FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


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
