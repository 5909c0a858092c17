"""benchmarks/oracle_drafting.py end to end at its tiny shape on the CPU: an oracle drafter that
proposes the target's recorded greedy tokens, k right ones a round, through the engine's
verify/rollback path (chain mode, graphs emulated): the output equals plain decode's and the
engine counts exactly k accepted drafts a round; a wrong record is caught by those counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import oracle_drafting as od

# Block 6: k = 2 and 4 give rounds of 3 and 5 tokens, and 16 - 1 is a multiple of both; 3
# streams in 4 slots put a padding stream in the window and draft graphs.
ARGS = [
    *("--shape", "tiny", "--format", "bf16", "--device", "cpu"),
    *("--streams", "1", "3", "--slots", "4", "--accept", "2", "4", "--block", "6"),
    *("--new-tokens", "16", "--prompt", "8", "--reps", "1", "--refine", "0"),
]


@pytest.fixture(scope="module")
def bench():
    b = od.Bench(od.parse_args(ARGS))
    yield b
    b.close()


def test_expected_counts_follow_the_engines_rounds():
    # 15 tokens after the first: 4 rounds of 5 drafts (2 right), then one of 2 drafts.
    assert od.expected_counts(16, 6, 2) == {"rounds": 5, "drafted": 22, "accepted": 10}
    # Two drafts fit the first round; the last token is a plain step (no room for a draft).
    assert od.expected_counts(4, 6, 1) == {"rounds": 1, "drafted": 2, "accepted": 1}
    assert od.expected_counts(121, 8, 7) == {"rounds": 15, "drafted": 105, "accepted": 105}


def test_oracle_rounds_accept_exactly_k_and_the_output_is_plain_decodes(bench):
    rows = [row for streams in (1, 3) for row in bench.measure(streams)]
    assert [(r["streams"], r["accept"]) for r in rows] == [
        (1, None),
        (1, 2),
        (1, 4),
        (3, None),
        (3, 2),
        (3, 4),
    ]
    for r in rows:
        assert r["same_as_plain"] and r["first_difference"] is None and r["refinements"] == 0
        assert r["exact_counts"], r
        if r["accept"] is None:
            assert r["counts"] == {"rounds": 0, "drafted": 0, "accepted": 0}
        else:
            k, streams = r["accept"], r["streams"]
            assert r["counts"] == r["expected_counts"] == bench.expected(streams, k)
            assert r["accepted_per_round"] == k
    # The rounds ran through the window and draft graphs' bookkeeping, proposals the oracle's.
    assert bench.engine.runner.window_graphs is not None and bench.engine.spec.graphs is not None
    assert bench.oracle.forwards > 0
    assert "streams  k  tok/s" in od.table({"env": bench.env(), "rows": rows})


def test_a_wrong_record_is_caught_and_then_settled(bench):
    prompts = bench.prompts(1)
    plain = bench.generate(prompts, draft=False).tokens
    wrong = [list(plain[0])]
    # Round 2 (anchor: output 5, drafts: outputs 6 to 9) meets the wrong token first.
    wrong[0][6] = (wrong[0][6] + 1) % bench.vocab
    run = bench.spec(prompts, wrong, 4)
    assert run.tokens == plain  # verification keeps the output whatever the drafts
    assert run.counts["accepted"] < 4 * run.counts["rounds"]
    assert run.counts != bench.expected(1, 4)
    # Settling takes the output as the record: one change, then exactly k a round again.
    record, changed, settled = bench.settle_record(prompts, wrong, 4, limit=2)
    assert changed == 1 and record == plain and settled.tokens == plain
    assert settled.counts == bench.expected(1, 4)


def test_logit_gap_reads_the_row_that_chose_the_token(bench):
    prompts = bench.prompts(1)
    plain = bench.generate(prompts, draft=False).tokens[0]
    other = (plain[3] + 1) % bench.vocab
    gap = bench.logit_gap(prompts[0], plain, 3, other)
    # Greedy chose plain[3] from that row: it is the row's top token.
    assert gap["gap"] >= gap["top2_gap"] >= 0 and gap["std"] > 0
