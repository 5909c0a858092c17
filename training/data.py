"""Training text every machine has: Python source, deduplicated, split by file, tokenized, packed.

The corpus is this Python's standard library *with its test suite* plus the pure-Python files of
installed distributions whose license metadata is permissive (MIT, BSD, Apache-2.0, PSF, ISC,
...; see :func:`permissive_license`). Each file gets a corpus path (``stdlib/json/decoder.py``,
``site-packages/click/core.py``) that decides everything else, so the corpus is the same on any
machine that holds the same files:

- the split: a hash of the corpus path puts the file in ``held_out`` (5%), ``val`` (2%, for early
  stopping) or ``train``; a file is in one split only;
- the order: files are read in the order of another hash of the path, so any prefix of the
  stream (``max_chars``) is a sample of every source, not the standard library's first folders;
- deduplication, over all splits at once in that order: a file whose normalised text was seen
  already is dropped (exact), and so is one whose MinHash signature (of its distinct lines)
  agrees with an earlier kept file's in at least :data:`NEAR_DUPLICATE` of its entries
  (near-duplicates: forks, async/sync twins, per-model copies). Because it runs over every
  split, no held-out file is a copy of a training file.

A machine whose Python lacks the test suite (or the packages) trains on a packed copy:
``python -m training.data --tar corpus.tgz`` writes the deduplicated files and a
``manifest.json`` (sources, versions, licenses, files); unpacked, ``HEADSTART_CORPUS=DIR`` (or
``training.run --corpus DIR``) reads exactly those files. Documents are joined with
``<|endoftext|>`` and cut into fixed-length rows.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import sysconfig
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from headstart.tokenizer import Tokenizer

HELD_OUT = 0.05
VAL = 0.02
MAX_FILE_BYTES = 200_000  # larger .py files are generated tables, not code
MAX_LINE_CHARS = 1_000  # a longer line is data (an encoded blob, a table), not code
PACKAGE_CAP_BYTES = 6_000_000  # no one distribution dominates the corpus
# Estimated Jaccard similarity of two files' sets of distinct lines that counts as a copy.
# Unrelated files share a few percent of their lines; a fork, an async/sync twin or a
# per-model copy (transformers' "Copied from") shares 65-75%.
NEAR_DUPLICATE = 0.6
_MIN_LINES = 20  # files with fewer distinct lines are too small for the estimate to mean much
_PERMS, _BANDS = 128, 32
_PRIME = (1 << 31) - 1

# SPDX ids and the free-text names metadata uses for them. Weak copyleft (MPL, LGPL) is left out
# on purpose: the corpus is redistributed inside the tarball, and these need nothing beyond a
# notice. Unknown or long free-text licenses are left out too (fail closed).
_PERMISSIVE = {
    "mit",
    "mit-cmu",
    "bsd",
    "0bsd",
    "bsd-2-clause",
    "bsd-3-clause",
    "bsd license",
    "bsd 3-clause",
    "apache-2.0",
    "apache 2.0",
    "apache 2.0 license",
    "apache license 2.0",
    "apache software license",
    "psf-2.0",
    "python software foundation license",
    "cnri-python",
    "isc",
    "isc license",
    "isc license (iscl)",
    "zlib",
    "llvm-exception",
    "hpnd",
    "unlicense",
    "bsl-1.0",
    "cc0-1.0",
    "mit license",
}
# Not the training corpus: our own package, and build tooling whose files are mostly vendored.
_SKIP_DISTRIBUTIONS = {"headstart"}
_SKIP_PARTS = {"__pycache__", "site-packages", "_vendor", "vendor", "_vendored"}


@dataclass(frozen=True)
class CorpusFile:
    """One source file: ``rel`` is its corpus path (split, order and dedup key), ``path`` where
    it is read from, ``source`` the distribution it comes from (``stdlib`` or a name)."""

    rel: str
    path: Path
    source: str


def stdlib_root() -> Path:
    """This Python's standard library, or the copy named by ``HEADSTART_STDLIB``."""
    return Path(os.environ.get("HEADSTART_STDLIB") or sysconfig.get_paths()["stdlib"])


def corpus_root() -> Path | None:
    """An unpacked corpus (``--tar``'s output) named by ``HEADSTART_CORPUS``, if any."""
    root = os.environ.get("HEADSTART_CORPUS")
    return Path(root) if root else None


def _hash01(text: str) -> float:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:4], "little") / 2**32


def split_of(rel: str, held_out: float = HELD_OUT, val: float = VAL) -> str:
    """``held_out``, ``val`` or ``train``, from a hash of the corpus path (not the file name:
    the many ``__init__.py`` and ``test_*.py`` of different folders fall where they may)."""
    u = _hash01(rel)
    if u < held_out:
        return "held_out"
    return "val" if u < held_out + val else "train"


def is_held_out(rel: str, fraction: float = HELD_OUT) -> bool:
    return split_of(rel, fraction) == "held_out"


def spdx_permissive(expression: str) -> bool:
    """Whether an SPDX license expression allows use under permissive terms only: ``AND``
    binds tighter than ``OR``, parentheses group, ``X WITH exception`` is as permissive as X
    and its exception. Unknown ids are not permissive."""
    tokens = re.findall(r"\(|\)|[^\s()]+", expression)
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def factor() -> bool:
        if peek() == "(":
            take()
            value = either()
            if take() != ")":
                raise IndexError("unbalanced")
            return value
        value = take().lower() in _PERMISSIVE
        if peek() == "WITH":
            take()
            value = take().lower() in _PERMISSIVE and value
        return value

    def both() -> bool:
        value = factor()
        while peek() == "AND":
            take()
            value = factor() and value
        return value

    def either() -> bool:
        value = both()
        while peek() == "OR":
            take()
            value = both() or value
        return value

    try:
        return either() and pos == len(tokens)
    except IndexError:  # a dangling operator: not an expression we can vouch for
        return False


def permissive_license(meta) -> str | None:
    """The license string that made a distribution's metadata count as permissive, or None.

    ``License-Expression`` (SPDX, :func:`spdx_permissive`) first; then the ``License ::``
    classifiers (all must be permissive); then a short ``License`` field (a long one is the
    license's full text, which is not parsed)."""
    expression = meta.get("License-Expression")
    if expression:
        return expression if spdx_permissive(expression) else None
    classifiers = [
        c.split("::")[-1].strip()
        for c in meta.get_all("Classifier") or []
        if c.startswith("License ::") and c.strip() != "License :: OSI Approved"
    ]
    if classifiers:
        ok = all(c.lower() in _PERMISSIVE for c in classifiers)
        return "; ".join(classifiers) if ok else None
    field = (meta.get("License") or "").strip()
    if field and len(field) <= 40 and field.lower() in _PERMISSIVE:
        return field
    return None


def _keep(path: Path, parts: Iterable[str]) -> bool:
    return (
        path.suffix == ".py"
        and not any(p in _SKIP_PARTS for p in parts)
        and path.is_file()
        and path.stat().st_size <= MAX_FILE_BYTES
    )


def stdlib_sources() -> list[CorpusFile]:
    """Every ``.py`` file of the standard library, its test suite included (half the corpus's
    standard-library bytes, and the corpus is what limits a small model, not compute)."""
    root = stdlib_root()
    out = []
    for p in root.rglob("*.py"):
        parts = p.relative_to(root).parts
        if _keep(p, parts):
            out.append(CorpusFile("stdlib/" + "/".join(parts), p, "stdlib"))
    return out


def package_sources(
    cap_bytes: int = PACKAGE_CAP_BYTES, paths: list[str] | None = None
) -> tuple[list[CorpusFile], list[dict]]:
    """The ``.py`` files of installed distributions with a permissive license (on ``paths``,
    default ``sys.path``), each distribution's files cut at ``cap_bytes`` (taken in hash order,
    so the cut is a sample, not the first folders). Returns the files and one record per
    distribution used: name, version, license (as its metadata says it), files, bytes."""
    import importlib.metadata as md

    files: list[CorpusFile] = []
    used: list[dict] = []
    seen: set[str] = set()
    dists = sorted(
        md.distributions(path=paths or sys.path), key=lambda d: (d.metadata["Name"] or "").lower()
    )
    for dist in dists:
        name = (dist.metadata["Name"] or "").lower()
        if not name or name in seen or name in _SKIP_DISTRIBUTIONS:
            continue
        seen.add(name)
        license_ = permissive_license(dist.metadata)
        if license_ is None or not dist.files:
            continue
        site = Path(str(dist.locate_file(""))).resolve()
        mine = []
        for f in dist.files:
            rel = Path(str(f))
            if rel.parts and rel.parts[0] == "..":
                continue  # scripts installed outside site-packages
            path = site / rel
            if _keep(path, rel.parts):
                mine.append(CorpusFile("site-packages/" + "/".join(rel.parts), path, name))
        mine.sort(key=lambda c: _hash01("cap:" + c.rel))
        kept, total = [], 0
        for c in mine:
            size = c.path.stat().st_size
            if total + size > cap_bytes:
                continue
            kept.append(c)
            total += size
        if kept:
            files.extend(kept)
            used.append(
                {
                    "name": name,
                    "version": dist.version,
                    "license": license_,
                    "files": len(kept),
                    "bytes": total,
                    "files_available": len(mine),
                }
            )
    return files, used


def candidate_files(packages: bool = True) -> list[CorpusFile]:
    """The corpus before deduplication, in reading order: the unpacked corpus's manifest when
    ``HEADSTART_CORPUS`` is set, else this machine's standard library (and packages)."""
    root = corpus_root()
    if root is not None:
        manifest = json.loads((root / "manifest.json").read_text())
        files = [CorpusFile(f["rel"], root / f["rel"], f["source"]) for f in manifest["files"]]
    else:
        files = stdlib_sources() + (package_sources()[0] if packages else [])
    return sorted(files, key=lambda c: (_hash01("order:" + c.rel), c.rel))


def normalise(text: str) -> str:
    """Line endings and trailing whitespace do not make a file different."""
    return "\n".join(line.rstrip() for line in text.splitlines())


def _line_hashes(text: str) -> list[int]:
    """Stable hashes of the distinct stripped lines longer than 3 characters (brackets,
    ``pass`` and blank lines say nothing about where a file came from)."""
    return sorted(
        {zlib.crc32(s.encode()) for line in text.splitlines() if len(s := line.strip()) > 3}
    )


class Deduplicator:
    """Streaming exact and near-duplicate detection: :meth:`seen` says whether a text repeats
    one offered before (and remembers it when it does not). Near duplicates: MinHash of the
    set of distinct lines, 128 permutations in 32 bands of 4 for candidates (LSH), a copy when
    the signatures agree in >= ``threshold`` of their entries."""

    def __init__(self, threshold: float = NEAR_DUPLICATE) -> None:
        gen = torch.Generator().manual_seed(20)
        self.a = torch.randint(1, _PRIME, (_PERMS, 1), generator=gen, dtype=torch.int64)
        self.b = torch.randint(0, _PRIME, (_PERMS, 1), generator=gen, dtype=torch.int64)
        self.threshold = threshold
        self.hashes: set[bytes] = set()
        self.bands: list[dict[bytes, list[int]]] = [{} for _ in range(_BANDS)]
        self.signatures: list[torch.Tensor] = []
        self.exact = self.near = 0

    def signature(self, text: str) -> torch.Tensor | None:
        sh = _line_hashes(text)
        if len(sh) < _MIN_LINES:
            return None
        h = torch.tensor(sh, dtype=torch.int64)[None, :]
        return ((self.a * h + self.b) % _PRIME).min(dim=1).values

    def seen(self, text: str) -> bool:
        norm = normalise(text)
        digest = hashlib.sha1(norm.encode()).digest()
        if digest in self.hashes:
            self.exact += 1
            return True
        sig = self.signature(norm)
        if sig is not None:
            rows = _PERMS // _BANDS
            keys = [sig[i * rows : (i + 1) * rows].numpy().tobytes() for i in range(_BANDS)]
            candidates = {
                j for band, key in zip(self.bands, keys, strict=True) for j in band.get(key, ())
            }
            for j in sorted(candidates):
                if float((self.signatures[j] == sig).float().mean()) >= self.threshold:
                    self.near += 1
                    return True
            index = len(self.signatures)
            self.signatures.append(sig)
            for band, key in zip(self.bands, keys, strict=True):
                band.setdefault(key, []).append(index)
        self.hashes.add(digest)
        return False


def _code_text(path: Path) -> str | None:
    """The file's text, or None when it is not UTF-8, is empty, or holds a data line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    if any(len(line) > MAX_LINE_CHARS for line in text.splitlines()):
        return None
    return text if text.strip() else None


def deduplicated(
    files: Iterable[CorpusFile], stats: dict | None = None
) -> Iterator[tuple[CorpusFile, str]]:
    """``(file, text)`` for each file that is code (:func:`_code_text`) and not a (near) copy of
    one before it. ``stats``, when given, receives the counts of what was dropped and why:
    ``not_code`` (not UTF-8, empty, or a line over :data:`MAX_LINE_CHARS`), ``exact``,
    ``near``."""
    dedup = Deduplicator()
    not_code = 0
    for f in files:
        text = _code_text(f.path)
        if text is None:
            not_code += 1
        elif not dedup.seen(text):
            yield f, text
        if stats is not None:
            stats.update(not_code=not_code, exact=dedup.exact, near=dedup.near)


def documents(
    split: str,
    max_chars: int,
    held_out: float = HELD_OUT,
    packages: bool = True,
    source: str | None = None,
) -> Iterator[str]:
    """The texts of ``split`` (``train``, ``val`` or ``held_out``) in reading order, until
    ``max_chars`` characters have been yielded; ``source`` (e.g. ``"stdlib"``) keeps only the
    files of that source. Dedup sees every split and source, so the same files are dropped
    whichever is asked for."""
    total = 0
    for f, text in deduplicated(candidate_files(packages)):
        if split_of(f.rel, held_out) != split or (source is not None and f.source != source):
            continue
        yield text
        total += len(text)
        if total >= max_chars:
            return


def split_documents(
    max_chars: int = 10**12, packages: bool = True
) -> dict[str, list[tuple[CorpusFile, str]]]:
    """Every split's ``(file, text)`` in reading order from one pass over the corpus, each
    split stopping once it holds ``max_chars`` characters (what :func:`documents` yields)."""
    out: dict[str, list[tuple[CorpusFile, str]]] = {"train": [], "val": [], "held_out": []}
    chars = dict.fromkeys(out, 0)
    for f, text in deduplicated(candidate_files(packages)):
        split = split_of(f.rel)
        if chars[split] >= max_chars:
            if all(c >= max_chars for c in chars.values()):
                break
            continue
        out[split].append((f, text))
        chars[split] += len(text)
    return out


def rows_of(tokenizer: Tokenizer, texts: Iterable[str], seq_len: int) -> torch.Tensor:
    """``[N, seq_len]`` int64 rows of the texts' token stream (each text followed by
    ``<|endoftext|>``; encoded in batches, in parallel, by the Rust tokenizer)."""
    eot = tokenizer.token_to_id("<|endoftext|>")
    stream: list[int] = []
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer.encode_many(batch):
            stream.extend(ids)
            if eot is not None:
                stream.append(eot)
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == 256:
            flush()
    flush()
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.int64).view(n, seq_len)


def token_rows(
    tokenizer: Tokenizer,
    split: str,
    seq_len: int,
    max_chars: int,
    packages: bool = True,
    source: str | None = None,
) -> torch.Tensor:
    """:func:`rows_of` the texts of :func:`documents`."""
    return rows_of(
        tokenizer, documents(split, max_chars, packages=packages, source=source), seq_len
    )


def spread(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` rows taken evenly over ``rows`` (all of them when there are fewer)."""
    if rows.shape[0] <= count:
        return rows
    return rows[torch.linspace(0, rows.shape[0] - 1, count).round().long()]


def evaluation_rows(
    tokenizer: Tokenizer,
    seq_len: int,
    count: int,
    source: str | None = None,
    max_chars: int = 10**12,
    split: str = "held_out",
) -> torch.Tensor:
    """``count`` rows spread evenly over the split's stream (all of it by default, not its
    first files): the rows a run's held-out perplexities, and a later ``training.evaluate``'s,
    are measured on."""
    return spread(token_rows(tokenizer, split, seq_len, max_chars, source=source), count)


def build_manifest(packages: bool = True) -> tuple[dict, list[tuple[CorpusFile, str]]]:
    """The deduplicated corpus of this machine and its manifest (what ``--tar`` packs)."""
    if corpus_root() is not None:
        raise ValueError("HEADSTART_CORPUS is set: pack from the installed sources, not a copy")
    pkg_files, dists = package_sources() if packages else ([], [])
    files = sorted(stdlib_sources() + pkg_files, key=lambda c: (_hash01("order:" + c.rel), c.rel))
    stats: dict = {}
    kept = list(deduplicated(files, stats))
    by_source: dict[str, list[int]] = {}
    for f, text in kept:
        n = by_source.setdefault(f.source, [0, 0])
        n[0] += 1
        n[1] += len(text.encode())
    for d in dists:
        d["files_kept"], d["bytes_kept"] = by_source.get(d["name"], [0, 0])
    manifest = {
        "python": sys.version.split()[0],
        "stdlib": {
            "root": str(stdlib_root()),
            "files_kept": by_source.get("stdlib", [0, 0])[0],
            "bytes_kept": by_source.get("stdlib", [0, 0])[1],
            "test_suite": (stdlib_root() / "test").is_dir(),
        },
        "distributions": dists,
        "candidates": len(files),
        "dropped": stats,
        "split": {"held_out": HELD_OUT, "val": VAL, "rule": "sha1(corpus path)"},
        "files": [{"rel": f.rel, "source": f.source, "split": split_of(f.rel)} for f, _ in kept],
    }
    return manifest, kept


def main(argv: list[str] | None = None) -> None:
    """``python -m training.data --tar OUT.tgz``: pack this machine's deduplicated corpus with
    its manifest for a machine whose Python lacks part of it; there, unpack it and pass
    ``--corpus DIR/corpus`` to ``training.run``. ``--stats``: also count tokens per split."""
    import argparse
    import io
    import tarfile

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--tar", default=None)
    ap.add_argument("--no-packages", action="store_true", help="the standard library only")
    ap.add_argument("--stats", action="store_true", help="tokenize and count (slow: minutes)")
    args = ap.parse_args(argv)
    manifest, kept = build_manifest(not args.no_packages)
    if args.tar:
        with tarfile.open(args.tar, "w:gz") as tar:
            blob = json.dumps(manifest, indent=1).encode()
            info = tarfile.TarInfo("corpus/manifest.json")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
            for f, text in kept:
                data = text.encode()
                info = tarfile.TarInfo(f"corpus/{f.rel}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    per_split: dict[str, list[int]] = {}
    for f, text in kept:
        n = per_split.setdefault(split_of(f.rel), [0, 0])
        n[0] += 1
        n[1] += len(text)
    summary = {
        "files": len(kept),
        "chars_per_split": per_split,
        "dropped": manifest["dropped"],
        "distributions": [
            (d["name"], d["license"], d["files_kept"]) for d in manifest["distributions"]
        ],
    }
    if args.stats:
        from headstart.loading import default_model_dir

        tok = Tokenizer.from_dir(default_model_dir())
        texts: dict[str, list[str]] = {}
        for f, text in kept:
            texts.setdefault(split_of(f.rel), []).append(text)
        summary["tokens_per_split"] = {
            s: sum(len(ids) + 1 for ids in tok.encode_many(t)) for s, t in texts.items()
        }
    if args.tar:
        summary["tar_bytes"] = Path(args.tar).stat().st_size
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
