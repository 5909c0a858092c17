"""The HTTP guard: what every request passes before and after its route.

A pure ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, whose wrapping hides the client's
disconnect from the route, so an abandoned request would run on for nobody). It

- checks the API key on ``/v1/*`` and, unless ``metrics_open``, on ``/metrics`` (401);
- refuses a body whose ``Content-Length`` is over ``max_body_bytes`` before reading it (413;
  bodies without a length are counted as they arrive by :func:`read_body`);
- answers any exception a route lets through with a 500 in the OpenAI error shape and *returns*:
  the server never sees the exception, so the keep-alive connection stays usable;
- ends a request whose client left mid-upload quietly (no traceback, no ``server_error``);
- writes the request-log line of every ``/v1/*`` request that the route did not log itself
  (rejections: 400, 401, 404, 413, 429, early 500), so the log has one line per request.

Routes tell it what they did through ``scope["state"]``: ``headstart_logged`` (a log line was
written) and ``headstart_error`` (the API error type answered).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from headstart.server import protocol as P
from headstart.server.auth import ApiKeys
from headstart.server.metrics import Metrics
from headstart.server.request_log import RequestLog, request_record

log = logging.getLogger("headstart.server")

__all__ = ["ERROR", "LOGGED", "Guard", "GuardSettings", "disconnected", "error_body", "read_body"]

LOGGED = "headstart_logged"
ERROR = "headstart_error"


class GuardSettings(Protocol):
    """What the guard reads, on every request (the server's state; keys may be reloaded)."""

    keys: ApiKeys | None
    metrics: Metrics
    metrics_open: bool
    max_body_bytes: int
    request_log: RequestLog | None


def error_body(e: P.APIError) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The JSON body and headers of an error response."""
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in e.headers.items()]
    return body, headers


class Guard:
    """See the module docstring."""

    def __init__(self, app: ASGIApp, state: GuardSettings) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        info: dict[str, Any] = scope.setdefault("state", {})
        info[LOGGED] = False
        started_at = time.monotonic()
        response: dict[str, Any] = {"status": None}

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                response["status"] = message["status"]
            await send(message)

        try:
            refused = self._refuse(scope)
            if refused is not None:
                info[ERROR] = refused.type
                self.state.metrics.error(refused.type)
                await _send_error(tracked, refused)
            else:
                await self.app(scope, receive, tracked)
        except ClientDisconnect:  # gone mid-upload: nobody to answer
            info[ERROR] = "client_disconnected"
            response["status"] = response["status"] or 499
        except Exception as e:
            log.exception("unhandled error on %s", scope.get("path"))
            self.state.metrics.error("server_error")
            info[ERROR] = "server_error"
            if response["status"] is None:
                try:
                    await _send_error(
                        tracked, P.APIError(500, f"internal error: {type(e).__name__}")
                    )
                except Exception:
                    response["status"] = 500
        finally:
            self._log_unlogged(scope, info, response["status"], started_at)

    def _refuse(self, scope: Scope) -> P.APIError | None:
        state, path = self.state, scope["path"]
        headers = dict(scope.get("headers") or ())
        guarded = path.startswith("/v1/") or (path == "/metrics" and not state.metrics_open)
        if guarded and state.keys is not None:
            auth = headers.get(b"authorization")
            if not state.keys.check(auth.decode("latin-1") if auth is not None else None):
                return P.APIError(
                    401,
                    "a valid API key is required (Authorization: Bearer KEY)",
                    code="invalid_api_key",
                )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > state.max_body_bytes:
            return _too_large(state.max_body_bytes)
        return None

    def _log_unlogged(
        self, scope: Scope, info: dict[str, Any], status: int | None, started_at: float
    ) -> None:
        request_log = self.state.request_log
        path = scope["path"]
        if request_log is None or info.get(LOGGED) or not path.startswith("/v1/"):
            return
        if status is not None and status < 400:
            return  # /v1/models and the like: not a generation request
        kind = (
            "chat"
            if path == "/v1/chat/completions"
            else ("completion" if path == "/v1/completions" else None)
        )
        request_id = P.new_request_id(kind) if kind else f"req-{uuid.uuid4().hex}"
        try:
            request_log.write(
                request_record(
                    id=request_id,
                    endpoint=path[:200],
                    status=status or 499,
                    duration_s=time.monotonic() - started_at,
                    error=info.get(ERROR) or ("client_disconnected" if status is None else None),
                )
            )
        except Exception:
            log.exception("request log write failed")


def _too_large(limit: int) -> P.APIError:
    return P.APIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes (--max-body-mib)",
        code="request_too_large",
    )


async def _send_error(send: Send, e: P.APIError) -> None:
    body, headers = error_body(e)
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole request body: 413 once it passes ``limit`` bytes (bodies without a
    Content-Length are counted as they arrive), 408 when it has not all arrived within
    ``timeout_s`` seconds. A client that leaves mid-upload raises ``ClientDisconnect``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    chunks: list[bytes] = []
    size = 0
    stream = request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(anext(stream), timeout=max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise P.APIError(
                408,
                f"the request body did not arrive within {timeout_s:g} s",
                code="request_timeout",
            ) from None
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def disconnected(request: Request) -> None:
    """Return when the client of ``request`` (whose body was read) disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a server that answers without waiting: do not spin
