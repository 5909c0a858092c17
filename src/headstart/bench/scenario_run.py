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
TTFT is taken at the first
streamed delta that carries a token, as in the rest of bench (``client.measure``).

``agent`` sends one turn at a time: each turn's prompt appends the ids the server generated
for the previous turn (``scenarios.agent_turn``), so the next turn is built only once the
previous one ended. A failed turn ends its repeat there (``bench check`` reports the failure
and the turns it left unsent); a turn answered without its token ids ends the run with an
error, as no later prompt could be built.

``return`` sends its conversations one after another, each a step of its own (the order the
server's cache sees them is the design's). Around each request it reads the server's
prompt-cache transfer counters (:data:`TRANSFER_COUNTERS`) from ``/metrics`` on a connection
of its own, just before the request is sent and right after it ended, and records their
growth (``scenario_summary.RETURN_FIELDS``); a server whose ``/metrics`` lacks them when the
arm starts is not asked again, and its records hold None there.

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

import aiohttp

from headstart.bench import env as envmod
from headstart.bench.arms import arm_orders
from headstart.bench.check import check_receipt
from headstart.bench.client import measure, open_session, token_ids
from headstart.bench.receipt import write_scenario_receipt
from headstart.bench.runner import Plan, Target, auth_headers, finish, new_run_id, run_arms
from headstart.bench.scenario_summary import (
    Record,
    format_scenario_table,
    record_schema,
    scenario_title,
)
from headstart.bench.scenarios import (
    DECODING_DELTAS,
    Request,
    Scenario,
    agent_cold,
    agent_turn,
    all_steps,
    requests_per_arm,
    salt_base,
    token_body,
)
from headstart.bench.workload import COMPLETIONS, Sampling, request_sha
from headstart.collector import collector_paused
from headstart.errors import HeadstartError

#: headstart's prompt-cache transfer counters on ``/metrics`` (``server/metrics.py``), by the
#: record field their growth across a request goes to.
TRANSFER_COUNTERS = {
    "host_restored_bytes": "headstart_prompt_cache_host_restored_bytes_total",
    "host_restore_s": "headstart_prompt_cache_host_restore_seconds_total",
    "demoted_bytes": "headstart_prompt_cache_demoted_bytes_total",
    "demote_s": "headstart_prompt_cache_demote_seconds_total",
}


def parse_counters(text: str) -> dict[str, float] | None:
    """The :data:`TRANSFER_COUNTERS` in a Prometheus exposition text, by field; None unless
    every one is there (unlabelled samples: ``name value [timestamp]``)."""
    fields = {name: field for field, name in TRANSFER_COUNTERS.items()}
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if name in fields:
            try:
                values[fields[name]] = float(rest.split()[0])
            except (ValueError, IndexError):
                return None
    return values if len(values) == len(fields) else None


def counter_growth(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, int | float | None]:
    """Each counter's growth from ``before`` to ``after`` (bytes as ints), all None where a
    reading is missing or a counter went down (the server restarted in between)."""
    if before is None or after is None or any(after[f] < before[f] for f in before):
        return dict.fromkeys(TRANSFER_COUNTERS)
    return {
        f: round(after[f] - before[f]) if f.endswith("_bytes") else after[f] - before[f]
        for f in TRANSFER_COUNTERS
    }


class Counters:
    """Reads a server's :data:`TRANSFER_COUNTERS` from ``/metrics`` on a connection of its
    own, so no lane's connection or timing is touched."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float) -> None:
        self.url, self.headers = url + "/metrics", headers
        self.client = open_session(1, timeout)

    @classmethod
    async def open(cls, url: str, headers: dict[str, str], timeout: float) -> Counters | None:
        """A reader for the server at ``url``, or None when its ``/metrics`` does not hold
        the counters (another server: none of its records gets figures)."""
        counters = cls(url, headers, timeout)
        if await counters.read() is None:
            await counters.aclose()
            return None
        return counters

    async def read(self) -> dict[str, float] | None:
        """The counters now, or None when the scrape failed."""
        try:
            async with self.client.get(self.url, headers=self.headers) as r:
                if r.status != 200:
                    return None
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return parse_counters(text)

    async def aclose(self) -> None:
        await self.client.close()


class Lanes:
    """One HTTP client per concurrent stream, each held to one kept-alive connection, so a
    stream never waits for a connection and never shares one."""

    def __init__(self, n: int, timeout: float) -> None:
        self.clients = [open_session(1, timeout) for _ in range(n)]

    async def warm(self, lane: int, url: str, headers: dict[str, str]) -> None:
        """Open (or keep) lane ``lane``'s connection with a cheap request. A server without
        ``/v1/models`` still opens the connection; a failure leaves the send to connect."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self.clients[lane].get(url + "/v1/models", headers=headers) as r:
                await r.read()  # read to its end: the connection goes back to the pool

    async def aclose(self) -> None:
        for c in self.clients:
            await c.close()


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
    #: ``return`` on a server exposing them: its transfer counters, read around each request.
    counters: Counters | None = None

    async def send(self, lane: int, req: Request, watch: Callable[[int], None] | None) -> Record:
        """Send ``req`` on ``lane``, append its record and return it; ``watch(n)`` is called
        with the number of deltas seen so far at each delta."""
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
        before = await self.counters.read() if self.counters is not None else None
        row, out = await measure(
            self.lanes.clients[lane], t.url + COMPLETIONS, payload, self.t0, self.headers, on_delta
        )
        after = await self.counters.read() if self.counters is not None else None
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
        if self.scenario == "agent":
            record["output_ids"] = token_ids(out.tokens)
        if self.scenario == "return":
            record.update(counter_growth(before, after))
        self.records.append(record)
        return record

    async def step(self, reqs: list[Request], beside: bool = False) -> list[Record]:
        """Warm one lane per request, wait at a barrier, send them together; with ``beside``
        the last request (the long prompt) goes once every other one is decoding. Returns
        their records in request order. The client's cycle collector runs before the step,
        never inside it: a collection that 16 streams' allocations trigger would stall every
        stream this client reads, and their times would carry it."""
        with collector_paused():
            return await self._step(reqs, beside)

    async def _step(self, reqs: list[Request], beside: bool) -> list[Record]:
        barrier = asyncio.Barrier(len(reqs))
        decoding = [asyncio.Event() for _ in reqs[:-1]] if beside else []

        async def one(lane: int, req: Request) -> Record:
            arriving = beside and lane == len(reqs) - 1
            if not arriving:
                await self.lanes.warm(lane, self.target.url, self.headers)
            await barrier.wait()
            if not beside:
                return await self.send(lane, req, None)
            if arriving:
                for e in decoding:
                    await e.wait()
                # Warmed now, not before the barrier: however long the decoders took to
                # start, its connection is fresh (servers close idle ones after seconds).
                await self.lanes.warm(lane, self.target.url, self.headers)
                return await self.send(lane, req, None)
            event = decoding[lane]

            def watch(n: int) -> None:
                if n >= DECODING_DELTAS:
                    event.set()

            try:
                return await self.send(lane, req, watch)
            finally:
                event.set()  # a failed or short stream must not hold the long prompt back

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs))))

    async def agent(self, sc: Scenario, max_tokens: int, base: str) -> None:
        """Every repeat of ``agent``, in the order ``scenarios.agent_steps`` rebuilds: each
        turn from the previous one and its answer's ids, then the cold reference (see the
        module docstring for a failed turn or one without ids)."""
        for rep in range(sc.reps):
            previous, answer = None, ()
            for turn in range(sc.turns):
                req = agent_turn(sc, max_tokens, base, rep, previous, answer)
                (record,) = await self.step([req])
                if record["error"] or record["status"] != 200:
                    break
                ids, n = record["output_ids"], record["completion_tokens"]
                if ids is None or (n is not None and len(ids) != n):
                    got = "none" if ids is None else f"{len(ids)} for {n} tokens"
                    raise HeadstartError(
                        f"arm {self.target.arm!r}: agent turn {turn + 1} came back without the "
                        f"token ids it generated ({got}); --scenario agent appends them to the "
                        "next prompt, so the server must return them on /v1/completions for "
                        "logprobs=0 with return_tokens_as_token_ids (as vLLM and headstart do)"
                    )
                previous, answer = req, tuple(ids)
            else:
                assert previous is not None  # turns >= 1
                await self.step([agent_cold(sc, max_tokens, base, previous)])


async def _scenario_work(
    sc: Scenario, plan: Plan, run_id: str, t0: float, records: list[Record], target: Target
) -> None:
    base = salt_base(run_id, target.arm, target.order, sc.name)
    headers = {"Content-Type": "application/json", **auth_headers(plan)}
    lanes = Lanes(sc.width, plan.request_timeout)
    counters = None
    if sc.name == "return":
        counters = await Counters.open(target.url, headers, plan.request_timeout)
    arm = _Arm(target, sc.name, plan.sampling, headers, t0, lanes, records, counters)
    try:
        if sc.name == "agent":
            await arm.agent(sc, plan.sampling.max_tokens, base)
        else:
            for step in all_steps(sc, plan.sampling.max_tokens, base):
                await arm.step(step, beside=sc.name == "beside")
    finally:
        await lanes.aclose()
        if counters is not None:
            await counters.aclose()


def _ordered(records: list[Record], scenario: str) -> list[Record]:
    """Records in sending order, each with the schema's fields in schema order."""
    schema = record_schema(scenario)
    out = [{f: r[f] for f in schema} for r in records]
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
    # Every time in the rows counts from t0 on this clock: on Linux CLOCK_MONOTONIC, which a
    # server on the same host reads too, so its own marks can be put beside the client's
    # (benchmarks/request_timeline.py --bursts FILE --receipt DIR).
    config["perf_counter_t0"] = t0

    async def work(target: Target) -> None:
        await _scenario_work(sc, plan, run_id, t0, records, target)

    config["launches"] = run_arms(plan, total, work)
    summary = write_scenario_receipt(plan.out, config, env, _ordered(records, sc.name))
    table = format_scenario_table(summary, scenario_title(config))
    return finish(plan, check_receipt(plan.out), table)
