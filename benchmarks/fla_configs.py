"""flash-linear-attention's autotuning results, read from a log, as FLA's config files.

A server started with ``TRITON_PRINT_AUTOTUNING=1`` prints, for every autotuned kernel and key,
the time the tuning took and the best config. This turns those lines into the files FLA reads
instead of tuning (``{kernel}.json`` with ``autotune_entries``, looked up by the key's hash when
``FLA_CACHE_MODE`` is ``strict``), for ``src/headstart/ops/gated_delta/fla_configs/<GPU>/``, and
prints how many tunings the log holds and the seconds they took.

    python benchmarks/fla_configs.py SERVE_LOG [--out DIR] [--triton-version 3.6.0]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
from pathlib import Path

_ENTRY = re.compile(
    r"Triton autotuning for function (\w+),\s*with key as (.*?),\s*finished after ([\d.]+)s,"
    r"\s*best config selected: (.*?);",
    re.S,
)


def _config(text: str) -> dict:
    """``BV: 32, num_warps: 4, num_ctas: 1, num_stages: 2, maxnreg: None`` (triton.Config's
    str) as FLA's config dict."""
    fields = dict(part.split(": ", 1) for part in text.split(", "))
    meta = {k: fields.pop(k) for k in ("num_warps", "num_ctas", "num_stages", "maxnreg")}
    return {
        "kwargs": {k: ast.literal_eval(v) for k, v in fields.items()},
        "num_warps": int(meta["num_warps"]),
        "num_ctas": int(meta["num_ctas"]),
        "num_stages": int(meta["num_stages"]),
        "maxnreg": None if meta["maxnreg"] == "None" else int(meta["maxnreg"]),
    }


def _key_hash(key: list) -> str:
    """FLA's ``AutotuneKey.key_hash`` (fla/ops/utils/cache.py): md5 of the compact, sorted JSON."""
    return hashlib.md5(json.dumps(key, separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def parse(log: str) -> tuple[dict[str, dict], float, int]:
    """Kernel name -> {key hash: entry}, seconds of tuning, tunings in the log."""
    files: dict[str, dict] = {}
    seconds, count = 0.0, 0
    for name, key, took, best in _ENTRY.findall(log):
        key_list = json.loads(json.dumps(list(ast.literal_eval(key))))  # tuples -> lists
        entry = {"autotune_key": key_list, "config": _config(best.strip())}
        files.setdefault(name, {})[_key_hash(key_list)] = entry
        seconds += float(took)
        count += 1
    return files, seconds, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--out", default=None)
    ap.add_argument("--triton-version", default="3.6.0")
    args = ap.parse_args()
    files, seconds, count = parse(Path(args.log).read_text(errors="replace"))
    print(f"{count} tunings of {len(files)} kernels, {seconds:.1f} s in all")
    for name, entries in sorted(files.items()):
        print(f"  {name}: {len(entries)} keys")
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            body = {
                "kernel_name": name,
                "triton_version": args.triton_version,
                "autotune_entries": entries,
            }
            (out / f"{name}.json").write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
