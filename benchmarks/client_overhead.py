"""What `headstart bench`'s client adds to a burst's TTFT: its streams against a server that
answers at once.

    python benchmarks/client_overhead.py [--streams 1 16] [--bursts 30]

A null server (a raw asyncio server in a process of its own) answers every streamed
completion with one token chunk and ``data: [DONE]`` without waiting; the bench's client
(``headstart.bench.client.burst``) sends bursts of N streams over kept-alive connections, and
the table gives the median over bursts of the burst's max and median TTFT: the client's own
floor under every burst row. With httpx installed, the same bursts through httpx go beside it
(the client bench used before). Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time

from headstart.bench.client import burst, open_session

_CHUNK = b"data: " + json.dumps({"choices": [{"index": 0, "text": "a"}]}).encode() + b"\n\n"
_BODY = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (_CHUNK, b"data: [DONE]\n\n"))
_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\n\r\n" + _BODY + b"0\r\n\r\n"
)


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            writer.write(_RESPONSE)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def _serve(port: mp.Value) -> None:
    async def main() -> None:
        server = await asyncio.start_server(_handle, "127.0.0.1", 0)
        port.value = server.sockets[0].getsockname()[1]
        await server.serve_forever()

    asyncio.run(main())


async def _ours(url: str, streams: int, bursts: int) -> list[list[float]]:
    body = {"prompt": list(range(31)), "max_tokens": 1, "stream": True}
    out = []
    async with open_session(streams + 4, 30) as client:
        for i in range(bursts + 3):
            rows = await burst(client, url, body, streams, time.perf_counter(), {})
            if i >= 3:  # the first bursts open the connections
                out.append([r["ttft_s"] for r, _ in rows])
    return out


async def _httpx(url: str, streams: int, bursts: int) -> list[list[float]]:
    import httpx

    payload = json.dumps({"prompt": list(range(31)), "max_tokens": 1, "stream": True}).encode()

    async def one(client: httpx.AsyncClient) -> float:
        t = time.perf_counter()
        first = None
        async with client.stream("POST", url, content=payload) as r:
            async for line in r.aiter_lines():
                if first is None and line.startswith("data:"):
                    first = time.perf_counter() - t
        return first

    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    out = []
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        for i in range(bursts + 3):
            ttfts = await asyncio.gather(*(one(client) for _ in range(streams)))
            if i >= 3:
                out.append(list(ttfts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--bursts", type=int, default=30)
    args = ap.parse_args()
    port = mp.Value("i", 0)
    server = mp.Process(target=_serve, args=(port,), daemon=True)
    server.start()
    while port.value == 0:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port.value}/v1/completions"
    clients = {"bench (aiohttp)": _ours}
    try:
        import httpx  # noqa: F401

        clients["httpx"] = _httpx
    except ImportError:
        pass
    print("client            streams  burst max ms  burst median ms")
    try:
        for streams in args.streams:
            for name, fn in clients.items():
                bursts = asyncio.run(fn(url, streams, args.bursts))
                top = statistics.median(max(b) for b in bursts) * 1e3
                mid = statistics.median(statistics.median(b) for b in bursts) * 1e3
                print(f"{name:<17} {streams:>7}  {top:>12.2f}  {mid:>15.2f}")
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
