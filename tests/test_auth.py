"""Tests for headstart.server.auth: key file checks, bearer checks, reload."""

from __future__ import annotations

import os
import threading

import pytest

from headstart.errors import HeadstartError
from headstart.server.auth import ApiKeys, KeyFileError


def key_file(tmp_path, text: str, mode: int = 0o600, name: str = "keys"):
    path = tmp_path / name
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_loads_keys_skipping_blanks_and_comments(tmp_path):
    keys = ApiKeys(key_file(tmp_path, "# admin keys\n\n  sk-one  \n#sk-commented\nsk-two\n"))
    assert len(keys) == 2
    assert keys.check("Bearer sk-one")
    assert keys.check("Bearer sk-two")
    assert not keys.check("Bearer #sk-commented")


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_owner_only_modes_accepted(tmp_path, mode):
    assert len(ApiKeys(key_file(tmp_path, "k\n", mode))) == 1


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o602, 0o620])
def test_group_or_other_access_refused(tmp_path, mode):
    path = key_file(tmp_path, "k\n", mode)
    with pytest.raises(KeyFileError) as info:
        ApiKeys(path)
    message = str(info.value)
    assert f"{mode:04o}" in message
    assert str(path) in message
    assert isinstance(info.value, HeadstartError)


def test_missing_empty_and_directory_refused(tmp_path):
    with pytest.raises(KeyFileError, match="not found"):
        ApiKeys(tmp_path / "nope")
    with pytest.raises(KeyFileError, match="no keys"):
        ApiKeys(key_file(tmp_path, "# only a comment\n\n   \n"))
    directory = tmp_path / "dir"
    directory.mkdir(mode=0o700)
    with pytest.raises(KeyFileError):
        ApiKeys(directory)


def test_key_with_inner_whitespace_refused_without_echoing_it(tmp_path):
    with pytest.raises(KeyFileError, match="line 2") as info:
        ApiKeys(key_file(tmp_path, "good\nsecret part\n"))
    assert "secret" not in str(info.value)


@pytest.mark.parametrize(
    "header, ok",
    [
        ("Bearer sk-good", True),
        ("bearer sk-good", True),  # the scheme is case-insensitive (RFC 7235)
        ("Bearer   sk-good  ", True),
        ("Bearer sk-bad", False),
        ("Bearer sk-goo", False),  # a prefix is not a match
        ("Bearer sk-good2", False),
        (None, False),
        ("", False),
        ("Bearer", False),
        ("Bearer ", False),
        ("Basic sk-good", False),
        ("sk-good", False),
        ("Token sk-good", False),
    ],
)
def test_check(tmp_path, header, ok):
    keys = ApiKeys(key_file(tmp_path, "sk-good\nsk-other\n"))
    assert keys.check(header) is ok


def test_check_compares_every_key(tmp_path, monkeypatch):
    # No early exit: the number of comparisons must not depend on which key matched.
    import headstart.server.auth as auth

    calls = []
    real = auth.hmac.compare_digest

    def counting(a, b):
        calls.append(1)
        return real(a, b)

    keys = ApiKeys(key_file(tmp_path, "a\nb\nc\nd\n"))
    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for header in ("Bearer a", "Bearer d", "Bearer zzz"):
        calls.clear()
        keys.check(header)
        assert len(calls) == 4


def test_reload_picks_up_new_keys(tmp_path):
    path = key_file(tmp_path, "old\n")
    keys = ApiKeys(path)
    path.write_text("new1\nnew2\n")
    assert keys.reload() == 2
    assert keys.check("Bearer new1") and keys.check("Bearer new2")
    assert not keys.check("Bearer old")


def test_reload_keeps_old_keys_when_new_file_is_bad(tmp_path):
    path = key_file(tmp_path, "old\n")
    keys = ApiKeys(path)
    path.write_text("# emptied\n")
    with pytest.raises(KeyFileError):
        keys.reload()
    assert keys.check("Bearer old")
    path.write_text("new\n")
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="0644"):
        keys.reload()
    assert keys.check("Bearer old") and not keys.check("Bearer new")
    path.unlink()
    with pytest.raises(KeyFileError):
        keys.reload()
    assert keys.check("Bearer old")


def test_concurrent_reload_and_check(tmp_path):
    path = key_file(tmp_path, "stable\n")
    keys = ApiKeys(path)
    failures = []

    def checker():
        for _ in range(300):
            if not keys.check("Bearer stable"):
                failures.append(1)

    threads = [threading.Thread(target=checker) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(30):
        keys.reload()
    for t in threads:
        t.join()
    assert not failures
