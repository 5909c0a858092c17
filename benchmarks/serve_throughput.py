"""Aggregate decode throughput of a headstart server at 1 and N concurrent streams.

Starts `headstart serve` (or uses --url), sends N concurrent streaming completions with a fixed
output length (ignore_eos, greedy) and reports generated tokens per second over the burst's wall
time, plus the median per-stream rate. Prints a table; the last line is JSON.

    python benchmarks/serve_throughput.py [--model DIR] [--streams 1 16] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_proc import ServerProcess


async def burst(url: str, streams: int, tokens: int) -> dict:
    async def one(i: int, client: httpx.AsyncClient) -> tuple[float, float, int]:
        body = {
            "prompt": f"def function_{i}(x):",
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = time.perf_counter()
        first = last = None
        n = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    first = first or now
                    last = now
        return sent, first or sent, last or sent, n

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, client) for i in range(streams)))
        wall = time.perf_counter() - t0
    total = sum(r[3] for r in results)
    per_stream = [(r[3] - 1) / (r[2] - r[1]) for r in results if r[2] > r[1]]
    return {
        "streams": streams,
        "tokens": total,
        "wall_s": wall,
        "tok_per_s": total / wall,
        "per_stream_tok_per_s": statistics.median(per_stream) if per_stream else 0.0,
        "ttft_s": statistics.median(r[1] - r[0] for r in results),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    srv = None
    url = args.url
    if url is None:
        extra = ["--model", args.model] if args.model else []
        srv = ServerProcess(
            "--parallel", str(args.parallel), "--context", "1024", "--device", args.device, *extra
        ).wait_ready()
        url = srv.url
    try:
        asyncio.run(burst(url, 1, 8))  # warm-up
        rows = [asyncio.run(burst(url, n, args.tokens)) for n in args.streams]
    finally:
        if srv is not None:
            srv.stop()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"# {platform.processor() or platform.machine()}, commit {commit}, "
        f"--parallel {args.parallel}, {args.tokens} tokens per stream"
    )
    print(f"{'streams':>8} {'tok/s':>9} {'per-stream tok/s':>17} {'ttft ms':>8} {'wall s':>7}")
    for r in rows:
        print(
            f"{r['streams']:>8} {r['tok_per_s']:>9.1f} {r['per_stream_tok_per_s']:>17.1f} "
            f"{r['ttft_s'] * 1000:>8.1f} {r['wall_s']:>7.2f}"
        )
    print(json.dumps({"commit": commit, "rows": rows}))


if __name__ == "__main__":
    main()
