"""Tests for headstart.server.request_log: whole JSON lines under thread/process concurrency."""

from __future__ import annotations

import inspect
import json
import multiprocessing
import os
import threading
from datetime import datetime

import pytest

from headstart.server.request_log import RECORD_FIELDS, RequestLog, request_record

_FORBIDDEN = {
    "prompt",
    "messages",
    "text",
    "content",
    "output",
    "key",
    "api_key",
    "authorization",
    "reasoning",
}


def _record(i: int, **kw) -> dict:
    return request_record(
        id=f"chatcmpl-{i}",
        endpoint="/v1/chat/completions",
        status=200,
        prompt_tokens=i,
        completion_tokens=2 * i,
        cached_tokens=1,
        ttft_s=0.012345678,
        duration_s=1.5,
        finish_reason="stop",
        n=1,
        stream=bool(i % 2),
        **kw,
    )


def test_record_fields_and_format():
    rec = _record(3, time=0.0)
    assert tuple(rec) == RECORD_FIELDS
    assert rec["time"] == "1970-01-01T00:00:00.000Z"
    assert datetime.fromisoformat(rec["time"]).utcoffset().total_seconds() == 0
    assert rec["ttft_s"] == 0.0123
    assert rec["error"] is None
    failed = request_record(
        id="x", endpoint="/v1/completions", status=400, error="invalid_request_error"
    )
    assert failed["finish_reason"] is None and failed["error"] == "invalid_request_error"
    multi = request_record(
        id="x", endpoint="/v1/completions", status=200, n=2, finish_reason=("stop", "length")
    )
    assert multi["finish_reason"] == ["stop", "length"]


def test_record_cannot_carry_text():
    # No parameter of request_record can take request/response text or keys.
    params = set(inspect.signature(request_record).parameters)
    assert not params & _FORBIDDEN
    assert not set(RECORD_FIELDS) & _FORBIDDEN


def test_file_created_owner_only(tmp_path):
    path = tmp_path / "requests.jsonl"
    with RequestLog(path) as log:
        log.write(_record(1))
    assert os.stat(path).st_mode & 0o077 == 0
    written = json.loads(path.read_text())
    assert written == _record(1) | {"time": written["time"]}


def test_appends_to_existing_file(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"earlier": true}\n')
    with RequestLog(path) as log:
        log.write(_record(1))
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"earlier": True}
    assert json.loads(lines[1])["id"] == "chatcmpl-1"


def test_write_after_close_raises(tmp_path):
    log = RequestLog(tmp_path / "r.jsonl")
    log.close()
    log.close()  # idempotent
    with pytest.raises(ValueError):
        log.write(_record(1))


def _check_lines(path, expected_ids: set[str]) -> None:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    lines = data.decode().split("\n")[:-1]
    assert len(lines) == len(expected_ids)
    seen = set()
    for line in lines:
        rec = json.loads(line)  # every line is one whole JSON object
        assert tuple(rec) == RECORD_FIELDS
        assert not set(rec) & _FORBIDDEN
        seen.add(rec["id"])
    assert seen == expected_ids


def test_64_threads_write_whole_lines(tmp_path):
    path = tmp_path / "requests.jsonl"
    per_thread = 20
    log = RequestLog(path)
    barrier = threading.Barrier(64)

    def worker(t: int) -> None:
        barrier.wait()
        for j in range(per_thread):
            # A long field makes lines big enough that interleaving would show.
            log.write(_record(t * 1000 + j, error="x" * 3000 if j % 5 == 0 else None))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    log.close()
    _check_lines(path, {f"chatcmpl-{t * 1000 + j}" for t in range(64) for j in range(per_thread)})


def _process_worker(path: str, proc: int, count: int) -> None:
    with RequestLog(path) as log:
        for j in range(count):
            log.write(_record(proc * 10_000 + j, error="y" * 5000 if j % 3 == 0 else None))


def test_processes_append_whole_lines(tmp_path):
    path = tmp_path / "requests.jsonl"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_process_worker, args=(str(path), p, 100)) for p in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    _check_lines(path, {f"chatcmpl-{p * 10_000 + j}" for p in range(4) for j in range(100)})
