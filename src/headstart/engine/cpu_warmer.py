"""``python -m headstart.engine.cpu_warmer``: a model's CPU decode steps compiled into
inductor's cache by a process of their own (see :mod:`headstart.engine.cpu_programs`), for a
server that started without them; the marker it leaves makes the next start compile them at
once. Loads the model as the server did (the same folder and options, the same pool shape)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from headstart.engine.cpu_programs import DecodePrograms


def main(argv: list[str] | None = None) -> int:
    """Compile a model's CPU decode steps into inductor's cache, then leave the marker."""
    from headstart.loading import load

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--context", type=int, required=True)
    ap.add_argument("--marker", type=Path, required=True, help="the file to leave when done")
    ap.add_argument("--taps", default="", help="a drafter's target layers, e.g. 2,4,6")
    ap.add_argument("--verify", default="", help="its verify windows' widths, e.g. 4,8")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    loaded = load(args.model, "cpu", args.dtype, args.kernels, args.load_format)
    pool = loaded.model.new_state_pool(args.slots + 1, args.context)  # + the scratch slot
    taps = tuple(int(t) for t in args.taps.split(",") if t)
    verify = tuple(int(w) for w in args.verify.split(",") if w)
    programs = DecodePrograms(loaded.model, pool, args.slots, args.slots, taps=taps, verify=verify)
    if not programs.complete:
        return 1
    args.marker.parent.mkdir(parents=True, exist_ok=True)
    args.marker.touch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
