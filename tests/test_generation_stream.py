"""The SSE writer of a generation (``api._GenerationStream``) over a stand-in generation: what
reaches the ASGI ``send`` is the same bytes however the events are grouped into writes, a
stream ends once with its status recorded, and a client that leaves ends it without [DONE]."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from headstart.server import protocol as P
from headstart.server.api import _GenerationStream


class _Gen:
    """What the writer reads of a ``_Generation``: each event becomes one chunk ``{"i": e}``;
    the event ``"fail"`` fails the generation. ``n`` events end it."""

    def __init__(self, n: int, include_usage: bool = False) -> None:
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.n, self.taken, self.error = n, 0, None
        self.req = SimpleNamespace(include_usage=include_usage)
        self.kind, self.id, self.created = "completion", "cmpl-1", 0
        self.state = SimpleNamespace(model_name="m")
        self.records: list[tuple[int, str | None]] = []
        self.aborts = 0

    @property
    def done(self) -> bool:
        return self.error is not None or self.taken == self.n

    def take(self, index: int, event: Any) -> list[dict[str, Any]]:
        self.taken += 1
        if event == "fail":
            self.error = "boom"
            return []
        return [{"i": event}]

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": 1, "completion_tokens": self.n, "total_tokens": self.n + 1}

    def abort(self) -> None:
        self.aborts += 1

    def record(self, status: int, error: str | None = None) -> None:
        self.records.append((status, error))


def _request(leaves: asyncio.Event) -> SimpleNamespace:
    async def receive() -> dict[str, str]:
        await leaves.wait()
        return {"type": "http.disconnect"}

    return SimpleNamespace(receive=receive)


async def _run(gen: _Gen, feed, leaves: asyncio.Event | None = None) -> list[dict[str, Any]]:
    """Run the writer while ``feed(gen)`` puts events; the messages it sent."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    stream = _GenerationStream(gen, _request(leaves or asyncio.Event()))
    await asyncio.gather(stream({}, None, send), feed(gen))
    return sent


def _body(sent: list[dict[str, Any]]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _expected(events: list[Any], *tail: bytes) -> bytes:
    return b"".join(P.sse({"i": e}) for e in events) + b"".join(tail)


def test_events_queued_together_go_out_in_one_write_with_the_end():
    async def feed(gen: _Gen) -> None:
        for e in range(5):
            gen.queue.put_nowait((0, e))

    gen = _Gen(5)
    sent = asyncio.run(_run(gen, feed))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert len(sent) == 2 and not sent[1].get("more_body", False)
    assert _body(sent) == _expected(list(range(5)), P.SSE_DONE)
    assert gen.records[0] == (200, None) and gen.aborts >= 1


def test_events_one_at_a_time_give_the_same_bytes():
    async def feed(gen: _Gen) -> None:
        for e in range(5):
            await asyncio.sleep(0.005)
            gen.queue.put_nowait((0, e))

    gen = _Gen(5, include_usage=True)
    sent = asyncio.run(_run(gen, feed))
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert len(bodies) == 5  # four alone, the last with the end
    assert all(m["more_body"] for m in bodies[:-1]) and not bodies[-1].get("more_body", False)
    usage = P.sse(
        P.usage_chunk(
            request_id="cmpl-1",
            model="m",
            object_type="text_completion",
            usage=gen.usage(),
            created=0,
        )
    )
    assert _body(sent) == _expected(list(range(5)), usage, P.SSE_DONE)
    assert gen.records[0] == (200, None)


def test_a_failed_generation_ends_with_the_error_event():
    async def feed(gen: _Gen) -> None:
        gen.queue.put_nowait((0, 0))
        await asyncio.sleep(0.005)
        gen.queue.put_nowait((0, "fail"))

    gen = _Gen(5)
    sent = asyncio.run(_run(gen, feed))
    error = P.sse(P.APIError(500, "boom").body())
    assert _body(sent) == _expected([0], error, P.SSE_DONE)
    assert gen.records[0] == (500, "server_error")


def test_a_client_that_leaves_ends_the_stream_without_done():
    leaves = asyncio.Event()

    async def feed(gen: _Gen) -> None:
        gen.queue.put_nowait((0, 0))
        await asyncio.sleep(0.005)
        leaves.set()  # the client is gone; the generation would run on

    gen = _Gen(100)
    sent = asyncio.run(_run(gen, feed, leaves))
    assert _body(sent) == _expected([0])
    assert P.SSE_DONE not in _body(sent)
    assert gen.records[0] == (499, "client_disconnected") and gen.aborts >= 1


def test_engine_events_reach_their_queues_in_order_with_one_wake_up_a_batch():
    """The mailbox between the engine thread and the loop: nothing lost or reordered when a
    thread posts while the loop delivers, and events posted before the loop runs share one
    wake-up (one ``call_soon_threadsafe``, not one per event)."""
    import threading

    from headstart.server.api import _Mailbox

    async def main() -> tuple[list[int], list[int], int]:
        loop = asyncio.get_running_loop()
        box = _Mailbox(loop)
        wakes = 0
        schedule = loop.call_soon_threadsafe

        def counted(*args):
            nonlocal wakes
            wakes += 1
            return schedule(*args)

        loop.call_soon_threadsafe = counted
        q1, q2 = asyncio.Queue(), asyncio.Queue()
        for i in range(100):  # the loop does not run meanwhile: one wake-up for all
            box.post(q1 if i % 2 else q2, i)
        batched = wakes
        n = 20_000
        poster = threading.Thread(target=lambda: [box.post(q1, 100 + i) for i in range(n)])
        poster.start()
        async with asyncio.timeout(30):  # a stranded event fails here instead of hanging
            got1 = [await q1.get() for _ in range(50 + n)]
            got2 = [await q2.get() for _ in range(50)]
        poster.join()
        return got1, got2, batched

    got1, got2, batched = asyncio.run(main())
    assert batched == 1
    assert got1 == [i for i in range(100) if i % 2] + [100 + i for i in range(20_000)]
    assert got2 == [i for i in range(100) if not i % 2]
