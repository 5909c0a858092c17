"""Tests for headstart.stops.StopStringMatcher over streamed text deltas."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headstart.stops import StopStringMatcher


def oracle(text: str, stops: list[str]) -> tuple[str, bool]:
    """Expected emitted text and stop flag, computed from the whole text at once.

    Independent of the implementation: scan end positions left to right; the first end
    position at which some stop string completes is where generation halts, and the
    longest stop string completing there decides where the text is cut.
    """
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)], True
    return text, False


def stream(stops: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    m = StopStringMatcher(stops)
    pieces = []
    stopped = False
    for d in deltas:
        out, stopped = m.push(d)
        pieces.append(out)
        assert stopped == m.stopped
        if stopped:
            # Everything after a stop is swallowed.
            assert m.push("more text") == ("", True)
            assert m.flush() == ""
            break
    if not stopped:
        pieces.append(m.flush())
    return "".join(pieces), stopped, pieces


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@st.composite
def texts_and_stops(draw):
    alphabet = draw(st.sampled_from(["ab", "abc", "abc\n<>/", "aé😀 "]))
    text = draw(st.text(alphabet=alphabet, max_size=40))
    stops = []
    for _ in range(draw(st.integers(0, 4))):
        if text and draw(st.booleans()):
            # Substrings of the text make matches (and near-matches) likely.
            i = draw(st.integers(0, len(text) - 1))
            j = draw(st.integers(i + 1, min(len(text), i + 6)))
            stops.append(text[i:j])
        else:
            stops.append(draw(st.text(alphabet=alphabet, min_size=1, max_size=6)))
    cuts = draw(st.lists(st.integers(0, 10_000), max_size=12))
    # Empty deltas happen (a token that decodes to nothing yet); include some.
    deltas = split(text, cuts)
    for k in draw(st.lists(st.integers(0, 40), max_size=3)):
        deltas.insert(k % (len(deltas) + 1), "")
    return text, stops, deltas


@pytest.mark.slow
@settings(max_examples=1500, deadline=None)
@given(texts_and_stops())
def test_streamed_output_matches_oracle(case):
    text, stops, deltas = case
    assert "".join(deltas) == text
    want, want_stopped = oracle(text, stops)
    got, stopped, _ = stream(stops, deltas)
    assert stopped == want_stopped
    assert got == want


@settings(max_examples=300, deadline=None)
@given(texts_and_stops())
def test_held_back_text_is_a_proper_prefix_of_some_stop(case):
    # Holding back no more than necessary: what is pending could still begin a stop.
    _, stops, deltas = case
    m = StopStringMatcher(stops)
    for d in deltas:
        _, stopped = m.push(d)
        if stopped:
            break
        if m.pending:
            assert any(s.startswith(m.pending) and s != m.pending for s in stops)


def test_no_stops_is_passthrough():
    m = StopStringMatcher([])
    assert m.push("hello <") == ("hello <", False)
    assert m.push("") == ("", False)
    assert m.flush() == ""


def test_stop_split_across_deltas():
    m = StopStringMatcher(["</answer>"])
    assert m.push("The result is 4") == ("The result is 4", False)
    assert m.push(".</an") == (".", False)
    assert m.pending == "</an"
    assert m.push("sw") == ("", False)
    assert m.push("er> trailing") == ("", True)
    assert m.matched_stop == "</answer>"
    assert m.push("x") == ("", True)


def test_false_alarm_is_released():
    m = StopStringMatcher(["</s>"])
    assert m.push("a<") == ("a", False)
    assert m.push("/") == ("", False)
    assert m.push("x") == ("</x", False)
    assert m.push("<") == ("", False)
    assert m.flush() == "<"
    assert not m.stopped and m.matched_stop is None


def test_overlapping_prefixes():
    # After "abcab" the next "c" breaks the match, but "abc" is again a prefix; the stop
    # then completes at the end.
    for deltas in (list("abcabcabd"), ["abcab", "cabd"], ["abcabcabd"], ["a", "bcabca", "bd"]):
        got, stopped, _ = stream(["abcabd"], deltas)
        assert (got, stopped) == ("abc", True), deltas


def test_first_completed_stop_wins_over_earlier_starting_longer_one():
    # "bc" completes before "abcd" could; generation would halt there.
    assert stream(["abcd", "bc"], list("abcd"))[:2] == ("a", True)
    # Both complete at the same character: cut at the longer one.
    assert stream(["bc", "abc"], ["xab", "c"])[:2] == ("x", True)


def test_earliest_of_several_stops_in_one_delta():
    m = StopStringMatcher(["END", "STOP"])
    assert m.push("one STOP two END") == ("one ", True)
    assert m.matched_stop == "STOP"


def test_stop_at_very_start():
    assert StopStringMatcher(["x"]).push("xyz") == ("", True)


def test_invalid_stops():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])
    with pytest.raises(ValueError):
        StopStringMatcher([None])  # type: ignore[list-item]
    assert StopStringMatcher("ab").push("xaby") == ("x", True)
