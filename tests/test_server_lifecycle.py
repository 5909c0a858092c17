"""A real `headstart serve` process: connection timeouts, the drain on SIGTERM, start-up refusals.

Timings are measured on loopback with short timeouts; each bound has a lower end too, so that a
connection closed at once (or by the wrong timer) fails as surely as one never closed.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_proc import ServerProcess, free_port

HEADER_TIMEOUT = 2.0
KEEP_ALIVE = 1.0
SLACK = 1.5  # scheduling noise on a loaded 2-core machine

LONG_STREAM = {"prompt": "def f(", "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request):
    """A server for the connection tests, once with each HTTP parser: both carry the policy."""
    srv = ServerProcess(
        "--http-parser",
        request.param,
        "--parallel",
        "2",
        "--context",
        "256",
        "--header-timeout",
        str(HEADER_TIMEOUT),
        "--keep-alive-timeout",
        str(KEEP_ALIVE),
    )
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0, srv.output()


def connect(srv: ServerProcess) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=HEADER_TIMEOUT + KEEP_ALIVE + 10)
    return s


def read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    chunks = []
    try:
        while chunk := s.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def read_response(s: socket.socket) -> bytes:
    """One whole response with a Content-Length body, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "closed mid-body"
        body += chunk
    assert len(body) == length, "more bytes than the response"
    return head + b"\r\n\r\n" + body


def get_health(port: int, extra: bytes = b"") -> bytes:
    return b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n%s\r\n" % (port, extra)


def closed_after(s: socket.socket, start: float) -> tuple[float, bytes]:
    data = read_until_closed(s)
    return time.monotonic() - start, data


@pytest.mark.slow
def test_keep_alive_client_works_and_idle_kept_alive_connection_closes(server):
    with httpx.Client(base_url=server.url) as c:  # a pooled, kept-alive client
        assert [c.get("/health").status_code for _ in range(3)] == [200] * 3
    with connect(server) as s:
        for _ in range(2):  # two requests on one connection
            s.sendall(get_health(server.port))
            assert read_response(s).startswith(b"HTTP/1.1 200")
        idle, data = closed_after(s, time.monotonic())
    assert data == b""
    assert KEEP_ALIVE * 0.7 <= idle <= KEEP_ALIVE + SLACK, idle


@pytest.mark.slow
def test_connection_that_sends_nothing_is_closed(server):
    with connect(server) as s:
        waited, data = closed_after(s, time.monotonic())
    assert data == b""  # nothing was asked, so no 408
    assert HEADER_TIMEOUT * 0.8 <= waited <= HEADER_TIMEOUT + SLACK, waited


@pytest.mark.slow
@pytest.mark.parametrize("partial", [b"GET /hea", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: "])
def test_stalled_request_head_gets_408_and_is_closed(server, partial):
    with connect(server) as s:
        start = time.monotonic()
        s.sendall(partial)
        waited, data = closed_after(s, start)
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert HEADER_TIMEOUT * 0.8 <= waited <= HEADER_TIMEOUT + SLACK, waited


@pytest.mark.slow
def test_trickled_request_head_is_closed(server):
    """A client sending a byte now and then (slowloris) gets no longer than the header timeout."""
    with connect(server) as s:
        start = time.monotonic()
        request = get_health(server.port, b"X-Pad: " + b"a" * 40 + b"\r\n")
        closed = threading.Event()

        def trickle() -> None:
            for byte in request[:-4]:  # never the final CRLFs
                if closed.is_set():
                    return
                try:
                    s.sendall(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.1)

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        waited, data = closed_after(s, start)
        closed.set()
        sender.join()
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert HEADER_TIMEOUT * 0.8 <= waited <= HEADER_TIMEOUT + SLACK, waited


@pytest.mark.slow
def test_stall_after_a_kept_alive_response_is_timed_from_its_first_byte(server):
    with connect(server) as s:
        s.sendall(get_health(server.port))
        assert read_response(s).startswith(b"HTTP/1.1 200")
        time.sleep(KEEP_ALIVE / 2)  # idle, but within the keep-alive timeout
        start = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHo")
        waited, data = closed_after(s, start)
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert HEADER_TIMEOUT * 0.8 <= waited <= HEADER_TIMEOUT + SLACK, waited
    with httpx.Client(base_url=server.url) as c:  # the server still serves
        assert c.get("/health").status_code == 200


@pytest.mark.slow
def test_header_size_bound(server):
    # Above h11's 16 KiB default, below the 64 KiB bound: served. Sent in two parts, because
    # the bound applies only to an incomplete head (a whole one in one read always passes).
    with connect(server) as s:
        head = get_health(server.port, b"X-Big: " + b"a" * (40 << 10) + b"\r\n")
        s.sendall(head[: 30 << 10])
        time.sleep(0.3)
        s.sendall(head[30 << 10 :])
        assert read_response(s).startswith(b"HTTP/1.1 200")
    # 1 MiB of headers: refused once the buffered head passes the bound.
    with connect(server) as s:
        big = get_health(server.port, b"X-Big: " + b"a" * (1 << 20) + b"\r\n")
        # The server may answer and close while we are still sending.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(big)
        data = read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 400 "), data[:200]


@pytest.mark.slow
def test_drain_keeps_serving_503_until_streams_finish_then_exits_0(servers):
    srv = servers("--parallel", "2", "--context", "512", "--shutdown-timeout", "60")
    srv.wait_ready()
    lines: list[str] = []
    with (
        httpx.Client(base_url=srv.url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=LONG_STREAM) as r,
    ):
        assert r.status_code == 200
        checked = False
        for i, line in enumerate(r.iter_lines()):
            if line:
                lines.append(line)
            if i == 2:
                srv.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 5
                while (h := httpx.get(srv.url + "/health", timeout=5)).status_code == 200:
                    assert time.monotonic() < deadline, "/health never turned 503"
                    time.sleep(0.05)
                assert h.status_code == 503
                assert h.json()["status"] == "draining"
                refused = httpx.post(
                    srv.url + "/v1/completions", timeout=5, json={"prompt": "x", "max_tokens": 2}
                )
                assert refused.status_code == 503, refused.text
                assert srv.proc.poll() is None  # still serving while the stream runs
                checked = True
    assert checked
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # whole, not aborted
    assert sum(1 for ch in chunks if ch["choices"] and ch["choices"][0]["text"]) > 300
    srv.proc.wait(15)  # exits by itself once drained
    assert srv.proc.returncode == 0, srv.output()


@pytest.mark.slow
def test_second_signal_exits_at_once(servers):
    srv = servers("--parallel", "2", "--context", "2048", "--shutdown-timeout", "60")
    longer = {**LONG_STREAM, "max_tokens": 1500}  # 15 s or so: far longer than the wait below
    srv.wait_ready()
    with (
        httpx.Client(base_url=srv.url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=longer) as r,
    ):
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert srv.proc.poll() is None  # draining: the stream has 60 s
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(5)
    assert time.monotonic() - start < 5
    assert srv.proc.returncode == 0, srv.output()


def run_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "headstart", "serve", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_line_refusal(done: subprocess.CompletedProcess, port: int) -> None:
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and str(port) in errors[0], out
    assert "serving" not in out and "weights:" not in out, out  # refused before the load


def test_port_out_of_range_is_refused_in_one_line():
    assert_one_line_refusal(run_serve("--port", "99999"), 99999)


def test_busy_port_is_refused_in_one_line():
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        assert_one_line_refusal(run_serve("--port", str(port)), port)


def test_help_shows_the_flags_with_defaults():
    done = subprocess.run(
        [sys.executable, "-m", "headstart", "serve", "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    # One entry per option, argparse's line wrapping undone.
    entries = {
        " ".join(e.split()).split()[0]: " ".join(e.split())
        for e in re.split(r"\n(?=  -)", done.stdout.split("options:", 1)[1])
        if e.strip()
    }
    for flag, default in [
        ("--host", "127.0.0.1"),
        ("--port", "8888"),
        ("--max-body-mib", "8.0"),
        ("--body-timeout", "30.0"),
        ("--header-timeout", "10.0"),
        ("--keep-alive-timeout", "5.0"),
        ("--shutdown-timeout", "10.0"),
        ("--metrics-open", "off"),
        ("--http-parser", "httptools"),
    ]:
        assert flag in entries, sorted(entries)
        assert f"default: {default})" in entries[flag], entries[flag]


def test_start_up_warms_every_parsing_worker_and_each_route_parse(caplog):
    """Before the first request the pool has all its threads (it starts them one a request,
    on the first burst) and each generation route's parse has run, through the real tokenizer
    and chat template; nothing reaches the engine (there is none here). A state whose parse
    fails still starts: the warm-up logs it and returns."""
    import asyncio

    from headstart.engine.config import EngineConfig
    from headstart.engine.engine import Engine
    from headstart.loading import load
    from headstart.server import api
    from headstart.server.metrics import Metrics

    loaded = load()
    # Not started: the checks read its limits only.
    engine = Engine(loaded.model, loaded.tokenizer, loaded.eos_token_ids, EngineConfig(1, 256))
    calls = []
    prepare_chat = api._PREPARE[api.CHAT_PATH][1]

    def counted(state, body):
        calls.append(json.loads(body))
        return prepare_chat(state, body)

    def state(tokenizer):
        return api.ServerState(
            engine=engine,
            tokenizer=tokenizer,
            model_name="m",
            context=256,
            generation_defaults={},
            metrics=Metrics(slots=1),
        )

    warmed = state(loaded.tokenizer)
    original = api._prepare_chat
    api._prepare_chat = counted
    try:
        asyncio.run(api.warm_request_path(warmed))
    finally:
        api._prepare_chat = original
    assert len(warmed.workers._threads) == api.PREP_WORKERS
    assert [c["messages"][0]["role"] for c in calls] == ["user"]
    assert "warming up the request path failed" not in caplog.text  # every parse passed
    broken = state(None)  # every parse fails on the missing tokenizer
    asyncio.run(api.warm_request_path(broken))
    assert len(broken.workers._threads) == api.PREP_WORKERS
    assert "warming up the request path failed" in caplog.text
