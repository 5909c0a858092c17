"""flash-linear-attention's autotuning results, read from a log, as FLA's config files.

A server started with ``TRITON_PRINT_AUTOTUNING=1`` prints, for every autotuned kernel and key,
the time the tuning took and the best config. This turns those lines into the files FLA reads
instead of tuning (``{kernel}.json`` with ``autotune_entries``, looked up by the key's hash when
``FLA_CACHE_MODE`` is ``strict``), for ``src/headstart/ops/gated_delta/fla_configs/<GPU>/``, and
prints how many tunings the log holds and the seconds they took.

    python benchmarks/fla_configs.py SERVE_LOG [--out DIR] [--triton-version 3.6.0]

``--fill DIR --from OTHER`` instead adds to DIR's files every key OTHER's files hold and DIR's
do not (DIR's own entries win): a GPU of the same architecture tuned for fewer shapes (the
H100's set held one key a kernel, 27B's plain chunk, so its other shapes tuned at start-up).
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


def fill(into: Path, source: Path) -> dict[str, int]:
    """Add to each ``{kernel}.json`` in ``into`` the entries of ``source``'s file of the same
    kernel whose keys it lacks (a kernel only ``source`` has gets its file); kernel name ->
    entries added."""
    added: dict[str, int] = {}
    for src in sorted(source.glob("*.json")):
        other = json.loads(src.read_text())
        dst = into / src.name
        body = json.loads(dst.read_text()) if dst.exists() else {**other, "autotune_entries": {}}
        entries = body["autotune_entries"]
        new = {h: e for h, e in other["autotune_entries"].items() if h not in entries}
        if new:
            entries.update(new)
            dst.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        added[other["kernel_name"]] = len(new)
    return added


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", nargs="?")
    ap.add_argument("--out", default=None)
    ap.add_argument("--triton-version", default="3.6.0")
    ap.add_argument("--fill", type=Path, default=None, help="a GPU's config folder to add to")
    ap.add_argument("--from", dest="source", type=Path, default=None)
    args = ap.parse_args()
    if args.fill is not None:
        if args.source is None:
            ap.error("--fill needs --from")
        for name, n in fill(args.fill, args.source).items():
            print(f"  {name}: {n} keys added")
        return
    if args.log is None:
        ap.error("a log, or --fill DIR --from OTHER")
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
