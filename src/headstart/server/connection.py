"""HTTP/1.1 connection policy for ``headstart serve``: a header timeout and a header size bound.

uvicorn times out only an idle kept-alive connection after a response. A fresh connection that
sends nothing, or a request whose headers stop arriving halfway (slowloris), holds a socket and
a file descriptor forever. The protocols here close such connections:

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

A request head still incomplete once more than :data:`MAX_HEADER_BYTES` of it have arrived gets
``400``. Like h11's own bound, it applies only while a head is incomplete, so a larger head that
arrives whole in one socket read (at most 256 KiB with asyncio's selector transport) still
passes; the bytes held for a head stay bounded either way.

Two parsers carry the same policy: :class:`HttpToolsHeadPolicy` (uvicorn's httptools protocol,
llhttp in C; the default) and :class:`H11HeadPolicy` (uvicorn's h11 protocol, pure Python).
``headstart serve`` always passes one of these classes as ``uvicorn.Config(http=...)``, never
uvicorn's own choice, so the policy holds whichever parser is installed. httptools is the default
because a burst of new requests is read one after another on the event loop, and h11's
per-request parsing and response framing in Python delays the last of them (measured in
BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed: h11 only (see parser_names)
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

log = logging.getLogger("headstart.serve")

MAX_HEADER_BYTES = 64 * 1024
"""Bound on a request head (request line plus headers), in bytes; h11's default is 16 KiB, which
long bearer tokens and cookies can exceed."""

_TIMEOUT_BODY = b"request headers took too long\n"
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY)
)


class _HeadDeadline:
    """The header timer both protocols share; mixed in before uvicorn's protocol class, whose
    ``loop``, ``transport``, ``client`` and ``cycle`` it reads.

    ``header_timeout`` (seconds; ``0`` or less: no timeout) is a class attribute so that uvicorn
    can build instances with its usual constructor; :func:`protocol_class` makes a subclass with
    it set. The timer runs only while a request head is awaited: armed when the connection is
    made and by the first byte of a later request's head, cancelled once the head is parsed,
    when the timer fires, and when the connection is lost.
    """

    header_timeout: float = 10.0
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    client: Any
    cycle: Any

    def _init_deadline(self) -> None:
        self._header_timer: asyncio.TimerHandle | None = None
        self._awaiting = True  # a request head is awaited (each protocol says when)
        self._head_bytes = False  # some bytes of the awaited head have arrived

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)  # type: ignore[misc]

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
        if self.transport.is_closing() or not self._awaiting:
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


class H11HeadPolicy(_HeadDeadline, H11Protocol):
    """uvicorn's h11 protocol with the module's policy; h11 itself bounds the head's size
    (``h11_max_incomplete_event_size``, set by :func:`uvicorn_connection_options`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Awaiting from connection start, and from the end of each response, until the next
        # request's head has been parsed.
        self._init_deadline()

    def data_received(self, data: bytes) -> None:
        if self._awaiting:
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
            self._awaiting = False
            self._head_bytes = False
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            # Before super(): it parses pipelined requests already buffered, which clears this.
            self._awaiting = True
            self._head_bytes = False
        super().on_response_complete()


if HttpToolsProtocol is not None:

    class HttpToolsHeadPolicy(_HeadDeadline, HttpToolsProtocol):
        """uvicorn's httptools protocol with the module's policy.

        llhttp reports a head through callbacks as it parses: ``on_message_begin`` at its first
        byte, ``on_headers_complete`` at its end. The head is awaited from the connection's
        start until the first head is complete, and from each later head's first byte until it
        is complete. httptools holds a header's value until the header ends, so the size bound
        counts the bytes read while a head is incomplete, not the parsed pieces: past
        :data:`MAX_HEADER_BYTES` the request gets 400.
        """

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # Awaiting from connection start until the first head is parsed, then from each
            # later head's first byte until it is parsed.
            self._init_deadline()
            self._head_size = 0

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._awaiting:
                # The whole read counts: when a pipelined head begins inside it, so does the
                # end of the request before (a false 400 needs a pipelining client whose
                # previous body and this head together pass the bound in one read).
                self._head_size += len(data)
                if self._head_size > MAX_HEADER_BYTES and not self.transport.is_closing():
                    self._cancel_header_timer()
                    self.send_400_response("Request headers too large.")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._awaiting = self._head_bytes = True
            self._head_size = 0
            if self._header_timer is None:
                # A later request's first byte; uvicorn's keep-alive timer, which bounded the
                # idle time until now, was cancelled as the bytes arrived.
                self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._awaiting = self._head_bytes = False
            self._cancel_header_timer()
            super().on_headers_complete()

else:  # pragma: no cover
    HttpToolsHeadPolicy = None  # type: ignore[assignment,misc]


def parser_names() -> list[str]:
    """The HTTP parsers this installation can serve with, the default first."""
    return ["httptools", "h11"] if HttpToolsHeadPolicy is not None else ["h11"]


def protocol_class(header_timeout: float, parser: str = "httptools") -> type[_HeadDeadline]:
    """The protocol class for ``parser`` (``"httptools"`` or ``"h11"``) whose connections use
    ``header_timeout``."""
    if parser not in parser_names():
        raise ValueError(f"HTTP parser {parser!r} is not available here: {parser_names()}")
    base = HttpToolsHeadPolicy if parser == "httptools" else H11HeadPolicy
    return type(base.__name__, (base,), {"header_timeout": float(header_timeout)})


def uvicorn_connection_options(
    header_timeout: float, keep_alive_timeout: float, parser: str = "httptools"
) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that apply this module's connection policy."""
    return {
        "http": protocol_class(header_timeout, parser),
        "timeout_keep_alive": keep_alive_timeout,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
    }
