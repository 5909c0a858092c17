"""HTTP/1.1 connection policy for ``headstart serve``: a header timeout and a header size bound.

uvicorn times out only an idle kept-alive connection after a response. A fresh connection that
sends nothing, or a request whose headers stop arriving halfway (slowloris), holds a socket and
a file descriptor forever. :class:`HeaderTimeoutProtocol` closes such connections:

* a fresh connection must deliver a whole request head (request line and headers) within
  ``header_timeout`` seconds of being accepted;
* on a kept-alive connection, uvicorn's keep-alive timer bounds the idle time after a response
  (no byte at all); once the first byte of the next request arrives, its head must be complete
  within ``header_timeout`` seconds (nginx's client_header_timeout works the same way). Timing the
  head from the end of the previous response instead would cut keep-alive short whenever
  ``header_timeout < keep_alive_timeout``.

A connection timed out after some bytes of a request arrived is answered ``408`` first; one that
sent nothing is closed silently (a client racing a request against the close would otherwise read
the 408 as the answer to its request). A request's body is not covered (the app times it out) and
neither is a response being written.

The header size is bounded through h11: a request head still incomplete once more than
:data:`MAX_HEADER_BYTES` have been buffered gets ``400``. h11 checks that bound only while a head
is incomplete, so a larger head that arrives whole in one socket read (at most 256 KiB with
asyncio's selector transport) still passes; the buffered bytes stay bounded either way.

Only the h11 implementation is wrapped: ``headstart serve`` always passes this class as
``uvicorn.Config(http=...)``, so behaviour does not change with whether httptools is installed
(h11's parsing cost is negligible next to generating tokens).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("headstart.serve")

MAX_HEADER_BYTES = 64 * 1024
"""Bound on a request head (request line plus headers), in bytes; h11's default is 16 KiB, which
long bearer tokens and cookies can exceed."""

_TIMEOUT_BODY = b"request headers took too long\n"
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus the header timeout described in the module docstring.

    ``header_timeout`` (seconds; ``0`` or less: no timeout) is a class attribute so that uvicorn
    can build instances with its usual constructor; :func:`protocol_class` makes a subclass with
    it set. The timer runs only while a request head is awaited: it is armed in
    ``connection_made`` and by the first byte after a response, and cancelled when h11 produces
    the ``Request`` event, when the timer fires, and in ``connection_lost``.
    """

    header_timeout: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        # True from connection start, and from the end of each response, until the next
        # request's head has been parsed.
        self._awaiting_head = True
        self._head_bytes = False  # some bytes of the awaited head have arrived

    # -- the timer ------------------------------------------------------------------------

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        if self.header_timeout > 0:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._awaiting_head:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a response is still being written (an early one, before its body was read)
        # debug, not info: a flood of such connections must not become a flood of log lines
        log.debug(
            "closing the connection from %s: no complete request headers within %gs",
            self.client,
            self.header_timeout,
        )
        if self._head_bytes:
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()

    # -- uvicorn's hooks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head:
            self._head_bytes = True
            if self._header_timer is None:
                # The first byte of a new request on a kept-alive connection; uvicorn's
                # keep-alive timer, which bounded the idle time until now, is cancelled below.
                self._arm_header_timer()
        super().data_received(data)

    def handle_events(self) -> None:
        scope = self.scope
        super().handle_events()
        # uvicorn builds a new scope for every h11 Request event, that is once a request's head
        # is complete (also before a WebSocket upgrade hands the transport to another protocol,
        # whose connection_lost would never cancel our timer).
        if self.scope is not scope:
            self._awaiting_head = False
            self._head_bytes = False
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            # Before super(): it parses pipelined requests already buffered, which clears this.
            self._awaiting_head = True
            self._head_bytes = False
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)


def protocol_class(header_timeout: float) -> type[HeaderTimeoutProtocol]:
    """A :class:`HeaderTimeoutProtocol` subclass whose connections use ``header_timeout``."""
    return type(
        "HeaderTimeoutProtocol",
        (HeaderTimeoutProtocol,),
        {"header_timeout": float(header_timeout), "__module__": __name__},
    )


def uvicorn_connection_options(header_timeout: float, keep_alive_timeout: float) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that apply this module's connection policy."""
    return {
        "http": protocol_class(header_timeout),
        "timeout_keep_alive": keep_alive_timeout,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
    }
