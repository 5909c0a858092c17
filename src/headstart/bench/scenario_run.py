"""Run a prefill scenario (``headstart bench --scenario``) and write its receipt.

Job: for each arm in each order (``runner.run_arms``: fresh command servers, URL arms as
they are), send the scenario's steps (``scenarios.all_steps``) and record every request with
the arrival time of each of its deltas; then write the receipt, check it, and print the table
last.

How requests go out: each concurrent stream has its own HTTP client held to one kept-alive
connection (a *lane*). Before every step, each lane the step uses is warmed with a
``GET /v1/models`` (so the connection is open when the clock matters, even if the server
closed an idle one), then all wait at a barrier and send together; in ``beside`` the long
prompt waits, after the barrier, until every decoder has streamed
``scenarios.DECODING_DELTAS`` deltas (or ended), and warms its lane just before it goes.
TTFT is taken at the first non-empty
streamed delta, as in the rest of bench (``client.measure``).

The receipt's layout is in ``receipt.py``.

Non-goals: what is sent (``scenarios.py``), summarising (``scenario_summary.py``), judging
(``scenario_check.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from headstart.bench import env as envmod
from headstart.bench.arms import arm_orders
from headstart.bench.check import check_receipt
from headstart.bench.client import measure
from headstart.bench.receipt import write_scenario_receipt
from headstart.bench.runner import Plan, Target, auth_headers, finish, new_run_id, run_arms
from headstart.bench.scenario_summary import (
    RECORD_SCHEMA,
    Record,
    format_scenario_table,
    scenario_title,
)
from headstart.bench.scenarios import (
    DECODING_DELTAS,
    Request,
    Scenario,
    all_steps,
    requests_per_arm,
    salt_base,
    token_body,
)
from headstart.bench.workload import COMPLETIONS, Sampling, request_sha


class Lanes:
    """One HTTP client per concurrent stream, each held to one kept-alive connection, so a
    stream never waits for a connection and never shares one."""

    def __init__(self, n: int, timeout: float) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        self.clients = [httpx.AsyncClient(timeout=timeout, limits=limits) for _ in range(n)]

    async def warm(self, lane: int, url: str, headers: dict[str, str]) -> None:
        """Open (or keep) lane ``lane``'s connection with a cheap request. A server without
        ``/v1/models`` still opens the connection; a failure leaves the send to connect."""
        with contextlib.suppress(httpx.HTTPError):
            await self.clients[lane].get(url + "/v1/models", headers=headers)

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()


@dataclass(frozen=True)
class _Arm:
    """One arm in one order while it runs: where to send, what to send, where rows go."""

    target: Target
    scenario: str
    sampling: Sampling
    headers: dict[str, str]
    t0: float
    lanes: Lanes
    records: list[Record]

    async def send(self, lane: int, req: Request, watch: Callable[[int], None] | None) -> None:
        """Send ``req`` on ``lane`` and append its record; ``watch(n)`` is called with the
        number of deltas seen so far at each delta."""
        body = token_body(req, self.sampling)
        sha = request_sha(body)
        t = self.target
        if t.model is not None:
            body = {"model": t.model, **body}
        times: list[float] = []

        def on_delta(now: float) -> None:
            times.append(now)
            if watch is not None:
                watch(len(times))

        payload = json.dumps(body).encode()
        row, _ = await measure(
            self.lanes.clients[lane], t.url + COMPLETIONS, payload, self.t0, self.headers, on_delta
        )
        t.done()
        record = {
            "arm": t.arm,
            "order": t.order,
            "slot": t.slot,
            "scenario": self.scenario,
            "rep": req.rep,
            "role": req.role,
            "stream": req.stream,
            "prompt_len": len(req.ids),
            "max_tokens": req.max_tokens,
            "request_sha": sha,
            **row,
            "times": times,
        }
        self.records.append(record)

    async def step(self, reqs: list[Request], beside: bool) -> None:
        """Warm one lane per request, wait at a barrier, send them together; with ``beside``
        the last request (the long prompt) goes once every other one is decoding."""
        barrier = asyncio.Barrier(len(reqs))
        decoding = [asyncio.Event() for _ in reqs[:-1]] if beside else []

        async def one(lane: int, req: Request) -> None:
            arriving = beside and lane == len(reqs) - 1
            if not arriving:
                await self.lanes.warm(lane, self.target.url, self.headers)
            await barrier.wait()
            if not beside:
                await self.send(lane, req, None)
            elif arriving:
                for e in decoding:
                    await e.wait()
                # Warmed now, not before the barrier: however long the decoders took to
                # start, its connection is fresh (servers close idle ones after seconds).
                await self.lanes.warm(lane, self.target.url, self.headers)
                await self.send(lane, req, None)
            else:
                event = decoding[lane]

                def watch(n: int) -> None:
                    if n >= DECODING_DELTAS:
                        event.set()

                try:
                    await self.send(lane, req, watch)
                finally:
                    event.set()  # a failed or short stream must not hold the long prompt back

        await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))


async def _scenario_work(
    sc: Scenario, plan: Plan, run_id: str, t0: float, records: list[Record], target: Target
) -> None:
    base = salt_base(run_id, target.arm, target.order, sc.name)
    headers = {"Content-Type": "application/json", **auth_headers(plan)}
    lanes = Lanes(sc.width, plan.request_timeout)
    arm = _Arm(target, sc.name, plan.sampling, headers, t0, lanes, records)
    try:
        for step in all_steps(sc, plan.sampling.max_tokens, base):
            await arm.step(step, beside=sc.name == "beside")
    finally:
        await lanes.aclose()


def _ordered(records: list[Record]) -> list[Record]:
    """Records in sending order, each with the schema's fields in schema order."""
    out = [{f: r[f] for f in RECORD_SCHEMA} for r in records]
    return sorted(out, key=lambda r: (r["t_send"], r["role"], r["stream"]))


def run_scenario(plan: Plan, argv: list[str]) -> int:
    """Run ``plan.scenario`` on every arm in every order and write the receipt; 0 if
    ``bench check`` passes on it, else 1."""
    sc = plan.scenario
    assert sc is not None
    run_id = new_run_id()
    plan.out.mkdir(parents=True, exist_ok=True)
    # Before any server starts: hashing large model files must not overlap a measurement.
    env = envmod.collect({a.name: a.command for a in plan.arms}, plan.hash_models)
    config: dict[str, Any] = {
        "schema": 1,
        "kind": "scenario",
        "run_id": run_id,
        "argv": argv,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "arms": [a.as_json() for a in plan.arms],
        "orders": plan.orders,
        "order_list": arm_orders([a.name for a in plan.arms], plan.orders),
        "scenario": sc.as_json(),
        "sampling": asdict(plan.sampling),
        "launches": [],
    }
    records: list[Record] = []
    total = requests_per_arm(sc) * len(plan.arms) * plan.orders
    t0 = time.perf_counter()

    async def work(target: Target) -> None:
        await _scenario_work(sc, plan, run_id, t0, records, target)

    config["launches"] = run_arms(plan, total, work)
    summary = write_scenario_receipt(plan.out, config, env, _ordered(records))
    table = format_scenario_table(summary, scenario_title(config))
    return finish(plan, check_receipt(plan.out), table)
