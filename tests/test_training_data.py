"""The training corpus (training/data.py): licenses picked by metadata, exact and near-duplicate
removal, the split by corpus path, and a packed corpus read back through its manifest."""

from __future__ import annotations

import json
import random
import tarfile

import pytest

from training import data
from training.data import (
    Deduplicator,
    permissive_license,
    spdx_permissive,
    split_documents,
    split_of,
)


class Meta:
    """What importlib.metadata's message object offers the license check."""

    def __init__(self, **fields) -> None:
        self.fields = fields

    def get(self, key, default=None):
        return self.fields.get(key, default)

    def get_all(self, key):
        return self.fields.get(key)


@pytest.mark.parametrize(
    ("expression", "ok"),
    [
        ("MIT", True),
        ("Apache-2.0 OR BSD-2-Clause", True),
        ("Apache-2.0 AND Apache-2.0 WITH LLVM-exception AND BSD-3-Clause", True),
        ("GPL-3.0-only OR MIT", True),  # the MIT branch may be chosen
        ("MPL-2.0 AND (Apache-2.0 OR MIT)", False),  # MPL binds whichever branch
        ("MIT AND GPL-2.0-only", False),
        ("(MIT", False),
        ("MIT OR", False),
        ("LicenseRef-Proprietary", False),
    ],
)
def test_spdx_expressions(expression, ok):
    assert spdx_permissive(expression) is ok


def test_license_metadata_fallbacks_fail_closed():
    assert permissive_license(Meta(**{"License-Expression": "BSD-3-Clause"})) == "BSD-3-Clause"
    classifiers = ["License :: OSI Approved :: MIT License", "Programming Language :: Python"]
    assert permissive_license(Meta(Classifier=classifiers)) == "MIT License"
    mixed = [*classifiers, "License :: OSI Approved :: GNU General Public License v3 (GPLv3)"]
    assert permissive_license(Meta(Classifier=mixed)) is None
    assert permissive_license(Meta(License="BSD")) == "BSD"
    # A license's full text in the License field is not parsed: left out.
    assert (
        permissive_license(Meta(License="Copyright (c) 2015, someone. All rights reserved."))
        is None
    )
    assert permissive_license(Meta()) is None


def _lines(seed: int, n: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [
        f"value_{rng.randrange(10**9)} = compute({rng.randrange(10**6)}, {i})" for i in range(n)
    ]


def test_dedup_drops_exact_and_near_copies_only():
    base = _lines(1)
    text = "\n".join(base) + "\n"
    spaced = "\n".join(line + "   " for line in base) + "\r\n"  # same after normalising
    near = base.copy()
    for i in range(0, 60, 10):  # 6 of 60 lines changed: Jaccard ~0.82
        near[i] = f"changed_{i} = 1"
    far = base.copy()
    for i in range(0, 60, 2):  # half the lines changed: Jaccard ~0.33, a different file
        far[i] = f"other_{i} = 2"
    d = Deduplicator()
    assert not d.seen(text)
    assert d.seen(spaced) and d.exact == 1
    assert d.seen("\n".join(near)) and d.near == 1
    assert not d.seen("\n".join(far))
    assert not d.seen("\n".join(_lines(2)))
    # Small files are compared exactly only: two short files sharing most lines both stay.
    assert not d.seen("import os\nimport sys\n")
    assert not d.seen("import os\nimport sys\nimport re\n")


def _corpus(tmp_path, files: dict[str, str]):
    """An unpacked corpus as `training.data --tar` writes it."""
    root = tmp_path / "corpus"
    entries = []
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
        entries.append({"rel": rel, "source": rel.split("/")[1] if "site" in rel else "stdlib"})
    (root / "manifest.json").write_text(json.dumps({"files": entries}))
    return root


def test_split_is_by_corpus_path(tmp_path, monkeypatch):
    """Held-out by a hash of the whole path, not the file name: same-named files of different
    folders fall in different splits; the fractions are the documented ones; a copy of a
    training file never reaches the held-out split (dedup sees every split)."""
    paths = [f"stdlib/pkg{i}/__init__.py" for i in range(4000)]
    splits = [split_of(p) for p in paths]
    assert splits == [split_of(p) for p in paths]
    share = {s: splits.count(s) / len(splits) for s in ("held_out", "val", "train")}
    assert 0.04 < share["held_out"] < 0.06 and 0.013 < share["val"] < 0.027
    held = next(p for p, s in zip(paths, splits, strict=True) if s == "held_out")
    train = next(p for p, s in zip(paths, splits, strict=True) if s == "train")
    text = "\n".join(_lines(7)) + "\n"
    files = {train: text, held: text}  # the same text under a training and a held-out path
    for i in range(40):
        files[f"site-packages/lib{i}/mod.py"] = "\n".join(_lines(100 + i)) + "\n"
    monkeypatch.setenv("HEADSTART_CORPUS", str(_corpus(tmp_path, files)))
    docs = split_documents()
    kept = {f.rel for split in docs.values() for f, _ in split}
    assert len(kept) == 41 and (train in kept) != (held in kept)
    for split, items in docs.items():
        assert all(split_of(f.rel) == split for f, _ in items)
    # The reading order is a sample of every source, whatever the folders' names.
    order = [f.rel for f in data.candidate_files()]
    assert order != sorted(order)


def test_tar_packs_the_deduplicated_corpus_and_reads_back(tmp_path, monkeypatch):
    """`--tar` from a (fake) standard library, no packages: the tarball holds each kept file
    once and a manifest; unpacked, HEADSTART_CORPUS reads exactly those files, same splits."""
    lib = tmp_path / "lib"
    texts = {f"m{i}.py": "\n".join(_lines(i)) + "\n" for i in range(30)}
    texts["copy.py"] = texts["m3.py"]
    texts["test/test_m.py"] = "\n".join(_lines(99)) + "\n"
    texts["big.py"] = "x = 1\n" * (data.MAX_FILE_BYTES // 6 + 1)  # a generated table: out
    texts["blob.py"] = "x = '" + "a" * 2000 + "'\n"  # a data line: out
    texts["site-packages/other.py"] = "y = 2\n"  # never from inside the stdlib folder
    for rel, text in texts.items():
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text(text)
    monkeypatch.setenv("HEADSTART_STDLIB", str(lib))
    monkeypatch.delenv("HEADSTART_CORPUS", raising=False)
    out = tmp_path / "corpus.tgz"
    data.main(["--tar", str(out), "--no-packages"])
    with tarfile.open(out) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "unpacked", filter="data")
    kept = {n.removeprefix("corpus/") for n in names} - {"manifest.json"}
    assert "corpus/manifest.json" in names and "stdlib/test/test_m.py" in kept
    assert len(kept) == 31 and ("stdlib/m3.py" in kept) != ("stdlib/copy.py" in kept)
    assert not {"stdlib/big.py", "stdlib/blob.py", "stdlib/site-packages/other.py"} & kept
    manifest = json.loads((tmp_path / "unpacked/corpus/manifest.json").read_text())
    assert manifest["dropped"]["exact"] == 1 and manifest["stdlib"]["test_suite"]
    before = {s: [f.rel for f, _ in v] for s, v in split_documents(packages=False).items()}
    monkeypatch.setenv("HEADSTART_CORPUS", str(tmp_path / "unpacked/corpus"))
    after = {s: [f.rel for f, _ in v] for s, v in split_documents().items()}
    assert after == before
