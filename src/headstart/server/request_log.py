"""Append-only request log: one JSON line per finished request, safe to share.

:class:`RequestLog` appends each record as one whole line with a single ``write(2)`` on a
descriptor opened with ``O_APPEND``, so lines from many threads and from several processes
(workers sharing one file) never interleave or overwrite each other; a lock serialises the
threads of one process. :func:`request_record` builds the record from counts, timings and
outcome only: it has no parameter for prompt text, output text or API keys, so none can
reach the log by mistake. Non-goals: rotation (use logrotate with ``copytruncate`` or reopen
via a new :class:`RequestLog`), buffering, and reading the log back.
"""

from __future__ import annotations

import json
import os
import threading
import time as _time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

__all__ = ["RECORD_FIELDS", "RequestLog", "request_record"]

#: The fields of a record, in order. None of them can hold request or response text.
RECORD_FIELDS = (
    "time",
    "id",
    "endpoint",
    "status",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "ttft_s",
    "duration_s",
    "finish_reason",
    "error",
    "n",
    "stream",
)


def request_record(
    *,
    id: str,
    endpoint: str,
    status: int,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    cached_tokens: int = 0,
    ttft_s: float | None = None,
    duration_s: float | None = None,
    finish_reason: str | Sequence[str] | None = None,
    error: str | None = None,
    n: int = 1,
    stream: bool = False,
    time: float | None = None,
) -> dict[str, Any]:
    """One log record (keys in :data:`RECORD_FIELDS` order).

    ``time`` is a Unix timestamp (default: now), written as ISO 8601 UTC with milliseconds.
    ``finish_reason`` is one reason, or one per choice when ``n > 1``; ``error`` is the
    error type of a failed request (``None`` on success). Timings are rounded to 0.1 ms.
    """
    when = datetime.fromtimestamp(_time.time() if time is None else time, tz=UTC)
    reason: str | list[str] | None
    reason = (
        finish_reason
        if finish_reason is None or isinstance(finish_reason, str)
        else [str(r) for r in finish_reason]
    )

    def seconds(value: float | None) -> float | None:
        return None if value is None else round(float(value), 4)

    return {
        "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "id": str(id),
        "endpoint": str(endpoint),
        "status": int(status),
        "prompt_tokens": int(prompt_tokens),
        "completion_tokens": int(completion_tokens),
        "cached_tokens": int(cached_tokens),
        "ttft_s": seconds(ttft_s),
        "duration_s": seconds(duration_s),
        "finish_reason": reason,
        "error": error,
        "n": int(n),
        "stream": bool(stream),
    }


class RequestLog:
    """An open JSON-lines log file (created with mode 0600 if missing).

    :meth:`write` may be called from any thread; several processes may hold their own
    ``RequestLog`` on the same path. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd: int | None = os.open(
            self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one JSON line (build it with :func:`request_record`)."""
        # The whole line is built before the write: one write(2) with O_APPEND puts it at
        # the end of the file as a unit, even with other processes appending concurrently.
        data = (
            json.dumps(record, ensure_ascii=True, separators=(",", ":"), default=str) + "\n"
        ).encode("ascii")
        if os.getpid() != self._pid:
            # A forked child inherits the lock in whatever state a parent thread left it.
            self._lock = threading.Lock()
            self._pid = os.getpid()
        with self._lock:
            if self._fd is None:
                raise ValueError("write to a closed RequestLog")
            view = memoryview(data)
            while view:  # regular files take the whole write; loop only on a short write
                written = os.write(self._fd, view)
                view = view[written:]

    def close(self) -> None:
        """Close the file; later writes raise ValueError."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> RequestLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
