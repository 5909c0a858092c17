"""`headstart bench`: real headstart servers (a command arm and a URL arm), a fake
OpenAI-compatible server (server-agnosticism), and `bench check` catching tampered receipts."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from server_proc import ServerProcess

from headstart import cli
from headstart.bench import rows as R
from headstart.bench.arms import arm_orders, parse_arm
from headstart.bench.check import ReceiptError, check_receipt, verify
from headstart.bench.env import sha256_file
from headstart.bench.summary import summarize

QUICK = ["--streams", "1", "2", "--bursts", "2", "--max-tokens", "6", "--no-progress"]


# ----------------------------------------------------------------------------- helpers


def bench(*args: str) -> int:
    return cli.main(["bench", *args])


def rewrite_manifest(receipt: Path) -> None:
    """Make the manifest agree with the files again, as a careful forger would."""
    m = json.loads((receipt / "manifest.json").read_text())
    for name in m["files"]:
        m["files"][name] = {
            "sha256": sha256_file(receipt / name),
            "bytes": (receipt / name).stat().st_size,
        }
    n = len(R.from_json((receipt / "requests.json").read_text()))
    m["rows"] = {"requests.csv": n, "requests.json": n}
    (receipt / "manifest.json").write_text(json.dumps(m))


def edit_rows(receipt: Path, edit) -> None:
    """Apply ``edit(rows) -> rows`` to both row files, then fix up the manifest."""
    rows = edit(R.from_json((receipt / "requests.json").read_text()))
    (receipt / "requests.json").write_text(R.to_json(rows))
    (receipt / "requests.csv").write_text(R.to_csv(rows))
    rewrite_manifest(receipt)


def problems(receipt: Path) -> str:
    report = check_receipt(receipt)
    assert not report.ok
    return "\n".join(report.problems)


# ----------------------------------------------------------------------------- real headstart


@pytest.fixture(scope="module")
def receipt(tmp_path_factory) -> Path:
    """Two arms serving the embedded model: a command arm (fresh process per order) and a
    URL arm; one chat prompt (built in) and one completions prompt (from a file)."""
    tmp = tmp_path_factory.mktemp("bench")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "raw", "prompt": "def add(a, b):"}) + "\n")
    srv = ServerProcess("--parallel", "4", "--context", "256").wait_ready()
    out = tmp / "receipt"
    try:
        rc = bench(
            "--arm",
            f"cmd=cmd:{sys.executable} -m headstart serve --port {{port}} "
            "--parallel 4 --context 256",
            "--arm",
            f"url={srv.url}",
            "--builtin",
            "chat",
            "--prompts",
            str(prompts),
            "--prompt-id",
            "chat-hello",
            "--prompt-id",
            "raw",
            *QUICK,
            "--out",
            str(out),
        )
    finally:
        srv.stop()
    assert rc == 0, (out / "table.txt").read_text() if out.exists() else "no receipt"
    return out


@pytest.mark.slow
def test_receipt_layout_and_rows(receipt):
    for name in (
        "manifest.json",
        "config.json",
        "env.json",
        "requests.csv",
        "requests.json",
        "outputs.json",
        "summary.json",
        "table.txt",
        "ttft.png",
        "logs/cmd-o0.log",
        "logs/cmd-o1.log",
    ):
        assert (receipt / name).is_file(), name
    rows = R.from_json((receipt / "requests.json").read_text())
    assert rows == R.from_csv((receipt / "requests.csv").read_text())
    # 2 arms x 2 orders x 2 prompts x (1 cold + 2 rounds x (1 + 2 streams))
    assert len(rows) == 2 * 2 * 2 * 7
    assert {r["phase"] for r in rows} == {"cold", "primed", "steady"}
    assert all(r["completion_tokens"] == 6 and r["status"] == 200 and not r["error"] for r in rows)
    assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in rows)
    # A repeat of a prompt is served from the prompt cache and the server says so.
    assert any(r["cached_tokens"] for r in rows if r["phase"] == "steady")
    config = json.loads((receipt / "config.json").read_text())
    assert config["order_list"] == [["cmd", "url"], ["url", "cmd"]] and config["salted"]
    assert [launch["exit_status"] for launch in config["launches"] if launch["arm"] == "cmd"] == [
        0,
        0,
    ]
    env = json.loads((receipt / "env.json").read_text())
    assert env["models"]["cmd"]["files"]["model.safetensors"]  # the embedded default model
    assert len(env["client"]["sha256"]) == 64 and env["packages"]["headstart"]
    assert "--arm" in config["argv"]


@pytest.mark.slow
def test_check_passes_and_arms_agree(receipt, capsys):
    report = verify(receipt)
    assert report.rows == 56
    summary = json.loads((receipt / "summary.json").read_text())
    assert summary["agreement"]["mismatches"] == []
    assert all(m["matched"] == m["total"] for m in summary["agreement"]["match"])
    assert {r["arm"] for r in summary["ratios"]} == {"url"}
    assert bench("check", str(receipt)) == 0
    assert "OK (56 rows)" in capsys.readouterr().out


@pytest.fixture
def copy(receipt, tmp_path) -> Path:
    return Path(shutil.copytree(receipt, tmp_path / "copy"))


@pytest.mark.slow
def test_check_fails_on_an_edited_csv_number(copy, capsys):
    lines = (copy / "requests.csv").read_text().splitlines()
    cells = lines[5].split(",")
    cells[R.FIELDS.index("ttft_s")] = "0.001"
    lines[5] = ",".join(cells)
    (copy / "requests.csv").write_text("\n".join(lines) + "\n")
    found = problems(copy)
    assert "requests.csv: sha256 differs" in found
    assert "field 'ttft_s'" in found
    assert bench("check", str(copy)) == 1
    assert "FAILED" in capsys.readouterr().err


@pytest.mark.slow
def test_check_fails_on_a_removed_row_even_with_a_fixed_manifest(copy):
    edit_rows(copy, lambda rows: rows[:10] + rows[11:])
    found = problems(copy)
    assert "missing row" in found and "summary.json does not match" in found
    with pytest.raises(ReceiptError, match="missing row"):
        verify(copy)


@pytest.mark.slow
def test_check_fails_on_a_consistently_edited_timestamp(copy):
    def slower(rows):
        rows[3]["t_done"] += 5.0
        rows[3].update(R.derive(rows[3]))  # the row is self-consistent, the summary is not
        return rows

    edit_rows(copy, slower)
    assert "summary.json does not match the rows" in problems(copy)


@pytest.mark.slow
def test_check_fails_on_a_derived_field_edit(copy):
    def edit(rows):
        rows[2]["ttft_s"] /= 2
        return rows

    edit_rows(copy, edit)
    assert "derived field does not match" in problems(copy)


@pytest.mark.slow
def test_check_fails_on_an_edited_summary(copy):
    s = json.loads((copy / "summary.json").read_text())
    s["groups"][0]["metrics"]["ttft_s"]["median"] *= 0.5
    (copy / "summary.json").write_text(json.dumps(s))
    rewrite_manifest(copy)
    assert (
        "summary.json does not match the rows: summary.groups[0].metrics.ttft_s.median"
        in problems(copy)
    )


@pytest.mark.slow
def test_check_fails_when_an_output_differs(copy):
    def edit(rows):
        rows[-1]["fingerprint"] = "0" * 16
        return rows

    edit_rows(copy, edit)
    assert "outputs disagree" in problems(copy)
    # Judged as `bench check --agree none` would: no disagreement is a problem then.
    judged = "\n".join(check_receipt(copy, agree="none").problems)
    assert "outputs disagree" not in judged and judged


@pytest.mark.slow
def test_check_fails_on_a_missing_file(copy):
    (copy / "requests.json").unlink()
    assert "requests.json: listed in manifest.json but missing" in problems(copy)


# ----------------------------------------------------------------------------- a fake server


class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` one-word deltas of a fixed reply, then usage and [DONE];
    reports a prompt as cached the second time it sees it. Not headstart in any way."""

    protocol_version = "HTTP/1.0"  # the stream ends when the connection closes
    reply = "alpha"
    seen: set[str]

    def log_message(self, *args) -> None:
        pass

    def _json(self, obj: dict, status: int = 200) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json({"object": "list", "data": [{"id": "fake-1", "object": "model"}]})
        else:
            self._json({"error": "not found"}, 404)  # no /health: readiness via /v1/models

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["model"] == "fake-1" and req["stream"] and req["ignore_eos"]
        key = json.dumps(req.get("messages") or req.get("prompt"))
        cached = 10 if key in self.seen else 0
        self.seen.add(key)
        chat = self.path == "/v1/chat/completions"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def send(obj) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        if chat:
            send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for i in range(req["max_tokens"]):
            time.sleep(0.002)
            word = f" {self.reply}{i}"
            send(
                {
                    "choices": [
                        {"index": 0, "delta": {"content": word}}
                        if chat
                        else {"index": 0, "text": word}
                    ]
                }
            )
        send(
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": 10,
                    "completion_tokens": req["max_tokens"],
                    "total_tokens": 10 + req["max_tokens"],
                    "prompt_tokens_details": {"cached_tokens": cached},
                },
            }
        )
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_servers() -> Iterator[list[str]]:
    servers = []
    for reply in ("alpha", "alpha", "beta"):
        handler = type("Fake", (FakeOpenAI,), {"reply": reply, "seen": set()})
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


def test_bench_against_a_fake_openai_server(fake_servers, tmp_path, capsys):
    a, b, _ = fake_servers
    out = tmp_path / "fake"
    assert (
        bench(
            "--arm",
            f"a={a}",
            "--arm",
            f"b={b}",
            "--prompt-id",
            "code-sql",
            "--no-plot",
            "--max-tokens",
            "5",
            "--streams",
            "1",
            "3",
            "--bursts",
            "2",
            "--no-progress",
            "--out",
            str(out),
        )
        == 0
    )
    table = capsys.readouterr().out
    assert table.splitlines()[-1].startswith("steady") and "100%" in table
    rows = R.from_json((out / "requests.json").read_text())
    assert len(rows) == 2 * 2 * (1 + 4 + 4)
    assert all(r["completion_tokens"] == 5 and r["n_deltas"] == 5 for r in rows)
    # A rate exists for every request; its value is wall-clock (speed belongs in benchmarks).
    assert all(r["decode_tok_s"] and r["decode_tok_s"] > 0 for r in rows)
    assert {r["cached_tokens"] for r in rows if r["phase"] == "cold"} == {0}  # salted per order
    assert {r["cached_tokens"] for r in rows if r["phase"] != "cold"} == {10}
    assert verify(out).ok


def test_bench_fails_loudly_when_arms_disagree(fake_servers, tmp_path, capsys):
    a, _, c = fake_servers
    out = tmp_path / "disagree"
    assert (
        bench(
            "--arm",
            f"a={a}",
            "--arm",
            f"c={c}",
            "--prompt-id",
            "chat-hello",
            "--no-plot",
            "--max-tokens",
            "3",
            "--streams",
            "2",
            "--bursts",
            "1",
            "--orders",
            "1",
            "--no-progress",
            "--out",
            str(out),
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "outputs disagree" in err and "arm 'c'" in err
    assert bench("check", str(out)) == 1


# ----------------------------------------------------------------------------- pure parts


def test_arm_parsing_and_orders():
    assert parse_arm("x=http://h:1/", 0).url == "http://h:1"
    assert parse_arm("http://h:1", 2).name == "arm3"
    spec = parse_arm("y=cmd:server --port {port} --flag 'a b'", 0)
    assert spec.argv(123) == ["server", "--port", "123", "--flag", "a b"]
    with pytest.raises(Exception, match="port"):
        parse_arm("z=cmd:server", 0)
    assert arm_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_csv_round_trip_is_exact():
    row = dict.fromkeys(R.FIELDS) | {
        "arm": 'a,b "q"',
        "order": 0,
        "slot": 0,
        "prompt_id": "p",
        "phase": "cold",
        "streams": 1,
        "rep": 0,
        "stream": 0,
        "request_sha": "x",
        "t_send": 0.1 + 0.2,
        "n_deltas": 0,
        "finish_reason": "",
        "fingerprint": "f",
        "status": 200,
        "error": "line\nbreak",
    }
    assert R.from_csv(R.to_csv([row])) == [row] == R.from_json(R.to_json([row]))


def test_ratios_are_per_order_and_geometric():
    """Arm b is 2x slower than a in order 0 and 8x in order 1 (say, drift): balanced 4x."""

    def row(arm, order, ttft):
        r = dict.fromkeys(R.FIELDS) | {
            "arm": arm,
            "order": order,
            "slot": 0,
            "prompt_id": "p",
            "phase": "cold",
            "streams": 1,
            "rep": 0,
            "stream": 0,
            "request_sha": "s",
            "t_send": 0.0,
            "t_first": ttft,
            "t_done": ttft,
            "n_deltas": 1,
            "fingerprint": "f",
            "error": "",
        }
        return r | R.derive(r)

    rows = [row("a", 0, 1.0), row("b", 0, 2.0), row("a", 1, 1.0), row("b", 1, 8.0)]
    s = summarize(rows, {"arms": [{"name": "a"}, {"name": "b"}], "orders": 2, "agree": "all"})
    (ttft,) = [r for r in s["ratios"] if r["metric"] == "ttft_s"]
    assert ttft["per_order"] == [2.0, 8.0] and ttft["balanced"] == pytest.approx(4.0)
    b = next(g for g in s["groups"] if g["arm"] == "b")["metrics"]["ttft_s"]
    assert b["order_means"] == [2.0, 8.0] and b["median"] == 5.0 and b["max"] == 8.0


def test_plot_is_skipped_without_matplotlib(monkeypatch, tmp_path, capsys):
    from headstart.bench.plot import plot_ttft

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert plot_ttft([], ["a"], tmp_path / "x.png") is False
    assert not (tmp_path / "x.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_prompt_files(tmp_path):
    from headstart.bench.workload import (
        CHAT,
        COMPLETIONS,
        Sampling,
        load_prompt_file,
        request_body,
        request_sha,
    )

    f = tmp_path / "p.json"
    f.write_text(
        json.dumps(
            {
                "prompts": [
                    "just a string",
                    [{"role": "user", "content": "a list"}],
                    {
                        "id": "conv",
                        "messages": [
                            {"role": "system", "content": "s"},
                            {"role": "user", "content": "u"},
                        ],
                    },
                    {"id": "text", "prompt": "def f("},
                ]
            }
        )
    )
    ps = load_prompt_file(f)
    assert [p.id for p in ps] == ["p-0", "p-1", "conv", "text"]
    assert [p.endpoint for p in ps] == [CHAT, CHAT, CHAT, COMPLETIONS]
    body = request_body(ps[2], Sampling(max_tokens=4, thinking="on"), salt="s1")
    assert body["messages"][0]["content"] == "[s1]\ns" and body["ignore_eos"]
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["seed"] == 0
    assert request_sha({**body, "model": "x"}) == request_sha(body)
    assert "chat_template_kwargs" not in request_body(ps[3], Sampling())


class HeldBack(BaseHTTPRequestHandler):
    """A stream whose first token's text is held back (part of a character): its chunk has
    empty text and, when logprobs were asked for, the token in ``logprobs``; the text comes
    ``DELAY_S`` later with the second token. A request with ``"user": "silent"`` gets no chunk
    at all for the held token (a server that sends only text)."""

    protocol_version = "HTTP/1.0"
    DELAY_S = 0.25

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def send(choice: dict) -> None:
            self.wfile.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
            self.wfile.flush()

        def lp(token: str) -> dict | None:
            return {"tokens": [token], "token_logprobs": [-1.0]} if "logprobs" in req else None

        if req.get("user") != "silent":
            send({"index": 0, "text": "", "logprobs": lp("token_id:175")})
        time.sleep(self.DELAY_S)
        send({"index": 0, "text": "\ufffd5", "logprobs": lp("token_id:20")})
        send({"index": 0, "text": "", "finish_reason": "length"})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.mark.parametrize("mode", ["logprobs", "empty", "silent"])
def test_ttft_counts_a_token_whose_text_is_held_back(mode):
    """TTFT is the first token's arrival: a chunk with empty text counts, with the token in
    its logprobs or without (as vLLM's benchmark counts it); with no chunk for the held token
    the first token is the second's arrival. The closing chunk (empty text, finish_reason) is
    no token."""
    import asyncio

    from headstart.bench.client import measure, open_session, token_ids

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), HeldBack)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/completions"
    body = {"prompt": [1, 2], "max_tokens": 2, "stream": True}
    if mode == "logprobs":
        body["logprobs"] = 0
    if mode == "silent":
        body["user"] = "silent"

    async def one():
        async with open_session(1, 10) as client:
            return await measure(client, url, json.dumps(body).encode(), time.perf_counter(), {})

    try:
        row, out = asyncio.run(one())
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert not row["error"]
    if mode == "silent":
        assert row["ttft_s"] >= HeldBack.DELAY_S and row["n_deltas"] == 1
    else:
        assert row["ttft_s"] < HeldBack.DELAY_S / 2 and row["n_deltas"] == 2
    if mode == "logprobs":
        assert token_ids(out.tokens) == [175, 20]
    assert "".join(out.content) == "\ufffd5"


class Failing(BaseHTTPRequestHandler):
    """``/bad``: a 400 with an OpenAI-style body; ``/cut``: a stream that ends without
    ``data: [DONE]``; ``/error``: an error event inside the stream."""

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/bad":
            body = json.dumps({"error": {"message": "max_tokens must be >= 1"}}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        if self.path == "/error":
            self.wfile.write(b'data: {"error": {"message": "engine failed"}}\n\n')
            self.wfile.write(b"data: [DONE]\n\n")


def test_a_failed_request_lands_in_its_row():
    """The client never raises for a request's failure: the status, the server's message or
    the cut stream is recorded in the row (and then fails ``bench check``)."""
    import asyncio

    from headstart.bench.client import measure, open_session

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"

    async def run(path: str):
        async with open_session(1, 10) as client:
            return (await measure(client, base + path, b"{}", time.perf_counter(), {}))[0]

    try:
        bad, cut, err = (asyncio.run(run(p)) for p in ("/bad", "/cut", "/error"))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert bad["status"] == 400 and "max_tokens must be >= 1" in bad["error"]
    assert cut["status"] == 200 and cut["error"] == "stream ended without data: [DONE]"
    assert cut["n_deltas"] == 1
    assert err["error"] == "engine failed" and err["t_done"] is not None
