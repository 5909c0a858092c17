"""API keys for the server: loading ``--api-key-file`` and checking ``Authorization`` headers.

The key file holds one key per line (surrounding whitespace stripped; blank lines and lines
starting with ``#`` skipped). It must be a regular file that neither group nor others may read
or write, like an SSH private key; anything else is refused with :class:`KeyFileError`, so a
leaked-by-permissions key file stops the server from starting instead of being used. Keys are
compared in constant time against every key (SHA-256 digests compared with
``hmac.compare_digest``, no early exit), so response timing reveals neither which key matched
nor how long a matching prefix was. :meth:`ApiKeys.reload` swaps in a re-read file atomically
and keeps the old keys when the new file is invalid. Non-goals: per-key permissions or rate
limits, keys on the command line or in the environment, and HTTP handling (the app turns a
failed check into a 401).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import threading
from pathlib import Path

from headstart.errors import HeadstartError

__all__ = ["ApiKeys", "KeyFileError"]


class KeyFileError(HeadstartError):
    """The API key file is missing, unreadable, too permissive, or holds no keys."""


def _digest(key: str) -> bytes:
    # Comparing fixed-length digests keeps compare_digest's running time independent of the
    # presented key's length as well as its content.
    return hashlib.sha256(key.encode("utf-8")).digest()


def _load_keys(path: Path) -> tuple[bytes, ...]:
    try:
        # Check the mode of the file actually opened (fstat), not of whatever the path names
        # a moment later. O_NONBLOCK: a FIFO at the path must not hang the open.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise KeyFileError(f"{path}: API key file not found") from None
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot open API key file ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"{path}: API key file is not a regular file")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o077:
            raise KeyFileError(
                f"{path}: API key file has mode {mode:04o}, readable or writable by group or "
                f"others; restrict it to its owner (chmod 600 {path})"
            )
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        raw = b"".join(chunks)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read API key file ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise KeyFileError(f"{path}: API key file is not UTF-8 text") from None
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if any(ch.isspace() for ch in key):
            # "Authorization: Bearer KEY" can never carry such a key; say where, not what.
            raise KeyFileError(f"{path}: line {number}: an API key may not contain whitespace")
        keys.append(_digest(key))
    if not keys:
        raise KeyFileError(f"{path}: API key file holds no keys")
    return tuple(keys)


class ApiKeys:
    """The set of accepted API keys, loaded from a key file (see the module docstring).

    Thread-safe: :meth:`check` reads an immutable snapshot, :meth:`reload` replaces it under
    a lock, so a reload triggered from a signal handler (via the event loop) or another
    thread never exposes a half-loaded set.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Load ``path``; raises :class:`KeyFileError` when it is unusable."""
        self._path = Path(path)
        self._lock = threading.Lock()
        self._digests = _load_keys(self._path)

    @property
    def path(self) -> Path:
        """The key file."""
        return self._path

    def __len__(self) -> int:
        return len(self._digests)

    def check(self, authorization_header: str | None) -> bool:
        """True iff the header is ``Bearer KEY`` (scheme case-insensitive) with a known key.

        Every key is compared, whatever the outcome, so the time taken does not depend on
        which key (if any) matched.
        """
        if not authorization_header:
            return False
        scheme, _, token = authorization_header.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return False
        presented = _digest(token)
        matched = False
        for digest in self._digests:  # one snapshot; reload() swaps the whole tuple
            matched |= hmac.compare_digest(presented, digest)
        return matched

    def reload(self) -> int:
        """Re-read the key file and return the number of keys now accepted.

        If the file has become invalid the current keys stay in force and the
        :class:`KeyFileError` is raised for the caller to report.
        """
        with self._lock:
            digests = _load_keys(self._path)
            self._digests = digests
            return len(digests)
