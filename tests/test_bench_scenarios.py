"""`headstart bench --scenario`: the prefill scenarios against a real headstart server (the
embedded default model), against a keep-alive fake (one connection per stream), `bench
check` catching tampered scenario receipts, and the pure parts with hand-made inputs.

Speed is never asserted: only structure and invariants (every request answered, TTFT > 0,
the design's request count, gap statistics recomputed from the recorded delta times)."""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from server_proc import serving

from headstart import cli
from headstart.bench.check import check_receipt, verify
from headstart.bench.env import sha256_file
from headstart.bench.rows import STAMPS
from headstart.bench.scenario_run import TRANSFER_COUNTERS, counter_growth, parse_counters
from headstart.bench.scenario_summary import (
    SERVER_COUNTERS,
    gaps,
    gaps_during,
    repeat_metrics,
)
from headstart.bench.scenarios import (
    DECODING_DELTAS,
    SALT_TOKENS,
    Request,
    all_steps,
    make_scenario,
    repeat_steps,
    requests_per_arm,
    salt_base,
    salted_prompt,
    token_body,
    token_stream,
)
from headstart.bench.workload import Sampling
from headstart.server.metrics import Metrics

QUIET = ["--no-progress", "--no-model-hash"]


def bench(*args: str) -> int:
    return cli.main(["bench", *args])


def records(receipt: Path) -> list[dict]:
    return json.loads((receipt / "requests.json").read_text())["requests"]


def summary(receipt: Path) -> dict:
    return json.loads((receipt / "summary.json").read_text())


def group(receipt: Path, label: str, arm: str) -> dict:
    (g,) = [g for g in summary(receipt)["groups"] if g["label"] == label and g["arm"] == arm]
    return g["metrics"]


def answered(recs: list[dict], max_tokens: int | None = None) -> bool:
    """Every request got a 200, streamed its tokens, and ended with [DONE]."""
    return all(
        r["status"] == 200
        and not r["error"]
        and r["t_done"] is not None
        and r["ttft_s"] > 0
        and r["n_deltas"] == len(r["times"]) > 0
        and r["prompt_tokens"] == r["prompt_len"]
        and (max_tokens is None or r["completion_tokens"] == r["max_tokens"] == max_tokens)
        for r in recs
    )


# ----------------------------------------------------------------------------- real headstart


@pytest.fixture(scope="module")
def url_server() -> Iterator[str]:
    """One headstart server (embedded default model) for the URL-arm runs of this module."""
    with serving("--parallel", "4", "--context", "512") as srv:
        yield srv.url


@pytest.fixture(scope="module")
def runs(url_server, tmp_path_factory) -> dict[str, Path]:
    """Each scenario once with tiny sizes against the URL server; burst also against a
    command arm started fresh per order (so each order's first burst is a fresh server's)."""
    tmp = tmp_path_factory.mktemp("scenarios")
    url = ["--arm", f"url={url_server}"]
    serve = f"{sys.executable} -m headstart serve --port {{port}} --parallel 4 --context 512"
    cmd = ["--arm", f"cmd=cmd:{serve}"]
    argv = {
        "long": [*url, "--prompt-tokens", "64", "--repeats", "2", "--orders", "1"],
        "burst": [*cmd, *url, "--streams", "3", "--prompt-tokens", "16", "--repeats", "2"],
        "turn": [*url, "--history-tokens", "100", "--turn-tokens", "5", "--orders", "1"],
        "beside": [
            *url,
            "--streams",
            "2",
            "--prompt-tokens",
            "128",
            "--decode-tokens",
            "40",
            "--repeats",
            "2",
            "--orders",
            "1",
        ],
    }
    out = {}
    for name, args in argv.items():
        out[name] = tmp / name
        before = time.perf_counter()
        rc = bench("--scenario", name, *args, "--max-tokens", "3", *QUIET, "--out", str(out[name]))
        assert rc == 0, check_receipt(out[name]).text()
        CLOCK[name] = (before, time.perf_counter())
    return out


#: Scenario -> this process's perf_counter before and after its run.
CLOCK: dict[str, tuple[float, float]] = {}


@pytest.mark.slow
def test_long(runs, capsys):
    recs = records(runs["long"])
    assert [(r["role"], r["rep"]) for r in recs] == [("long", 0), ("long", 1)]
    assert answered(recs, 3) and all(r["prompt_len"] == 64 for r in recs)
    assert [r["cached_tokens"] for r in recs] == [0, 0]  # salted: new to the server each time
    ttft = group(runs["long"], "long", "url")["ttft_s"]
    assert ttft["each"] == [r["ttft_s"] for r in recs] and ttft["n"] == 2
    assert ttft["median"] == statistics.median(ttft["each"])
    table = (runs["long"] / "table.txt").read_text()
    assert "scenario long" in table and table.splitlines()[3].startswith("long    ttft")
    assert bench("check", str(runs["long"])) == 0
    assert "OK (2 rows)" in capsys.readouterr().out


@pytest.mark.slow
def test_burst_first_and_later(runs):
    recs = records(runs["burst"])
    # 2 arms x 2 orders x (first + 2 repeats) x 3 streams
    assert len(recs) == 2 * 2 * 3 * 3 and answered(recs, 3)
    # The response's headers come back after the send and before the first token.
    assert all(r["t_send"] < r["t_head"] <= r["t_first"] for r in recs)
    config = json.loads((runs["burst"] / "config.json").read_text())
    # The rows' times count from perf_counter_t0 on this host's perf_counter clock, so a
    # server's own marks can be put beside them.
    before, after = CLOCK["burst"]
    t0 = config["perf_counter_t0"]
    assert before <= t0 and t0 + max(r["t_done"] for r in recs) <= after
    assert [launch["exit_status"] for launch in config["launches"] if launch["arm"] == "cmd"] == [
        0,
        0,
    ]
    for arm in ("cmd", "url"):
        for order in (0, 1):
            for rep in range(3):
                burst = [r for r in recs if (r["arm"], r["order"], r["rep"]) == (arm, order, rep)]
                assert sorted(r["stream"] for r in burst) == [0, 1, 2]
                assert len({r["request_sha"] for r in burst}) == 3  # N new prompts, not one
        first, later = group(runs["burst"], "first", arm), group(runs["burst"], "later", arm)
        assert first["ttft_max_s"]["n"] == 2 and later["ttft_max_s"]["n"] == 4  # 2 orders
        (rep0,) = [
            r
            for r in summary(runs["burst"])["repeats"]
            if (r["arm"], r["order"], r["rep"])
            == (
                arm,
                0,
                0,
            )
        ]
        ttfts = [r["ttft_s"] for r in recs if (r["arm"], r["order"], r["rep"]) == (arm, 0, 0)]
        assert rep0["label"] == "first"
        assert rep0["metrics"] == {
            "ttft_max_s": max(ttfts),
            "ttft_median_s": statistics.median(ttfts),
        }
    ratios = {r["metric"] for r in summary(runs["burst"])["ratios"] if r["arm"] == "url"}
    assert ratios == {"ttft_max_s", "ttft_median_s"}


@pytest.mark.slow
def test_turn_hits_the_prompt_cache(runs):
    recs = records(runs["turn"])
    assert len(recs) == 3 * 3 and answered(recs, 3)
    for rep in range(3):
        history, turn, cold = (
            next(r for r in recs if r["rep"] == rep and r["role"] == role)
            for role in ("history", "turn", "cold")
        )
        assert (history["prompt_len"], turn["prompt_len"], cold["prompt_len"]) == (100, 105, 105)
        assert history["t_done"] <= turn["t_send"] and turn["t_done"] <= cold["t_send"]
        # The server says where the new turn's prefix came from: the history just sent.
        assert 0 < turn["cached_tokens"] <= 100 and cold["cached_tokens"] == 0
    assert group(runs["turn"], "turn", "url")["cached_tokens"]["each"] == [
        r["cached_tokens"] for r in recs if r["role"] == "turn"
    ]


@pytest.mark.slow
def test_beside_gaps_come_from_the_decoders_delta_times(runs):
    recs = records(runs["beside"])
    assert len(recs) == 2 * 3 and answered(recs)
    for rep, measured in enumerate(summary(runs["beside"])["repeats"]):
        assert measured["rep"] == rep
        decoders = [r for r in recs if r["rep"] == rep and r["role"] == "decoder"]
        (long,) = [r for r in recs if r["rep"] == rep and r["role"] == "long"]
        assert [d["completion_tokens"] for d in decoders] == [40, 40]
        assert long["prompt_len"] == 128 and long["completion_tokens"] == 3
        # The long prompt went only once every decoder was decoding.
        assert all(long["t_send"] >= d["times"][DECODING_DELTAS - 1] for d in decoders)
        every = [b - a for d in decoders for a, b in itertools.pairwise(d["times"])]
        during = [
            b - a
            for d in decoders
            for a, b in itertools.pairwise(d["times"])
            if b > long["t_send"] and a < long["t_first"]
        ]
        m = measured["metrics"]
        assert m["long_ttft_s"] == long["ttft_s"] > 0
        assert m["gap_max_s"] == max(every) >= m["prefill_gap_max_s"] == max(during) > 0
        assert m["gap_median_s"] == statistics.median(every)
        through = sum(d["times"][-1] > long["t_first"] for d in decoders)
        assert m["decoders_through"] == through


#: A device tier that holds one 100-token snapshot of the embedded model (about 0.7 MB) and a
#: host tier for the rest: each other conversation pushes the one before into host memory.
HOST_TIER = "--prompt-cache-mib 1 --prompt-cache-host-mib 64"
RETURN_ROLES = [
    ("history", 0),
    ("other", 0),
    ("other", 1),
    ("other", 2),
    ("return", 0),
    ("cold", 0),
]


@pytest.fixture(scope="module")
def return_run(url_server, tmp_path_factory) -> Path:
    """``return`` with tiny sizes on two arms: a command arm with :data:`HOST_TIER` (its
    returns come back from host memory) and the URL server (a 2 GiB device tier that keeps
    every conversation, and no host tier)."""
    out = tmp_path_factory.mktemp("return") / "receipt"
    serve = f"{sys.executable} -m headstart serve --port {{port}} --parallel 2 --context 512"
    arms = ["--arm", f"host=cmd:{serve} {HOST_TIER}", "--arm", f"url={url_server}"]
    sizes = ["--history-tokens", "100", "--turn-tokens", "5", "--others", "3", "--repeats", "2"]
    rc = bench(
        "--scenario", "return", *arms, *sizes, "--orders", "1", "--max-tokens", "3", *QUIET,
        "--out", str(out),
    )  # fmt: skip
    assert rc == 0, check_receipt(out).text()
    return out


@pytest.mark.slow
def test_return_comes_back_from_the_host_tier(return_run, capsys):
    recs = records(return_run)
    assert len(recs) == 2 * 2 * 6 and answered(recs, 3)
    for arm, rep in itertools.product(("host", "url"), range(2)):
        mine = [r for r in recs if (r["arm"], r["rep"]) == (arm, rep)]
        assert [(r["role"], r["stream"]) for r in mine] == RETURN_ROLES
        assert [r["prompt_len"] for r in mine] == [100] * 4 + [105] * 2
        assert all(a["t_done"] <= b["t_send"] for a, b in itertools.pairwise(mine))
        assert len({r["request_sha"] for r in mine}) == 6
        # Only the return finds a prefix: its whole history, from wherever the server kept it.
        assert [r["cached_tokens"] for r in mine] == [0] * 4 + [100, 0]
        back = mine[4]
        restored = [r["host_restored_bytes"] for r in mine]
        if arm == "host":  # restored from host memory: the return and nothing else
            assert restored[4] > 0 and back["host_restore_s"] > 0
            assert restored[:4] == [0] * 4 and restored[5] == 0
            assert all(r["demoted_bytes"] > 0 and r["demote_s"] > 0 for r in mine[1:])
        else:  # no host tier: nothing moved
            assert restored == [0] * 6 and {r["demoted_bytes"] for r in mine} == {0}
    host = group(return_run, "return", "host")
    backs = [r for r in recs if r["arm"] == "host" and r["role"] == "return"]
    colds = [r for r in recs if r["arm"] == "host" and r["role"] == "cold"]
    assert host["ttft_vs_cold"]["each"] == [
        b["ttft_s"] / c["ttft_s"] for b, c in zip(backs, colds, strict=True)
    ]
    assert host["host_restore_bandwidth"]["each"] == [
        b["host_restored_bytes"] / b["host_restore_s"] for b in backs
    ]
    assert group(return_run, "return", "url")["host_restore_bandwidth"]["n"] == 0
    table = (return_run / "table.txt").read_text()
    # Bandwidth rows only where the server moved something between its tiers.
    rows = [x.split() for x in table.splitlines() if "GB/s" in x]
    assert [x[: x.index("GB/s") + 2] for x in rows] == [
        ["return", "host", "restore", "GB/s", "host"],
        ["return", "demote", "GB/s", "host"],
    ]
    assert bench("check", str(return_run)) == 0
    assert "OK (24 rows)" in capsys.readouterr().out


@pytest.mark.slow
def test_check_fails_on_an_edited_transfer_count(return_run, tmp_path):
    copy = Path(shutil.copytree(return_run, tmp_path / "copy"))

    def edit(recs):
        back = next(r for r in recs if r["arm"] == "host" and r["role"] == "return")
        back["host_restored_bytes"] *= 2

    rewrite(copy, edit)
    assert "summary.json does not match the records" in problems(copy)


# ----------------------------------------------------------------------------- bench check


@pytest.fixture
def copy(runs, tmp_path) -> Path:
    return Path(shutil.copytree(runs["beside"], tmp_path / "copy"))


def rewrite(receipt: Path, edit) -> None:
    """Apply ``edit(records)`` to requests.json, then make the manifest agree again."""
    doc = json.loads((receipt / "requests.json").read_text())
    edit(doc["requests"])
    (receipt / "requests.json").write_text(json.dumps(doc))
    m = json.loads((receipt / "manifest.json").read_text())
    for name in m["files"]:
        m["files"][name]["sha256"] = sha256_file(receipt / name)
    m["rows"]["requests.json"] = len(doc["requests"])
    (receipt / "manifest.json").write_text(json.dumps(m))


def problems(receipt: Path) -> str:
    report = check_receipt(receipt)
    assert not report.ok
    return "\n".join(report.problems)


@pytest.mark.slow
def test_check_fails_on_an_edited_file(copy):
    doc = json.loads((copy / "requests.json").read_text())
    doc["requests"][0]["ttft_s"] /= 2
    (copy / "requests.json").write_text(json.dumps(doc))
    assert "requests.json: sha256 differs" in problems(copy)


@pytest.mark.slow
def test_check_fails_on_a_removed_request_even_with_a_fixed_manifest(copy):
    rewrite(copy, lambda recs: recs.pop(2))
    assert "missing request" in problems(copy)


@pytest.mark.slow
def test_check_fails_on_a_moved_delta_time(copy):
    def stall(recs):  # a decoder's gap made worse, times still sorted
        d = next(r for r in recs if r["role"] == "decoder")
        d["times"][-1] = d["t_last"] = d["t_done"] = d["times"][-1] + 1.0
        d["e2e_s"] = d["t_done"] - d["t_send"]
        d["decode_tok_s"] = (d["completion_tokens"] - 1) / (d["t_last"] - d["t_first"])

    rewrite(copy, stall)
    assert "summary.json does not match the records" in problems(copy)


@pytest.mark.slow
def test_check_fails_on_another_prompt(copy):
    def edit(recs):
        recs[0]["request_sha"] = "0" * 16

    rewrite(copy, edit)
    assert "request does not match the design" in problems(copy)


@pytest.mark.slow
def test_check_fails_on_an_early_long_prompt(copy):
    def early(recs):  # as if the long prompt had not waited for the decoders
        long = next(r for r in recs if r["role"] == "long")
        shift = long["t_send"] - next(r for r in recs if r["role"] == "decoder")["t_send"]
        for k in STAMPS:
            long[k] -= shift
        long["times"] = [t - shift for t in long["times"]]

    rewrite(copy, early)
    assert "sent before" in problems(copy)


# ----------------------------------------------------------------------------- a keep-alive fake


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class KeepAliveFake(BaseHTTPRequestHandler):
    """An OpenAI-compatible completions server on HTTP/1.1 keep-alive (chunked streams) that
    logs (method, client port) of every request. Reports the longest prompt prefix it has
    seen before as cached, in whole blocks of 8 tokens as vLLM does (so two salts that share
    a first token by chance are no hit). Not headstart in any way."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # each delta leaves at once, as from a real server
    log: list[tuple[str, int]]
    seen: list[list[int]]

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.log.append(("GET", self.client_address[1]))
        body = json.dumps({"object": "list", "data": [{"id": "fake-2"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def do_POST(self) -> None:
        self.log.append(("POST", self.client_address[1]))
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = req["prompt"]
        assert self.path == "/v1/completions" and req["model"] == "fake-2" and req["stream"]
        assert all(isinstance(t, int) and 1000 <= t < 4000 for t in ids)
        cached = max((common_prefix(s, ids) for s in self.seen), default=0) // 8 * 8
        self.seen.append(ids)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(req["max_tokens"]):
            time.sleep(0.002)
            self._chunk(
                b"data: " + json.dumps({"choices": [{"text": f" t{i}"}]}).encode() + b"\n\n"
            )
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": req["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        self._chunk(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")


@pytest.fixture
def fake() -> Iterator[tuple[str, list]]:
    handler = type("Fake", (KeepAliveFake,), {"log": [], "seen": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler.log
    httpd.shutdown()
    httpd.server_close()


def test_each_stream_keeps_one_warm_connection(fake, tmp_path):
    url, log = fake
    out = tmp_path / "fake-burst"
    argv = ["--arm", f"f={url}", "--streams", "3", "--prompt-tokens", "16", "--repeats", "2"]
    assert bench("--scenario", "burst", *argv, "--orders", "1", *QUIET, "--out", str(out)) == 0
    posts = [port for method, port in log if method == "POST"]
    # 3 bursts of 3; 3 lanes in all: every burst reuses the same kept-alive connections.
    assert len(posts) == 9 and len(set(posts)) == 3
    # Before each burst every lane is warmed on its own connection, and all are warm before
    # any prompt goes (readiness probes and server_info come first, on other connections).
    for k in range(3):
        block = log[len(log) - 6 * (3 - k) :][:6]
        assert [m for m, _ in block] == ["GET"] * 3 + ["POST"] * 3
        assert {p for _, p in block[:3]} == {p for _, p in block[3:]} == set(posts)
    assert verify(out).ok and len(records(out)) == 9


def test_turn_against_a_fake_sees_its_cache_report(fake, tmp_path):
    url, _ = fake
    out = tmp_path / "fake-turn"
    argv = ["--arm", f"f={url}", "--history-tokens", "40", "--turn-tokens", "4"]
    assert bench("--scenario", "turn", *argv, "--orders", "2", *QUIET, "--out", str(out)) == 0
    recs = records(out)
    assert len(recs) == 2 * 3 * 3
    # Salts differ per order and repeat, so only the turn finds a prefix: the whole history
    # (the cold prompt shares all but its salt, which comes first).
    assert {r["cached_tokens"] for r in recs if r["role"] == "turn"} == {40}
    assert {r["cached_tokens"] for r in recs if r["role"] != "turn"} == {0}


def test_return_against_a_fake_has_no_transfer_figures(fake, tmp_path):
    url, _ = fake
    out = tmp_path / "fake-return"
    argv = ["--arm", f"f={url}", "--history-tokens", "40", "--turn-tokens", "4", "--others", "3"]
    rc = bench(
        "--scenario", "return", *argv, "--repeats", "1", "--orders", "1", *QUIET, "--out", str(out)
    )
    assert rc == 0
    recs = records(out)
    assert [(r["role"], r["stream"]) for r in recs] == RETURN_ROLES
    assert [r["cached_tokens"] for r in recs] == [0, 0, 0, 0, 40, 0]
    # Its /metrics is no headstart's: no counters, so no figures and no rows for them.
    assert {r[f] for r in recs for f in TRANSFER_COUNTERS} == {None}
    table = (out / "table.txt").read_text()
    assert "ttft / cold ttft" in table and "GB/s" not in table and "host restored" not in table
    report = verify(out)
    assert report.ok and any("no prompt-cache transfer counters" in n for n in report.notes)


# ----------------------------------------------------------------------------- pure parts


def test_gaps_and_the_prefill_window():
    assert gaps([0.0, 1.0, 3.0, 3.5]) == [1.0, 2.0, 0.5]
    assert gaps([2.0]) == [] and gaps([]) == []
    times = [0.0, 1.0, 2.0, 5.0, 6.0]
    # A stall that spans the whole window counts although no token arrived inside it.
    assert gaps_during(times, 2.5, 4.0) == [3.0]
    # Gaps that straddle either edge count; ones wholly before or after do not.
    assert gaps_during(times, 1.5, 5.5) == [1.0, 3.0, 1.0]
    assert gaps_during([0.0, 10.0, 11.0, 12.0], 11.2, 11.8) == [1.0]
    assert gaps_during([0.0, 1.0], 1.0, 2.0) == []  # ends exactly where the window starts
    assert gaps_during([0.0, 1.0], 2.0, 3.0) == []  # the stream ended before the window


def rec(role: str, stream: int, t_send: float, times: list[float], ttft=True) -> dict:
    first = times[0] if times and ttft else None
    return {
        "role": role,
        "stream": stream,
        "t_send": t_send,
        "t_first": first,
        "ttft_s": first - t_send if first is not None else None,
        "cached_tokens": 0,
        "times": times,
    }


def test_beside_metrics_from_hand_made_streams():
    recs = [
        rec("decoder", 0, 0.0, [1.0, 1.1, 1.2, 1.3, 2.3, 2.4]),  # stalls 1.0 s in the window
        rec("decoder", 1, 0.0, [1.0, 1.1, 1.2, 1.25]),  # ends before the long's first token
        rec("long", 0, 1.28, [2.2]),
    ]
    (label, m), *rest = repeat_metrics("beside", 0, recs)
    assert label == "beside" and not rest
    assert m["long_ttft_s"] == pytest.approx(0.92)
    assert m["prefill_gap_max_s"] == pytest.approx(1.0)  # 1.3 -> 2.3 overlaps (1.28, 2.2)
    assert m["gap_max_s"] == pytest.approx(1.0)
    # every gap of both: 0.1 0.1 0.1 1.0 0.1 | 0.1 0.1 0.05 -> median 0.1
    assert m["gap_median_s"] == pytest.approx(0.1)
    assert m["decoders_through"] == 1
    # The whole-repeat worst gap can lie outside the prefill window.
    recs[0]["times"] = [1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 1.9, 2.1, 2.3, 5.0]
    m = repeat_metrics("beside", 0, recs)[0][1]
    assert m["gap_max_s"] == pytest.approx(2.7) and m["prefill_gap_max_s"] == pytest.approx(0.2)


def test_burst_metrics_label_the_first_burst_and_refuse_a_missing_ttft():
    recs = [rec("burst", s, 0.0, [t]) for s, t in enumerate([0.3, 0.1, 0.2, 0.9])]
    assert repeat_metrics("burst", 0, recs) == [
        ("first", {"ttft_max_s": 0.9, "ttft_median_s": pytest.approx(0.25)})
    ]
    recs[1] = rec("burst", 1, 0.0, [], ttft=False)  # a failed request has no TTFT
    assert repeat_metrics("burst", 2, recs) == [
        ("later", {"ttft_max_s": None, "ttft_median_s": None})
    ]


def test_token_stream_is_sha256_in_counter_mode():
    # Pinned: a receipt's check rebuilds its prompts, so the ids must never change.
    digest = hashlib.sha256(b"x#0").digest()
    assert token_stream("x", 8, 0, 10) == [
        int.from_bytes(digest[i : i + 4], "big") % 10 for i in range(0, 32, 4)
    ]
    assert token_stream("x", 10, 0, 10) == [7, 5, 1, 2, 3, 8, 2, 4, 3, 1]
    assert token_stream("x", 3, 1000, 4000) == [3637, 2885, 3541]


def test_salted_prompts():
    a, b = salted_prompt("run1 a", 50, 1000, 4000), salted_prompt("run1 b", 50, 1000, 4000)
    assert len(a) == len(b) == 50 and all(1000 <= t < 4000 for t in a + b)
    assert a == salted_prompt("run1 a", 50, 1000, 4000)  # deterministic
    # The salt is in front, where it stops any shared prefix; the filler after it is shared.
    assert a[0] != b[0] and a[:SALT_TOKENS] != b[:SALT_TOKENS]
    assert a[SALT_TOKENS:] == b[SALT_TOKENS:]
    assert salted_prompt("run1 a", 60, 1000, 4000)[:50] == a  # a longer prompt extends it
    assert len(salted_prompt("k", SALT_TOKENS, 0, 100)) == SALT_TOKENS
    with pytest.raises(ValueError, match="at least"):
        salted_prompt("k", SALT_TOKENS - 1, 0, 100)


def test_repeat_steps_of_each_scenario():
    s = Sampling()
    base = salt_base("r", "arm", 0, "x")
    (step,) = repeat_steps(make_scenario("long", prompt_tokens=20), 8, base, 0)
    assert [(q.role, len(q.ids), q.max_tokens) for q in step] == [("long", 20, 8)]

    burst = make_scenario("burst", streams=4, repeats=2)
    assert burst.reps == 3 and requests_per_arm(burst) == 12 and burst.width == 4
    (step,) = repeat_steps(burst, 8, base, 1)
    assert [q.stream for q in step] == [0, 1, 2, 3] and {len(q.ids) for q in step} == {31}
    assert len({q.ids[:SALT_TOKENS] for q in step}) == 4  # N new prompts

    turn = make_scenario("turn", history_tokens=30, turn_tokens=5)
    (history,), (new,), (cold,) = repeat_steps(turn, 8, base, 0)
    assert (history.role, new.role, cold.role) == ("history", "turn", "cold")
    assert new.ids[:30] == history.ids and len(new.ids) == 35  # the turn extends the history
    assert cold.ids[SALT_TOKENS:] == new.ids[SALT_TOKENS:] and cold.ids[0] != new.ids[0]

    beside = make_scenario("beside", streams=3, prompt_tokens=64, decode_tokens=50)
    (step,) = repeat_steps(beside, 8, base, 0)
    assert [(q.role, q.max_tokens) for q in step] == [("decoder", 50)] * 3 + [("long", 8)]
    assert beside.width == 4 and len(step[-1].ids) == 64

    # New prompts everywhere: per repeat, per arm, per order, per run.
    firsts = {
        step[0].ids[:SALT_TOKENS]
        for b in (base, salt_base("r", "arm2", 0, "x"), salt_base("r", "arm", 1, "x"))
        for step in all_steps(make_scenario("long", prompt_tokens=8), 8, b)
    }
    assert len(firsts) == 3 * 3
    body = token_body(Request(0, "long", 0, (1000, 1001), 4), Sampling(seed=3, extra={"x": 1}))
    assert body == {
        "prompt": [1000, 1001],
        "max_tokens": 4,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": 3,
        "x": 1,
    }
    assert "seed" not in token_body(step[0], Sampling(seed=None)) and s.seed == 0


def test_scenario_defaults_and_limits():
    assert (make_scenario("long").prompt_tokens, make_scenario("long").repeats) == (8192, 3)
    b = make_scenario("burst")
    assert (b.streams, b.prompt_tokens, b.token_lo, b.token_hi) == (16, 31, 1000, 4000)
    t = make_scenario("turn")
    assert (t.history_tokens, t.turn_tokens) == (2000, 30)
    assert (make_scenario("beside").streams, make_scenario("beside").prompt_tokens) == (8, 8192)
    assert make_scenario("burst", streams=None).streams == 16  # None: the default
    with pytest.raises(Exception, match="--prompt-tokens must be at least 8"):
        make_scenario("long", prompt_tokens=4)
    with pytest.raises(Exception, match="--history-tokens"):
        make_scenario("turn", history_tokens=2)
    with pytest.raises(Exception, match="token-range"):
        make_scenario("long", token_lo=10, token_hi=20)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scenario", "long", "--builtin", "chat"], "--builtin: not with --scenario"),
        (["--prompt-tokens", "64"], "--prompt-tokens: only with --scenario"),
        (["--scenario", "burst", "--streams", "1", "2"], "one --streams count"),
        (["--scenario", "long", "--token-range", "5-9"], "expected LO:HI"),
        (["--scenario", "turn", "--turn-tokens", "0"], "--turn-tokens must be at least 1"),
        (["--scenario", "turn", "--prompt-tokens", "64"], "--prompt-tokens: not used by"),
        (["--scenario", "long", "--streams", "4"], "--streams: not used by --scenario long"),
        (["--turns", "3"], "--turns: only with --scenario"),
        (["--scenario", "turn", "--turns", "3"], "--turns: not used by --scenario turn"),
        (["--scenario", "agent", "--turns", "1"], "--turns must be at least 2"),
        (["--scenario", "agent", "--streams", "2"], "--streams: not used by --scenario agent"),
    ],
)
def test_scenario_options_are_checked_before_anything_starts(argv, message, tmp_path, capsys):
    assert bench(*argv, "--out", str(tmp_path / "never")) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_return_steps():
    sc = make_scenario("return", history_tokens=30, turn_tokens=5, others=3)
    assert (sc.reps, sc.width, requests_per_arm(sc)) == (3, 1, 3 * 6)
    steps = repeat_steps(sc, 8, salt_base("r", "arm", 0, "return"), 1)
    assert all(len(step) == 1 for step in steps)
    history, *others, back, cold = (q for (q,) in steps)
    assert [(q.role, q.stream) for q in (history, *others, back, cold)] == RETURN_ROLES
    assert {q.rep for q in (history, back, cold)} == {1} and {q.max_tokens for q in others} == {8}
    assert back.ids[:30] == history.ids and len(back.ids) == 35  # it extends its history
    assert cold.ids[SALT_TOKENS:] == back.ids[SALT_TOKENS:] and cold.ids[0] != back.ids[0]
    # Every conversation is its own: same length and filler, a salt of its own.
    assert {len(q.ids) for q in others} == {30}
    assert len({q.ids[:SALT_TOKENS] for q in (history, *others, cold)}) == 5
    assert {q.ids[SALT_TOKENS:] for q in others} == {history.ids[SALT_TOKENS:]}
    control = make_scenario("return", others=0, history_tokens=20)
    assert [q.role for (q,) in repeat_steps(control, 8, "b", 0)] == ["history", "return", "cold"]
    d = make_scenario("return")
    assert (d.history_tokens, d.turn_tokens, d.others, d.repeats) == (4000, 30, 30, 3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--others", "3"], "--others: only with --scenario"),
        (["--scenario", "turn", "--others", "3"], "--others: not used by --scenario turn"),
        (["--scenario", "return", "--others", "-1"], "--others must be at least 0"),
        (["--scenario", "return", "--history-tokens", "4"], "--history-tokens must be at least"),
        (["--scenario", "return", "--prompt-tokens", "64"], "--prompt-tokens: not used by"),
    ],
)
def test_return_options(argv, message, tmp_path, capsys):
    assert bench(*argv, "--out", str(tmp_path / "never")) == 2
    assert message in capsys.readouterr().err


def test_transfer_counters_are_read_from_a_headstart_exposition():
    stats = {
        "cache_host_restored_bytes": 669952,
        "cache_host_restore_seconds": 0.25,
        "cache_demoted_bytes": 3 << 30,
        "cache_demote_seconds": 1.5,
    }
    m = Metrics()
    m.watch_prompt_cache(lambda: stats)
    before = parse_counters(m.render()[0].decode())
    assert before == {
        "host_restored_bytes": 669952,
        "host_restore_s": 0.25,
        "demoted_bytes": 3 << 30,
        "demote_s": 1.5,
    }
    stats["cache_host_restored_bytes"] += 1000
    stats["cache_host_restore_seconds"] += 0.125
    after = parse_counters(m.render()[0].decode())
    growth = counter_growth(before, after)
    assert growth == {
        "host_restored_bytes": 1000,
        "host_restore_s": 0.125,
        "demoted_bytes": 0,
        "demote_s": 0.0,
    }
    assert isinstance(growth["host_restored_bytes"], int)
    assert parse_counters(Metrics().render()[0].decode()) is None  # no cache: none exposed
    assert parse_counters("headstart_prompt_cache_demoted_bytes_total 1.0\n") is None
    # A missing reading or a restarted server (counters went down): no figures.
    assert counter_growth(None, after) == dict.fromkeys(TRANSFER_COUNTERS)
    assert counter_growth(after, before) == dict.fromkeys(TRANSFER_COUNTERS)


def test_return_metrics_from_hand_made_records():
    def r(role, ttft, cached, restored=0, restore_s=0.0, demoted=0, demote_s=0.0):
        return {
            "role": role,
            "stream": 0,
            "ttft_s": ttft,
            "cached_tokens": cached,
            "host_restored_bytes": restored,
            "host_restore_s": restore_s,
            "demoted_bytes": demoted,
            "demote_s": demote_s,
        }

    recs = [
        r("history", 0.5, 0, demoted=10**9, demote_s=0.5),
        r("other", 0.5, 0, demoted=2 * 10**9, demote_s=0.5),
        r("return", 0.1, 4000, restored=3 * 10**9, restore_s=0.25, demoted=10**9, demote_s=0.5),
        r("cold", 0.4, 0),
    ]
    (label, m), (cold, c) = repeat_metrics("return", 0, recs)
    assert (label, cold) == ("return", "cold") and c == {"ttft_s": 0.4, "cached_tokens": 0}
    assert m == {
        "ttft_s": 0.1,
        "cached_tokens": 4000,
        "ttft_vs_cold": pytest.approx(0.25),
        "host_restored_bytes": 3 * 10**9,
        "host_restore_bandwidth": 12e9,  # 3 GB in a quarter second
        "demote_bandwidth": pytest.approx(4e9 / 1.5),  # over the whole repeat
    }
    # A device hit moves nothing, a server without counters reports nothing: no bandwidth.
    recs[2].update(host_restored_bytes=0, host_restore_s=0.0)
    assert repeat_metrics("return", 0, recs)[0][1]["host_restore_bandwidth"] is None
    for x in recs:
        x.update(dict.fromkeys(TRANSFER_COUNTERS))
    m = repeat_metrics("return", 0, recs)[0][1]
    assert {m[k] for k in SERVER_COUNTERS} == {None}
