"""What the HTTP parser costs a burst of new requests, without the engine.

    python benchmarks/http_intake.py [--bursts 20] [--streams 16]

For each parser `headstart serve` can use (``--http-parser``), starts uvicorn in a child process
with headstart's own connection protocol (:func:`headstart.server.connection.protocol_class`)
around an ASGI app that reads each body and answers a two-event SSE stream at once, then sends
bursts of ``--streams`` streamed completion requests at once from this process with bench's
aiohttp client, one kept-alive connection a stream. Prints, per parser, the medians over the
bursts (the first five left out) of when the app saw its first and its last body, and when the
last response ended, in ms after the burst's first send; both processes read
``time.perf_counter`` (CLOCK_MONOTONIC on Linux, so the clocks agree).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time

import aiohttp


def _serve(parser: str, port: int, arrivals: mp.Queue) -> None:
    import uvicorn

    from headstart.server.connection import uvicorn_connection_options

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        if scope["method"] == "POST":  # not the readiness poll
            arrivals.put(time.perf_counter())
        head = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        chunk = b'data: {"choices":[{"text":"x"}]}\n\n'
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    uvicorn.run(app, port=port, log_level="warning", **uvicorn_connection_options(10, 5, parser))


async def _bursts(port: int, streams: int, bursts: int, arrivals: mp.Queue) -> list[tuple]:
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = json.dumps({"prompt": list(range(1000, 1031)), "max_tokens": 1, "stream": True})
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams)) as s:

        async def one() -> tuple[float, float]:
            sent = time.perf_counter()
            async with s.post(url, data=body.encode()) as r:
                await r.read()
            return sent, time.perf_counter()

        for _ in range(bursts):
            done = await asyncio.gather(*(one() for _ in range(streams)))
            seen = sorted(arrivals.get(timeout=10) for _ in range(streams))
            t0 = min(sent for sent, _ in done)
            out.append((seen[0] - t0, seen[-1] - t0, max(end for _, end in done) - t0))
            await asyncio.sleep(0.05)
    return out


def main() -> None:
    from headstart.bench.arms import free_port, wait_ready
    from headstart.server.connection import parser_names

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bursts", type=int, default=20)
    ap.add_argument("--streams", type=int, default=16)
    args = ap.parse_args()
    print(f"{args.streams} requests at once, medians over {args.bursts - 5} bursts, ms")
    print(f"{'parser':10} {'first body':>11} {'last body':>10} {'last end':>9}")
    for parser in parser_names():
        port, arrivals = free_port(), mp.Queue()
        server = mp.Process(target=_serve, args=(parser, port, arrivals), daemon=True)
        server.start()
        try:
            wait_ready(f"http://127.0.0.1:{port}", 10)
            rows = asyncio.run(_bursts(port, args.streams, args.bursts, arrivals))[5:]
        finally:
            server.terminate()
            server.join()
        med = [1e3 * statistics.median(r[i] for r in rows) for i in range(3)]
        print(f"{parser:10} {med[0]:11.2f} {med[1]:10.2f} {med[2]:9.2f}")


if __name__ == "__main__":
    main()
