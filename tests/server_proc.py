"""Start a real `headstart serve` process on loopback for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"headstart-test-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - held until stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "headstart", "serve", "--port", str(self.port), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout: float = 60) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(self.output())

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextmanager
def serving(*args: str, env: dict | None = None) -> Iterator[ServerProcess]:
    """A ready `headstart serve` process for the block (module fixtures); on leaving, it is
    stopped and must have exited 0 (a drained shutdown)."""
    srv = ServerProcess(*args, env=env)
    try:
        yield srv.wait_ready()
    finally:
        assert srv.stop() == 0, srv.output()
