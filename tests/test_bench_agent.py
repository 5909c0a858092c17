"""`headstart bench --scenario agent`: a growing conversation against a real headstart server
(the embedded default model), `bench check` catching tampered agent receipts, and the pure
parts (prompt building, the reuse shortfall, token-id parsing) with hand-made inputs.

Speed is never asserted: only structure and invariants (every turn answered, each prompt the
previous one plus its answer ids plus the tool result, the server's prompt cache restoring
the previous turn, the summary recomputed from the raw records)."""

from __future__ import annotations

import itertools
import json
import shutil
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_proc import serving

from headstart import cli
from headstart.bench.check import check_receipt
from headstart.bench.client import token_ids
from headstart.bench.env import sha256_file
from headstart.bench.scenario_summary import repeat_metrics, reuse_shortfall
from headstart.bench.scenarios import (
    SALT_TOKENS,
    Request,
    agent_cold,
    agent_steps,
    agent_turn,
    default_max_tokens,
    make_scenario,
    repeat_steps,
    requests_per_arm,
    salt_base,
    salted_prompt,
    token_body,
    tool_result,
)
from headstart.bench.workload import Sampling

QUIET = ["--no-progress", "--no-model-hash"]
TURNS, PROMPT, TOOL, OUT = 4, 40, 12, 6
SIZES = ["--turns", str(TURNS), "--prompt-tokens", str(PROMPT), "--turn-tokens", str(TOOL)]


def bench(*args: str) -> int:
    return cli.main(["bench", *args])


def records(receipt: Path) -> list[dict]:
    return json.loads((receipt / "requests.json").read_text())["requests"]


def summary(receipt: Path) -> dict:
    return json.loads((receipt / "summary.json").read_text())


def conversations(recs: list[dict]) -> dict[tuple, tuple[list[dict], dict]]:
    """(arm, order, rep) -> (its turns in order, its cold reference)."""
    out = {}
    for key in sorted({(r["arm"], r["order"], r["rep"]) for r in recs}):
        mine = [r for r in recs if (r["arm"], r["order"], r["rep"]) == key]
        turns = sorted((r for r in mine if r["role"] == "agent"), key=lambda r: r["stream"])
        (cold,) = [r for r in mine if r["role"] == "cold"]
        out[key] = (turns, cold)
    return out


# ----------------------------------------------------------------------------- real headstart


@pytest.fixture(scope="module")
def url_server() -> Iterator[str]:
    with serving("--parallel", "4", "--context", "512") as srv:
        yield srv.url


@pytest.fixture(scope="module")
def run(url_server, tmp_path_factory) -> Path:
    """Two orders x two repeats of a 4-turn conversation on one server that outlives them
    all (a URL arm), so only the salts keep each conversation's first turn new."""
    out = tmp_path_factory.mktemp("agent") / "receipt"
    argv = [*SIZES, "--max-tokens", str(OUT), "--repeats", "2", "--orders", "2"]
    rc = bench(
        "--scenario", "agent", "--arm", f"url={url_server}", *argv, *QUIET, "--out", str(out)
    )
    assert rc == 0, check_receipt(out).text()
    return out


@pytest.mark.slow
def test_every_turn_extends_the_last_by_its_answer_and_a_tool_result(run):
    recs = records(run)
    assert len(recs) == 2 * 2 * (TURNS + 1)
    convs = conversations(recs)
    assert len(convs) == 4
    for turns, cold in convs.values():
        assert [t["stream"] for t in turns] == list(range(TURNS))
        for r in [*turns, cold]:
            assert r["status"] == 200 and not r["error"] and r["ttft_s"] > 0
            assert r["prompt_tokens"] == r["prompt_len"]
            assert r["completion_tokens"] == r["max_tokens"] == OUT == len(r["output_ids"])
            assert all(isinstance(t, int) for t in r["output_ids"])
        assert turns[0]["prompt_len"] == PROMPT
        for prev, turn in itertools.pairwise(turns):
            assert turn["prompt_len"] == prev["prompt_len"] + len(prev["output_ids"]) + TOOL
            assert turn["t_send"] >= prev["t_done"]  # one turn at a time
            # The server snapshots the end of every generation: the new turn finds at least
            # the previous prompt and all but the last answer token (never fed through).
            assert turn["cached_tokens"] >= prev["prompt_len"] + len(prev["output_ids"]) - 1
            assert turn["cached_tokens"] < turn["prompt_len"]
        assert turns[0]["cached_tokens"] == 0  # salted: new although the server outlives runs
        assert cold["prompt_len"] == turns[-1]["prompt_len"] and cold["cached_tokens"] == 0
        assert cold["t_send"] >= turns[-1]["t_done"]


@pytest.mark.slow
def test_the_summary_is_recomputed_from_the_raw_records(run):
    s = summary(run)
    convs = conversations(records(run))
    by_key = {(r["arm"], r["order"], r["rep"], r["label"]): r["metrics"] for r in s["repeats"]}
    shortfalls = []
    for key, (turns, cold) in convs.items():
        later = [t["ttft_s"] for t in turns[1:]]
        want = min(
            t["cached_tokens"] - (p["prompt_len"] + len(p["output_ids"]) - 1)
            for p, t in itertools.pairwise(turns)
        )
        shortfalls.append(want)
        assert by_key[(*key, "turns")] == {
            "ttft_median_s": statistics.median(later),
            "ttft_max_s": max(later),
            "reuse_shortfall": want,
        }
        assert by_key[(*key, "first")] == {"ttft_s": turns[0]["ttft_s"], "cached_tokens": 0}
        assert by_key[(*key, "cold")] == {"ttft_s": cold["ttft_s"], "cached_tokens": 0}
    assert min(shortfalls) >= 0
    (g,) = [g for g in s["groups"] if g["label"] == "turns"]
    assert g["metrics"]["reuse_shortfall"]["each"] == shortfalls
    # Per turn: every repeat's numbers, in run order.
    assert [t["turn"] for t in s["turns"]] == list(range(1, TURNS + 1))
    for t in s["turns"]:
        at = [turns[t["turn"] - 1] for turns, _ in convs.values()]
        m = t["metrics"]
        assert m["ttft_s"]["each"] == [r["ttft_s"] for r in at]
        assert m["prompt_len"]["each"] == [r["prompt_len"] for r in at]
        assert m["cached_tokens"]["each"] == [r["cached_tokens"] for r in at]
        assert m["cached_fraction"]["each"] == [r["cached_tokens"] / r["prompt_len"] for r in at]
    table = (run / "table.txt").read_text()
    assert "scenario agent" in table and "per turn" in table
    assert table.rstrip().endswith(f"url {min(shortfalls)}")


@pytest.mark.slow
def test_check_passes(run, capsys):
    assert bench("check", str(run)) == 0
    assert f"OK ({2 * 2 * (TURNS + 1)} rows)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "got"),
    [
        ({"return_tokens_as_token_ids": False}, "none"),  # tokens named by their text
        ({"logprobs": None}, "none"),  # no logprobs at all
    ],
)
@pytest.mark.slow
def test_a_server_that_returns_no_token_ids_fails_clearly(url_server, tmp_path, capsys, extra, got):
    argv = [*SIZES, "--max-tokens", "2", "--orders", "1", "--extra-body", json.dumps(extra)]
    out = tmp_path / "never"
    assert (
        bench("--scenario", "agent", "--arm", f"u={url_server}", *argv, *QUIET, "--out", str(out))
        == 2
    )
    err = capsys.readouterr().err
    assert f"arm 'u': agent turn 1 came back without the token ids it generated ({got})" in err
    assert "return_tokens_as_token_ids" in err


# ----------------------------------------------------------------------------- bench check


@pytest.fixture
def copy(run, tmp_path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "copy"))


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


def turn(recs: list[dict], k: int) -> dict:
    return next(r for r in recs if r["role"] == "agent" and r["stream"] == k)


@pytest.mark.slow
def test_check_fails_on_an_edited_answer(copy):
    # The next turn was sent with the real answer: an edited one no longer builds its prompt.
    def edit(recs):
        turn(recs, 1)["output_ids"][2] += 1

    rewrite(copy, edit)
    text = problems(copy)
    assert "request does not match the design" in text
    assert "rep 0 agent 2" in text and "agent 1:" not in text


@pytest.mark.slow
def test_check_fails_on_a_dropped_answer_token(copy):
    rewrite(copy, lambda recs: turn(recs, 0)["output_ids"].pop())
    text = problems(copy)
    assert "answer ids do not match the tokens counted" in text
    assert "request does not match the design" in text


@pytest.mark.slow
def test_check_fails_on_an_inflated_cache_report(copy):
    def edit(recs):
        turn(recs, 2)["cached_tokens"] += 1

    rewrite(copy, edit)
    assert "summary.json does not match the records" in problems(copy)


@pytest.mark.slow
def test_check_fails_on_a_missing_turn(copy):
    rewrite(copy, lambda recs: recs.remove(turn(recs, 3)))
    assert "missing request" in problems(copy)


# ----------------------------------------------------------------------------- pure parts


SC = make_scenario("agent", turns=3, prompt_tokens=20, turn_tokens=5, repeats=2)
BASE = salt_base("run", "arm", 0, "agent")


def test_agent_defaults_and_limits():
    sc = make_scenario("agent")
    assert (sc.turns, sc.prompt_tokens, sc.turn_tokens, sc.repeats) == (20, 2000, 500, 1)
    assert default_max_tokens("agent") == 64 and default_max_tokens("long") == 8
    assert sc.width == 1 and requests_per_arm(SC) == 2 * (3 + 1)
    with pytest.raises(Exception, match="--turns must be at least 2"):
        make_scenario("agent", turns=1)
    with pytest.raises(Exception, match="--prompt-tokens must be at least 8"):
        make_scenario("agent", prompt_tokens=7)
    with pytest.raises(Exception, match="--history-tokens: not used by --scenario agent"):
        make_scenario("agent", history_tokens=100)
    with pytest.raises(ValueError, match="agent_steps"):
        repeat_steps(SC, 8, BASE, 0)


def test_agent_turns_append_the_answer_and_the_tool_result():
    first = agent_turn(SC, 7, BASE, 0)
    assert (first.rep, first.role, first.stream, first.max_tokens) == (0, "agent", 0, 7)
    assert first.ids == tuple(salted_prompt(f"{BASE} r0 agent", 20, 1000, 4000))
    assert first.token_ids
    answer = (5, 6, 7)  # any ids, in or out of the token range: appended as they are
    second = agent_turn(SC, 7, BASE, 0, first, answer)
    assert second.stream == 1 and len(second.ids) == 20 + 3 + 5
    assert second.ids[:20] == first.ids and second.ids[20:23] == answer
    assert second.ids[23:] == tool_result(1, 5, 1000, 4000)
    third = agent_turn(SC, 7, BASE, 0, second, (9,))
    assert third.stream == 2 and third.ids[:28] == second.ids and third.ids[28] == 9
    assert third.ids[29:] == tool_result(2, 5, 1000, 4000) != tool_result(1, 5, 1000, 4000)
    # Each repeat, arm and order starts its own conversation: a new salt, the same filler.
    others = [
        agent_turn(SC, 7, BASE, 1),
        agent_turn(SC, 7, salt_base("run", "arm2", 0, "agent"), 0),
        agent_turn(SC, 7, salt_base("run", "arm", 1, "agent"), 0),
        agent_turn(SC, 7, salt_base("run2", "arm", 0, "agent"), 0),
    ]
    assert len({q.ids[:SALT_TOKENS] for q in [first, *others]}) == 5
    assert {q.ids[SALT_TOKENS:] for q in [first, *others]} == {first.ids[SALT_TOKENS:]}


def test_the_cold_reference_is_the_last_prompt_under_a_new_salt():
    first = agent_turn(SC, 7, BASE, 1)
    last = agent_turn(SC, 7, BASE, 1, first, (1, 2))
    cold = agent_cold(SC, 7, BASE, last)
    assert (cold.rep, cold.role, cold.stream, cold.max_tokens, cold.token_ids) == (
        1,
        "cold",
        0,
        7,
        True,
    )
    assert len(cold.ids) == len(last.ids) and cold.ids[SALT_TOKENS:] == last.ids[SALT_TOKENS:]
    assert cold.ids[0] != last.ids[0] and cold.ids[:SALT_TOKENS] != last.ids[:SALT_TOKENS]
    assert cold != agent_cold(SC, 7, BASE, agent_turn(SC, 7, BASE, 0, first, (1, 2)))  # per rep


def test_agent_steps_rebuild_the_run_from_its_answers():
    answers = {}

    def answer_of(q: Request) -> tuple[int, ...] | None:
        return answers.setdefault((q.rep, q.stream), (100 + q.rep, 200 + q.stream))

    steps = agent_steps(SC, 7, BASE, answer_of)
    assert all(len(step) == 1 for step in steps) and len(steps) == requests_per_arm(SC)
    reqs = [step[0] for step in steps]
    assert [(q.rep, q.role, q.stream) for q in reqs] == [
        (rep, role, k)
        for rep in (0, 1)
        for role, k in [("agent", 0), ("agent", 1), ("agent", 2), ("cold", 0)]
    ]
    for rep in (0, 1):
        t0, t1, t2, cold = reqs[4 * rep : 4 * rep + 4]
        assert t1 == agent_turn(SC, 7, BASE, rep, t0, answers[(rep, 0)])
        assert t2 == agent_turn(SC, 7, BASE, rep, t1, answers[(rep, 1)])
        assert cold == agent_cold(SC, 7, BASE, t2)
    # A turn without an answer (failed) ends its repeat there, the cold reference too.
    stopped = agent_steps(SC, 7, BASE, lambda q: None if (q.rep, q.stream) == (0, 1) else (1,))
    assert [(q.rep, q.role, q.stream) for [q] in stopped] == [
        (0, "agent", 0),
        (0, "agent", 1),
        (1, "agent", 0),
        (1, "agent", 1),
        (1, "agent", 2),
        (1, "cold", 0),
    ]


def test_agent_bodies_ask_for_the_generated_ids():
    body = token_body(agent_turn(SC, 7, BASE, 0), Sampling(seed=None))
    assert body["logprobs"] == 0 and body["return_tokens_as_token_ids"] is True
    assert body["prompt"] == list(agent_turn(SC, 7, BASE, 0).ids) and body["max_tokens"] == 7
    assert "logprobs" not in token_body(Request(0, "long", 0, (1000,), 4), Sampling())


def test_token_ids_from_streamed_logprobs():
    assert token_ids(["token_id:7", "token_id:0", "token_id:4095"]) == [7, 0, 4095]
    assert token_ids([]) == [] and token_ids(None) is None
    # A server that names tokens by their text gives no ids, even where a text looks like one.
    for bad in (["token_id:7", "hello"], ["7"], ["token_id:"], ["token_id:-1"], ["token_id:٣"]):
        assert token_ids(bad) is None


def test_reuse_shortfall_from_hand_made_turns():
    # (prompt, answer, cached): full reuse is the previous prompt + answer - 1.
    full = [(40, 6, 0), (58, 6, 45), (76, 6, 63)]
    assert reuse_shortfall(full) == 0
    # The minimum, not the last or the sum: turn 2 restored 13 tokens too few.
    assert reuse_shortfall([(40, 6, 0), (58, 6, 32), (76, 6, 63)]) == -13
    # More than the minimum counts as more (a server that also cached the last token).
    assert reuse_shortfall([(40, 6, 0), (58, 6, 46), (76, 6, 64)]) == 1
    assert reuse_shortfall([(40, 6, 0), (58, 6, 46), (76, 6, 63)]) == 0
    # The previous turn's own counts, not the current one's: answers of other lengths.
    assert reuse_shortfall([(40, 3, 0), (55, 9, 42), (76, 1, 63)]) == 0
    assert reuse_shortfall([(40, 6, 0)]) is None and reuse_shortfall([]) is None
    assert reuse_shortfall([(40, 6, 0), (58, 6, None), (76, 6, 63)]) is None  # not reported
    assert reuse_shortfall([(40, None, 0), (58, 6, 45)]) is None  # no answer ids


def rec(role: str, turn: int, ttft: float | None, prompt: int, cached: int | None) -> dict:
    return {
        "role": role,
        "stream": turn,
        "ttft_s": ttft,
        "prompt_len": prompt,
        "cached_tokens": cached,
        "output_ids": [1, 2, 3] if ttft is not None else None,
    }


def test_agent_metrics_from_hand_made_records():
    recs = [
        rec("cold", 0, 0.9, 56, 0),
        rec("agent", 2, 0.2, 56, 41),  # wants 40 + 3 - 1 = 42: one short
        rec("agent", 0, 0.8, 24, 0),  # the first turn's TTFT is the largest: not in "turns"
        rec("agent", 1, 0.1, 40, 26),  # wants 24 + 3 - 1 = 26
        rec("agent", 3, 0.4, 72, 58),  # wants 56 + 3 - 1 = 58
    ]
    assert repeat_metrics("agent", 0, recs) == [
        ("turns", {"ttft_median_s": 0.2, "ttft_max_s": 0.4, "reuse_shortfall": -1}),
        ("first", {"ttft_s": 0.8, "cached_tokens": 0}),
        ("cold", {"ttft_s": 0.9, "cached_tokens": 0}),
    ]
    # A repeat the run ended early (turn 3 failed, so no cold reference): None, no crash.
    partial = [*recs[1:4], rec("agent", 3, None, 72, None)]
    assert repeat_metrics("agent", 1, partial) == [
        ("turns", {"ttft_median_s": None, "ttft_max_s": None, "reuse_shortfall": None}),
        ("first", {"ttft_s": 0.8, "cached_tokens": 0}),
        ("cold", {"ttft_s": None, "cached_tokens": None}),
    ]
