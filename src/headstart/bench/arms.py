"""Arms: the servers being compared, given as a URL or as a command that starts one.

Job: parse ``--arm NAME=URL`` / ``--arm 'NAME=cmd:COMMAND'``, start a command arm as a fresh
process on a free loopback port (``{port}`` in the command is replaced; ``{python}`` becomes
this interpreter), wait until ``/health`` or ``/v1/models`` answers 200, and stop it again
(SIGTERM to its process group, SIGKILL after a grace period). Also asks a ready server for the
model id it serves.

Non-goals: sending the workload (``client.py``); recording the environment (``env.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from headstart.errors import HeadstartError

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")
#: The arm used when none is given: the embedded default model, served by this install.
DEFAULT_ARM = "headstart=cmd:{python} -m headstart serve --port {port}"


@dataclass(frozen=True)
class ArmSpec:
    """One arm: exactly one of ``url`` (a running server) or ``command`` (a template)."""

    name: str
    url: str | None = None
    command: str | None = None

    def argv(self, port: int) -> list[str]:
        """The command with ``{port}`` and ``{python}`` filled in."""
        assert self.command is not None
        return [
            a.replace("{port}", str(port)).replace("{python}", sys.executable)
            for a in shlex.split(self.command)
        ]

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "command": self.command}


def parse_arm(text: str, index: int) -> ArmSpec:
    """``NAME=URL``, ``NAME=cmd:COMMAND``, or either without ``NAME=`` (named ``armN``)."""
    name, sep, value = text.partition("=")
    if not sep or not _NAME.match(name) or name.startswith(("http", "cmd:")):
        name, value = f"arm{index + 1}", text
    if value.startswith("cmd:"):
        command = value[4:].strip()
        if "{port}" not in command:
            raise HeadstartError(
                f"arm {name!r}: the command must contain {{port}} so each "
                "fresh process gets a free port"
            )
        shlex.split(command)  # fail now on unbalanced quotes
        return ArmSpec(name, command=command)
    if value.startswith(("http://", "https://")):
        return ArmSpec(name, url=value.rstrip("/"))
    raise HeadstartError(
        f"--arm {text!r}: expected NAME=http://HOST:PORT or 'NAME=cmd:COMMAND ... --port {{port}}'"
    )


def parse_arms(texts: list[str]) -> list[ArmSpec]:
    arms = [parse_arm(t, i) for i, t in enumerate(texts or [DEFAULT_ARM])]
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise HeadstartError(f"arm names must be distinct, got {names}")
    return arms


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(
    url: str, timeout: float, proc: subprocess.Popen | None = None, log_path: Path | None = None
) -> None:
    """Poll ``/health`` then ``/v1/models`` until one answers 200. Raises HeadstartError with
    the log's tail if the process exits first or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise HeadstartError(
                f"{url}: the server exited with status {proc.returncode} "
                f"before it was ready{_tail(log_path)}"
            )
        for path in ("/health", "/v1/models"):
            try:
                if _get(url + path, {}, timeout=2)[0] == 200:
                    return
            except OSError:  # refused, reset, timed out: not up yet
                pass
        time.sleep(0.2)
    raise HeadstartError(f"{url}: not ready after {timeout:.0f} s{_tail(log_path)}")


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, headers: dict[str, str], timeout: float) -> tuple[int, bytes]:
    """(status, body) of a GET; raises OSError when no response came (urllib's HTTPError,
    a response with an error status, is returned as its status instead). No proxy from the
    environment: the arms are servers this machine reaches directly."""
    try:
        with _OPENER.open(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _tail(log_path: Path | None, lines: int = 20) -> str:
    if log_path is None or not log_path.exists():
        return ""
    text = log_path.read_text(errors="replace").splitlines()[-lines:]
    return f"; last lines of {log_path}:\n" + "\n".join(text)


def server_info(url: str, headers: dict[str, str]) -> dict[str, Any]:
    """``/v1/models`` (and ``/health`` if there is one) of a ready server; never raises."""
    info: dict[str, Any] = {}
    for path in ("/v1/models", "/health"):
        try:
            status, body = _get(url + path, headers, timeout=10)
            info[path] = json.loads(body) if status == 200 else {"status": status}
        except (OSError, ValueError) as e:
            info[path] = {"error": f"{type(e).__name__}: {e}"}
    return info


def model_id(info: dict[str, Any]) -> str | None:
    """The first model id listed by ``/v1/models``; None if the server lists none."""
    data = info.get("/v1/models", {}).get("data") or []
    return str(data[0]["id"]) if data and isinstance(data[0], dict) and "id" in data[0] else None


class ArmProcess:
    """A command arm's server process, started fresh for one order."""

    def __init__(self, spec: ArmSpec, log_path: Path) -> None:
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = spec.argv(self.port)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - held until stop()
        try:
            # Own session: stop() signals the whole group, so servers that fork workers
            # (vLLM, SGLang) do not leave them behind.
            self.proc = subprocess.Popen(
                self.argv,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as e:
            self._log.close()
            raise HeadstartError(
                f"arm {spec.name!r}: cannot start {self.argv[0]!r}: {e.strerror or e}"
            ) from None

    def wait_ready(self, timeout: float) -> None:
        wait_ready(self.url, timeout, self.proc, self.log_path)

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace`` s; the exit status."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)  # the group this Popen created (start_new_session)


def arm_orders(names: list[str], n_orders: int) -> list[list[str]]:
    """Alternating orders: as given, reversed, as given, ... (A B C, C B A, A B C, ...), so a
    slow drift over the run weighs on every arm alike once ratios are balanced over orders."""
    return [list(names) if k % 2 == 0 else list(reversed(names)) for k in range(n_orders)]
