"""Replicas behind a real, existing router: SGLang's model gateway (``sglang-router``).

Two `headstart serve` replicas of the default model on loopback behind ``python -m
sglang_router.launch_router --policy cache_aware``: the gateway registers them from what they
report (``/health``, ``/server_info``, ``/model_info``, ``/v1/models``), lists the model by its
served name, sends each conversation's turns where its prompt-state snapshots are, and a replica
killed mid-run costs only the requests it was running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
from server_proc import ServerProcess, free_port

pytest.importorskip("sglang_router")
pytestmark = pytest.mark.slow

MODEL = "headstart-default"


@contextmanager
def gateway(log_dir):
    """Two replicas and the gateway in front of them, ready (both workers registered)."""
    replicas = [ServerProcess("--parallel", "4", "--context", "1024") for _ in range(2)]
    for r in replicas:
        r.wait_ready()
    port = free_port()
    log = open(log_dir / "router.log", "wb")  # noqa: SIM115
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            "cache_aware",
            "--prometheus-port",
            str(free_port()),
            "--health-check-interval-secs",
            "1",
            "--worker-urls",
            *[r.url for r in replicas],
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert router.poll() is None, "the router exited"
            try:
                workers = httpx.get(url + "/workers", timeout=1).json()["workers"]
                if sum(w["is_healthy"] and w["model_id"] == MODEL for w in workers) == 2:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.2)
        else:
            raise TimeoutError("the router did not register both replicas")
        yield url, replicas
    finally:
        os.killpg(router.pid, signal.SIGTERM)
        router.wait(timeout=30)
        log.close()
        for r in replicas:
            r.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with gateway(tmp_path_factory.mktemp("router")) as f:
        yield f


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def test_the_gateway_lists_the_served_model(fleet):
    url, _ = fleet
    assert [m.id for m in client(url).models.list().data] == [MODEL]


def test_every_turn_of_every_conversation_hits_its_replica_cache(fleet):
    """Four conversations of four turns each, interleaved: every turn after the first restores
    cached state, so each conversation keeps landing on the replica holding its snapshots."""
    url, replicas = fleet
    c = client(url)
    talks = [
        [{"role": "user", "content": f"Conversation {i}: write a function number {i}."}]
        for i in range(4)
    ]
    for turn in range(4):
        for i, messages in enumerate(talks):
            r = c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=8, temperature=0
            )
            cached = r.usage.prompt_tokens_details.cached_tokens
            if turn:
                assert cached > 0, (i, turn)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content or "ok"},
                {"role": "user", "content": f"Turn {turn}: now make it faster."},
            ]
    served = [r.health()["running"] + r.health()["free_slots"] for r in replicas]
    assert served == [4, 4]  # both alive, nothing stuck


def test_a_killed_replica_costs_only_its_own_requests(tmp_path):
    """Eight long streams through the gateway; one replica is killed while they run. The
    streams it held fail, the others finish, and new requests are served by the survivor."""
    with gateway(tmp_path) as (url, replicas):
        killed_mid_run(url, replicas)


WORDS = ["apple", "zebra", "mango", "violin", "quartz", "harbor", "kettle", "nebula"]


def killed_mid_run(url: str, replicas: list[ServerProcess]) -> None:
    c = client(url)
    outcomes: dict[int, str] = {}

    def stream(i: int) -> None:
        try:
            s = c.completions.create(
                model=MODEL,
                # Prompts with nothing in common: the cache-aware policy spreads them by load.
                prompt=f"{WORDS[i]} = {i}\n" * 3,
                max_tokens=600,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            n = sum(1 for _ in s)
            outcomes[i] = "done" if n >= 600 else "short"
        except Exception as e:  # the killed replica's streams
            outcomes[i] = type(e).__name__

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    while True:  # until every stream is admitted somewhere
        held = [r.health()["running"] + r.health()["waiting"] for r in replicas]
        if sum(held) == 8 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert sum(held) == 8 and min(held) > 0, held  # both replicas hold streams
    victim, survivor = replicas
    victim.proc.kill()
    victim.proc.wait(timeout=30)
    for t in threads:
        t.join(timeout=120)
    done = [i for i, o in outcomes.items() if o == "done"]
    assert len(outcomes) == 8
    assert len(done) >= held[1]  # every stream the survivor held finished
    assert 8 - len(done) <= held[0]  # only the killed replica's streams were lost
    # The gateway stops sending to the dead replica: new requests are all answered.
    time.sleep(3)  # a few health checks
    for i in range(4):
        r = c.completions.create(model=MODEL, prompt=f"x = {i}", max_tokens=4, temperature=0)
        assert r.choices[0].text is not None
    assert survivor.health()["status"] == "ok"
