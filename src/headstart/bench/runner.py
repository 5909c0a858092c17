"""Run the bench: every arm in every order, the workload against each, then the receipt.

Job: for each order (arms as given, then reversed, alternating), for each arm: start a fresh
server process (command arms) or use the URL, send each prompt's cold request and its bursts
(``workload.schedule``), and collect the rows; then record the environment, write the
receipt, check it, and print the table last. A progress bar on stderr counts requests.
The arm loop (:func:`run_arms`) is shared with the prefill scenarios (``scenario_run.py``),
which ``command.py`` runs instead when a plan has ``scenario`` set.

Non-goals: measuring (``client.py``), summarising (``summary.py``), judging (``check.py``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from headstart.bench import env as envmod
from headstart.bench.arms import ArmProcess, ArmSpec, arm_orders, model_id, server_info, wait_ready
from headstart.bench.check import CheckReport, check_receipt
from headstart.bench.client import burst, open_session
from headstart.bench.receipt import run_title, write_receipt
from headstart.bench.rows import Row
from headstart.bench.scenarios import Scenario
from headstart.bench.summary import format_table
from headstart.bench.workload import Prompt, Sampling, request_body, request_sha, salt_for, schedule
from headstart.collector import collector_paused


@dataclass
class Plan:
    """Everything a run needs, already validated."""

    arms: list[ArmSpec]
    prompts: list[Prompt]
    sampling: Sampling
    streams: list[int]
    bursts: int
    orders: int
    agree: str
    salt: str  # auto | always | never
    out: Path
    ready_timeout: float = 600.0
    request_timeout: float = 600.0
    model_name: str | None = None  # sent as "model"; default: the server's /v1/models id
    api_key: str | None = None  # never written to the receipt
    hash_models: bool = True
    plot: bool = True
    progress: bool = True
    #: When set, the run is this prefill scenario (``scenario_run.py``) instead of the prompt
    #: workload; ``prompts``, ``streams``, ``bursts``, ``agree`` and ``salt`` are then unused.
    scenario: Scenario | None = None

    @property
    def salted(self) -> bool:
        # A URL arm's server lives across orders, so without a salt its "cold" request in
        # order 1 would hit what order 0 cached. Salting every arm keeps bodies identical
        # across arms within an order, so their outputs stay comparable.
        return self.salt == "always" or (
            self.salt == "auto" and any(a.url is not None for a in self.arms)
        )

    def requests_per_arm(self) -> int:
        return len(self.prompts) * sum(s for _, s, _ in schedule(self.streams, self.bursts))


@dataclass(frozen=True)
class Target:
    """One ready arm in one order: what a run's ``work`` sends to, and the bar it counts
    finished requests on."""

    arm: str
    order: int
    slot: int
    url: str
    model: str | None  # sent as "model"; None: the server has no /v1/models id
    bar: tqdm

    def done(self) -> None:
        """Count one finished request."""
        self.bar.update(1)


class _Sink:
    """Collects rows and distinct outputs of one run."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.outputs: dict[str, Any] = {}


async def _workload(
    plan: Plan,
    run_id: str,
    target: Target,
    t0: float,
    sink: _Sink,
) -> None:
    arm, order, slot, model = target.arm, target.order, target.slot, target.model
    headers = {"Content-Type": "application/json", **auth_headers(plan)}
    width = max(plan.streams) + 4
    async with open_session(width, plan.request_timeout) as client:
        for prompt in plan.prompts:
            salt = salt_for(run_id, order, prompt.id) if plan.salted else None
            body = request_body(prompt, plan.sampling, salt)
            sha = request_sha(body)
            if model is not None:
                body = {"model": model, **body}
            for phase, streams, rep in schedule(plan.streams, plan.bursts):
                with collector_paused():  # no collection stalls a measured burst
                    results = await burst(
                        client,
                        target.url + prompt.endpoint,
                        body,
                        streams,
                        t0,
                        headers,
                        on_done=target.done,
                    )
                for i, (row, output) in enumerate(results):
                    sink.rows.append(
                        {
                            "arm": arm,
                            "order": order,
                            "slot": slot,
                            "prompt_id": prompt.id,
                            "phase": phase,
                            "streams": streams,
                            "rep": rep,
                            "stream": i,
                            "request_sha": sha,
                            **row,
                        }
                    )
                    sink.outputs.setdefault(row["fingerprint"], output.as_json())


def auth_headers(plan: Plan) -> dict[str, str]:
    """The Authorization header of every request, if the plan has an API key."""
    return {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else {}


#: What a run sends to one ready arm.
Work = Callable[[Target], Awaitable[None]]


def _run_arm(plan: Plan, spec: ArmSpec, order: int, slot: int, bar: tqdm, work: Work) -> dict:
    """One arm in one order: start or reach its server, run ``work`` on it, stop it again;
    returns its launch record."""
    bar.set_description(f"{spec.name} (order {order})")
    bar.set_postfix_str("starting" if spec.command else "connecting")
    started = time.perf_counter()
    proc = None
    if spec.command is not None:
        proc = ArmProcess(spec, plan.out / "logs" / f"{spec.name}-o{order}.log")
        url = proc.url
    else:
        assert spec.url is not None
        url = spec.url
    launch: dict[str, Any] = {
        "arm": spec.name,
        "order": order,
        "slot": slot,
        "url": url,
        "argv": proc.argv if proc else None,
        "log": str(proc.log_path.relative_to(plan.out)) if proc else None,
    }
    try:
        if proc is not None:
            proc.wait_ready(plan.ready_timeout)
        else:
            wait_ready(url, plan.ready_timeout)
        launch["ready_s"] = time.perf_counter() - started
        info = server_info(url, auth_headers(plan))
        model = plan.model_name or model_id(info)
        launch.update(server=info, model=model)
        bar.set_postfix_str("")
        # What the client holds from here on (imports, the plan, earlier arms' records) is
        # never scanned again: a full collection over it paused this process for 20-70 ms on
        # a 2-core machine, in the middle of a burst's streams (the server is not paused).
        gc.collect()
        gc.freeze()
        asyncio.run(work(Target(spec.name, order, slot, url, model, bar)))
    finally:
        if proc is not None:
            bar.set_postfix_str("stopping")
            launch["exit_status"] = proc.stop()
    return launch


def run_arms(plan: Plan, total: int, work: Work) -> list[dict[str, Any]]:
    """Every arm in every order (alternating, ``arms.arm_orders``), ``work`` on each, under a
    progress bar of ``total`` requests; returns the launch records in run order."""
    orders = arm_orders([a.name for a in plan.arms], plan.orders)
    by_name = {a.name: a for a in plan.arms}
    launches = []
    with tqdm(
        total=total, unit="req", file=sys.stderr, dynamic_ncols=True, disable=not plan.progress
    ) as bar:
        for k, order in enumerate(orders):
            for slot, name in enumerate(order):
                launches.append(_run_arm(plan, by_name[name], k, slot, bar, work))
    return launches


def new_run_id() -> str:
    """A run's id: its UTC start time and a random tag (salts use it, so it is unique)."""
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)


def finish(plan: Plan, report: CheckReport, table: str) -> int:
    """Print the check report and the receipt's path (stderr), then the table last (stdout);
    0 if the check passed, else 1."""
    print(report.text(), file=sys.stderr)
    print(f"receipt: {plan.out}", file=sys.stderr)
    sys.stderr.flush()
    print(table, end="")
    return 0 if report.ok else 1


def run(plan: Plan, argv: list[str]) -> int:
    """Run the prompt workload and write the receipt; 0 if ``bench check`` passes on it, else
    1 (a plan with ``scenario`` set goes to ``scenario_run.run_scenario`` instead)."""
    assert plan.scenario is None, "prefill scenarios run through scenario_run.run_scenario"
    run_id = new_run_id()
    plan.out.mkdir(parents=True, exist_ok=True)
    # Before any server starts: hashing large model files must not overlap a measurement.
    env = envmod.collect({a.name: a.command for a in plan.arms}, plan.hash_models)
    config: dict[str, Any] = {
        "schema": 1,
        "run_id": run_id,
        "argv": argv,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "arms": [a.as_json() for a in plan.arms],
        "orders": plan.orders,
        "order_list": arm_orders([a.name for a in plan.arms], plan.orders),
        "streams": plan.streams,
        "bursts": plan.bursts,
        "sampling": asdict(plan.sampling),
        "agree": plan.agree,
        "salt": plan.salt,
        "salted": plan.salted,
        "prompts": [p.as_json() for p in plan.prompts],
        "launches": [],
    }
    sink = _Sink()
    total = plan.requests_per_arm() * len(plan.arms) * plan.orders
    t0 = time.perf_counter()

    async def work(target: Target) -> None:
        await _workload(plan, run_id, target, t0, sink)

    config["launches"] = run_arms(plan, total, work)
    summary = write_receipt(plan.out, config, env, sink.rows, sink.outputs, plot=plan.plot)
    return finish(plan, check_receipt(plan.out), format_table(summary, run_title(config)))
