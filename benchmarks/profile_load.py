"""Where a model load goes (GPU): ``headstart.loading.load`` as ``serve`` calls it, with random
weights at a checkpoint folder's shapes, under cProfile, in a fresh Triton cache (a cold
machine's compiles) unless ``--warm``.

    python benchmarks/profile_load.py /tmp/m-27b [--prefill-weights dense] [--top 25]

Prints the top functions by cumulative time, then the load's wall time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import tempfile
import time


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prefill-weights", default="auto", choices=("auto", "dense", "packed"))
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warm", action="store_true", help="keep Triton's cache as it is")
    args = ap.parse_args()
    if not args.warm:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    started = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    import torch  # noqa: F401  (its import is part of what is timed)

    from headstart.loading import load

    first = time.perf_counter()
    loaded = load(args.model, args.device, None, "auto", "dummy", args.prefill_weights)
    sync(args.device)
    prof.disable()
    cold = time.perf_counter() - first
    imports = first - started
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats("cumulative")
    stats.print_stats(args.top)
    print("\n".join(line[:160] for line in out.getvalue().splitlines()))
    print(f"imports {imports:.1f}s; load {cold:.1f}s ({type(loaded.model).__name__})")


if __name__ == "__main__":
    main()
