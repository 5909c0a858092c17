"""Send streamed requests and time them on the client's clock.

Job: one request -> one raw row (send, first and last delta that carries a token, ``[DONE]``,
usage, output fingerprint); one burst -> N such requests started together. Every timestamp is
``time.perf_counter()`` taken as close to the wire as the client allows, minus the run's ``t0``.

Works against any OpenAI-compatible server: it reads ``choices[].delta.content``,
``reasoning_content``/``reasoning`` (chat) or ``choices[].text`` (completions), the final
``usage`` chunk, and, when asked for, token strings from streamed ``logprobs`` (and the ids
in them, :func:`token_ids`).

The client is aiohttp, not httpx: one event loop drives every stream of a burst, so whatever
the client spends per request and per chunk lands in the burst's TTFT, and aiohttp's (its C
HTTP parser) is a small fraction of httpx's (``benchmarks/client_overhead.py``; BENCHMARKS.md).

Non-goals: deciding what to send (``workload.py``) or when (``runner.py``); aggregation.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from headstart.bench.rows import Row, derive

#: Seconds a response may take to end after its ``data: [DONE]`` (see :func:`_drain`).
DRAIN_S = 1.0
#: Longest line of a streamed body the client reads (aiohttp's default is 64 KiB; a chunk with
#: many logprobs can be longer). A longer one fails its request with a clear error.
MAX_LINE_BYTES = 1 << 24

#: What a request's failure can raise: recorded in its row, never raised to the run.
_FAILURES = (
    aiohttp.ClientError,
    TimeoutError,
    KeyError,
    TypeError,
    AttributeError,
    ValueError,  # json.JSONDecodeError and UnicodeDecodeError among them
)


def open_session(connections: int, timeout: float) -> aiohttp.ClientSession:
    """A client session holding up to ``connections`` kept-alive connections. ``timeout``
    bounds connecting and each read, not a whole stream (which may run for minutes). Open it
    inside the event loop; close it with ``await session.close()``."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=connections),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout),
        read_bufsize=MAX_LINE_BYTES,
        max_line_size=MAX_LINE_BYTES,
        max_field_size=MAX_LINE_BYTES,
    )


@dataclass
class Output:
    """What a request produced, kept apart from the rows so fingerprints can be explained."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tokens: list[str] | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "content": "".join(self.content),
            "reasoning": "".join(self.reasoning),
        }
        if self.tokens is not None:
            out["tokens"] = self.tokens
        return out

    def fingerprint(self) -> str:
        blob = json.dumps(self.as_json(), sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _take_tokens(choice: dict[str, Any], out: Output) -> int:
    """Append the tokens named in a streamed choice's ``logprobs`` to ``out``; how many."""
    lp = choice.get("logprobs")
    if not lp:
        return 0
    out.tokens = out.tokens if out.tokens is not None else []
    before = len(out.tokens)
    if isinstance(lp.get("content"), list):  # chat: [{"token": ...}, ...]
        out.tokens.extend(str(e.get("token")) for e in lp["content"])
    elif isinstance(lp.get("tokens"), list):  # completions: ["...", ...]
        out.tokens.extend(str(t) for t in lp["tokens"])
    return len(out.tokens) - before


#: How a token is named in ``logprobs`` with ``return_tokens_as_token_ids`` (vLLM, headstart).
TOKEN_ID_PREFIX = "token_id:"


def token_ids(tokens: list[str] | None) -> list[int] | None:
    """The ids of streamed ``logprobs`` tokens named ``"token_id:N"``; None if there were no
    logprobs or any token is named otherwise (a server that ignored
    ``return_tokens_as_token_ids`` names them by their text, which is not an id)."""
    if tokens is None:
        return None
    ids = []
    for t in tokens:
        digits = t.removeprefix(TOKEN_ID_PREFIX)
        if digits == t or not (digits.isascii() and digits.isdigit()):
            return None
        ids.append(int(digits))
    return ids


def _pieces(choice: dict[str, Any]) -> tuple[str, str]:
    """(content, reasoning) text of one streamed choice, chat or completions."""
    delta = choice.get("delta")
    if delta is None:
        return choice.get("text") or "", ""
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    return delta.get("content") or "", reasoning


async def measure(
    client: aiohttp.ClientSession,
    url: str,
    payload: bytes,
    t0: float,
    headers: dict[str, str],
    on_delta: Callable[[float], None] | None = None,
) -> tuple[Row, Output]:
    """Send one streamed request; return its raw row fields (no identity fields) and output.
    ``on_delta``, if given, is called with the arrival time (seconds since ``t0``) of every
    delta that carries a token as it arrives, so a caller can keep each token's time or act
    on progress.

    Never raises for HTTP or stream problems: they land in the row's ``status``/``error`` so a
    failed request is recorded (and then fails ``bench check``) instead of vanishing.
    """
    out = Output()
    row: Row = {
        "t_head": None,
        "t_first": None,
        "t_last": None,
        "t_done": None,
        "prompt_tokens": None,
        "completion_tokens": None,
        "cached_tokens": None,
        "n_deltas": 0,
        "finish_reason": "",
        "status": 0,
        "error": "",
    }
    send = time.perf_counter()
    try:
        async with client.post(url, data=payload, headers=headers) as r:
            # The status line and headers are in: a server sends them once it has taken the
            # request, so a late first token splits into its way in and its way out.
            row["t_head"] = time.perf_counter()
            row["status"] = r.status
            if r.status != 200:
                body = (await r.read()).decode(errors="replace")
                row["error"] = f"HTTP {r.status}: {body[:300]}"
            else:
                await _read_stream(r, row, out, t0, on_delta)
    except _FAILURES as e:
        row["error"] = f"{type(e).__name__}: {e or 'timed out'}"[:300]
    if not row["error"] and row["t_done"] is None:
        row["error"] = "stream ended without data: [DONE]"
    row["t_send"] = send - t0
    for k in ("t_head", "t_first", "t_last", "t_done"):
        if row[k] is not None:
            row[k] -= t0
    row["fingerprint"] = out.fingerprint()
    row.update(derive(row))
    return row, out


async def _lines(r: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The body's lines, decoded, without their line ends."""
    async for raw in r.content:
        yield raw.decode().rstrip("\r\n")


async def _read_stream(
    r: aiohttp.ClientResponse,
    row: Row,
    out: Output,
    t0: float,
    on_delta: Callable[[float], None] | None,
) -> None:
    lines = _lines(r)
    async for line in lines:
        now = time.perf_counter()  # before parsing: the time the bytes arrived
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            row["t_done"] = now
            await _drain(lines)
            return
        chunk = json.loads(data)
        if "error" in chunk:
            err = chunk["error"]
            row["error"] = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            continue
        usage = chunk.get("usage")
        if usage:
            row["prompt_tokens"] = usage.get("prompt_tokens")
            row["completion_tokens"] = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            row["cached_tokens"] = details.get("cached_tokens")
        for choice in chunk.get("choices") or ():
            content, reasoning = _pieces(choice)
            # A token counts when it arrives, text or not: one whose text a server holds back
            # (part of a character) comes with its logprobs entry alone, as a tool-call delta,
            # or as a chunk with empty text (vLLM's server and ours send one a token); vLLM's
            # benchmark too counts the first chunk with a choice. A closing chunk
            # (finish_reason, no text) is no token, nor a chat stream's opening role delta
            # (some servers send it before any token is computed).
            tokens = _take_tokens(choice, out)
            calls = (choice.get("delta") or {}).get("tool_calls")
            finish = choice.get("finish_reason")
            if finish:
                row["finish_reason"] = str(finish)
            if content or reasoning or tokens or calls or (not finish and _empty_text(choice)):
                out.content.append(content)
                out.reasoning.append(reasoning)
                row["n_deltas"] += 1
                if row["t_first"] is None:
                    row["t_first"] = now
                row["t_last"] = now
                if on_delta is not None:
                    on_delta(now - t0)


def _empty_text(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice carries text that is there and empty: a completions ``text``
    of "", or a chat delta's ``content`` of "" in a delta that is not the opening role one."""
    delta = choice.get("delta")
    if delta is None:
        return choice.get("text") == ""
    return delta.get("content") == "" and "role" not in delta


async def _drain(lines: AsyncIterator[str]) -> None:
    """Read what follows ``[DONE]`` (the end of the chunked body): a response read to its end
    hands its connection back to the pool kept alive, where one left unread would be closed
    and the stream's next request would pay for a new connection. A server that leaves the
    stream open after ``[DONE]`` gets :data:`DRAIN_S`, then the connection is closed."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
        async with asyncio.timeout(DRAIN_S):
            async for _ in lines:
                pass


async def burst(
    client: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    streams: int,
    t0: float,
    headers: dict[str, str],
    on_done: Callable[[], None] | None = None,
) -> list[tuple[Row, Output]]:
    """``streams`` identical requests started together; results in stream order."""
    payload = json.dumps(body).encode()  # encode once so no stream waits on another's JSON

    async def one() -> tuple[Row, Output]:
        result = await measure(client, url, payload, t0, headers)
        if on_done is not None:
            on_done()
        return result

    return list(await asyncio.gather(*(one() for _ in range(streams))))
