"""Training text every machine has: the Python standard library's source, tokenized and packed.

Files are read in a fixed order; a file goes to the held-out split iff a hash of its relative
path falls in the held-out fraction, so the split is the same on every machine with the same
Python version. Documents are joined with ``<|endoftext|>`` and cut into fixed-length rows.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

from headstart.tokenizer import Tokenizer


def stdlib_root() -> Path:
    """This Python's standard library, or the copy named by ``HEADSTART_STDLIB`` (some system
    Pythons ship it without its test suite, a third of the corpus)."""
    return Path(os.environ.get("HEADSTART_STDLIB") or sysconfig.get_paths()["stdlib"])


def stdlib_files(max_bytes: int = 200_000) -> list[Path]:
    """Every ``.py`` file of the standard library, its test suite included (it triples the
    data, and the corpus is what limits a small model here, not compute); files over
    ``max_bytes`` are generated tables, not code, and are left out."""
    root = stdlib_root()
    skip = ("site-packages", "__pycache__")
    return sorted(
        p
        for p in root.rglob("*.py")
        if not any(part in skip for part in p.relative_to(root).parts)
        and p.stat().st_size <= max_bytes
    )


def is_held_out(path: Path, fraction: float) -> bool:
    digest = hashlib.sha1(path.name.encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < fraction


def documents(split: str, max_chars: int, held_out: float = 0.05) -> Iterator[str]:
    total = 0
    for path in stdlib_files():
        if is_held_out(path, held_out) != (split == "held_out"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        total += len(text)
        if total >= max_chars:
            return


def token_rows(tokenizer: Tokenizer, split: str, seq_len: int, max_chars: int) -> torch.Tensor:
    """``[N, seq_len]`` int64 rows of the split's token stream."""
    eot = tokenizer.token_to_id("<|endoftext|>")
    stream: list[int] = []
    for doc in documents(split, max_chars):
        stream.extend(tokenizer.encode(doc))
        if eot is not None:
            stream.append(eot)
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.int64).view(n, seq_len)


def main(argv: list[str] | None = None) -> None:
    """``python -m training.data --tar OUT.tgz``: pack this machine's corpus (the files
    :func:`stdlib_files` picks) for a machine whose Python lacks part of its standard library;
    there, unpack it and pass ``--stdlib DIR/stdlib`` to ``training.run``."""
    import argparse
    import tarfile

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--tar", required=True)
    args = ap.parse_args(argv)
    root = stdlib_root()
    files = stdlib_files()
    with tarfile.open(args.tar, "w:gz") as tar:
        for f in files:
            tar.add(f, arcname=f"stdlib/{f.relative_to(root)}")
    print(f"{len(files)} files from {root} -> {args.tar}")


if __name__ == "__main__":
    main()
