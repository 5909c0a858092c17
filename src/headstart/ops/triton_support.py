"""What the Triton kernels share: an optional import (the CPU build of headstart must import
without Triton), the SM count their grids are sized from, and programmatic dependent launch.

Programmatic dependent launch (PDL, Hopper and later): a decode step is a chain of several
hundred kernels, most of them a few microseconds long, so each one's launch latency and first
loads show as a gap. A kernel launched with ``launch_pdl=True`` may start while the kernel before
it is still running; it must then call :func:`pdl_wait` before it reads anything an earlier
kernel writes and before its first global write (weights, which nothing writes during a step,
may be loaded before it: that is the point). :func:`pdl_wait` also lets the next kernel start.
Every kernel waits on its predecessor's completion, so completion stays transitive along the
chain; kernels launched without the attribute (torch's, cuBLAS) serialize as usual. Off in
Triton's CPU interpreter (no inline PTX there), before sm_90, and with ``HEADSTART_PDL=0``."""

from __future__ import annotations

import logging
import os

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU-only machines
    triton = None
    tl = None
    HAVE_TRITON = False

_SM_COUNT: dict[int, int] = {}
_PDL: dict[int, bool] = {}
# Triton's CPU interpreter (TRITON_INTERPRET=1, how the kernels are checked without a GPU).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")

if HAVE_TRITON:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait for the previous kernel to complete (its writes visible), then let the next
        kernel launch. A no-op unless PDL (the launch had ``launch_pdl=True``)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device (cached per device index); 4 off CUDA (Triton's
    CPU interpreter, where only the split logic matters)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch (module doc);
    pass it as both the kernel's ``PDL`` constexpr and its ``launch_pdl`` option."""
    if INTERPRET or device.type != "cuda" or os.environ.get("HEADSTART_PDL", "1") == "0":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _PDL:
        _PDL[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _PDL[idx]


def pdl_options(device: torch.device) -> dict[str, bool]:
    """Launch keywords of a kernel that takes a ``PDL`` constexpr and calls :func:`pdl_wait`."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": on}


def report_late_compiles(log: logging.Logger, limit: int = 20) -> None:
    """From now on, log a warning for each Triton kernel specialization this process compiles
    or loads (the first ``limit`` of them): once start-up has warmed every shape the scheduler
    makes, one is a shape the warm-up missed, whose first request pays for it (a compile, or a
    disk-cache load and an autotuning pass). Autotuning passes from now on print Triton's own
    lines to stdout (``TRITON_PRINT_AUTOTUNING``): a kernel already compiled for every config
    still benchmarks them all at a new autotuning key, which the hook does not see. A no-op
    without Triton's runtime hooks."""
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return
    seen = 0

    def hook(**kw: object) -> None:  # Triton passes keywords: key, repr, fn, compile, ...
        nonlocal seen
        seen += 1
        if seen <= limit:
            log.warning("kernel first used after start-up (not warmed): %s", _specialization(kw))
        if seen == limit:
            log.warning("further kernels first used after start-up are not logged")

    runtime.jit_cache_hook = hook
    autotuning = getattr(knobs, "autotuning", None)
    if autotuning is not None and hasattr(autotuning, "print"):
        autotuning.print = True


def _specialization(kw: dict) -> str:
    """A kernel specialization as Triton's ``jit_cache_hook`` describes it: the kernel's name,
    its warps and stages, each constexpr's value and each argument Triton specialized on (an
    int equal to 1, or divisible by 16; a pointer's alignment): what tells two launches of one
    kernel apart. Triton's own ``repr`` names the arguments' types only."""
    comp = kw.get("compile")
    fn = kw.get("fn")
    if not isinstance(comp, dict):
        return str(kw.get("repr", "?"))[:600]
    names = list(comp.get("signature") or {})

    def name(key: object) -> str:
        i = key[0] if isinstance(key, tuple) and key else key
        return names[i] if isinstance(i, int) and 0 <= i < len(names) else str(key)

    parts = [f"{name(k)}={v}" for k, v in (comp.get("constants") or {}).items()]
    attrs = (comp.get("configs") or [{}])[0] or {}
    parts += [f"{name(k)}:{v}" for k, v in attrs.items()]
    launch = f"warps={comp.get('num_warps')}, stages={comp.get('num_stages')}"
    return f"{getattr(fn, 'name', '?')}[{launch}]({', '.join(parts)})"[:600]
