"""Tests for headstart.server.reasoning: <think> splitting, streaming and whole-text."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headstart.server.reasoning import (
    ReasoningSplitter,
    prompt_opens_reasoning,
    split_full,
)
from headstart.tokenizer import Tokenizer


def oracle(text: str, start_in_reasoning: bool) -> tuple[str, str]:
    """Independent whole-text reference: walk the tags with a regex, strip separators."""
    reasoning, content = [], []
    in_reasoning = start_in_reasoning
    strip = 0
    pos = 0
    for m in re.finditer(r"<think>|</think>", text):
        chunk = text[pos : m.start()]
        lead = len(chunk) - len(chunk.lstrip("\n"))
        chunk = chunk[min(lead, strip) :]
        (reasoning if in_reasoning else content).append(chunk)
        in_reasoning = m.group() == "<think>"
        strip = 1 if in_reasoning else 2
        pos = m.end()
    chunk = text[pos:]
    lead = len(chunk) - len(chunk.lstrip("\n"))
    (reasoning if in_reasoning else content).append(chunk[min(lead, strip) :])
    return "".join(reasoning), "".join(content)


def stream(deltas: list[str], start_in_reasoning: bool, **kw) -> tuple[str, str]:
    s = ReasoningSplitter(start_in_reasoning, **kw)
    r, c = [], []
    for d in deltas:
        a, b = s.push(d)
        r.append(a)
        c.append(b)
    a, b = s.flush()
    return "".join(r) + a, "".join(c) + b


def full(text: str, start: bool) -> tuple[str, str]:
    r, c = split_full(text, start)
    return r or "", c


def test_basic_block_and_separators():
    text = "<think>\nLet me think.\n</think>\n\nThe answer is 42."
    assert split_full(text, False) == ("Let me think.\n", "The answer is 42.")


def test_start_in_reasoning_qwen35_style():
    # Qwen3.5's prompt ends with "<think>\n": the output only closes the block.
    assert split_full("hmm, 6*7\n</think>\n\n42", True) == ("hmm, 6*7\n", "42")


def test_no_tags_is_content_unless_started_in_reasoning():
    assert split_full("just an answer", False) == (None, "just an answer")
    assert split_full("still thinking, cut off", True) == ("still thinking, cut off", "")


def test_unclosed_block_stays_reasoning():
    assert split_full("<think>\nhalf a thought", False) == ("half a thought", "")
    assert stream(["<think>", "\nhalf", " a thought", "</th"], False) == ("half a thought</th", "")


def test_tags_split_across_deltas():
    deltas = ["<", "th", "ink>", "\n", "abc", "</", "thi", "nk", ">", "\n", "\n", "X"]
    assert stream(deltas, False) == ("abc", "X")
    # A held prefix that turns out not to be a tag is released as text.
    assert stream(["a </th", "ing"], True) == ("a </thing", "")
    assert stream(["2 <", " 3"], False) == ("", "2 < 3")


def test_holdback_only_for_possible_tag_prefix():
    s = ReasoningSplitter(True)
    assert s.push("thinking </thi") == ("thinking ", "")
    assert s.push("nk>\n\nhi") == ("", "hi")
    assert not s.in_reasoning
    assert s.push(" <") == ("", " ")
    assert s.flush() == ("", "<")


def test_separator_strip_is_bounded():
    # Only one newline after <think> and two after </think> are the template's.
    assert split_full("<think>\n\nx</think>\n\n\ny", False) == ("\nx", "\ny")
    assert split_full("</think>\ny", True) == (None, "y")
    assert split_full("</think>", True) == (None, "")


def test_strip_newlines_false_matches_vllm_verbatim():
    text = "<think>\nabc\n</think>\n\nanswer"
    assert split_full(text, False, strip_newlines=False) == ("\nabc\n", "\n\nanswer")
    assert stream(["<think>\nab", "c\n</thi", "nk>\n\nanswer"], False, strip_newlines=False) == (
        "\nabc\n",
        "\n\nanswer",
    )


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("no tags at all")
    assert prompt_opens_reasoning("<think>a</think> later <think>")


def test_prompt_opens_reasoning_with_real_template():
    tok = Tokenizer.from_dir("src/headstart/default_model")
    msgs = [{"role": "user", "content": "hi"}]
    assert prompt_opens_reasoning(tok.apply_chat_template(msgs))
    assert not prompt_opens_reasoning(tok.apply_chat_template(msgs, enable_thinking=False))


def test_for_prompt_strips_newline_when_prompt_ends_at_tag():
    s = ReasoningSplitter.for_prompt("...assistant\n<think>")
    assert s.in_reasoning
    assert s.push("\nidea") == ("idea", "")
    s = ReasoningSplitter.for_prompt("...assistant\n<think>\n")
    assert s.push("\nidea") == ("\nidea", "")


def test_push_after_flush_raises():
    s = ReasoningSplitter(False)
    s.flush()
    with pytest.raises(RuntimeError):
        s.push("x")


# Text drawn from an alphabet rich in tag fragments and newlines, so that random cuts
# often land inside tags and separators.
_pieces = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<",
        "</",
        "th",
        "ink",
        ">",
        "\n",
        "\n\n",
        "a",
        "b c",
        "é",
        "<t",
        "</think",
        "x>",
    ]
)
_texts = st.lists(_pieces, max_size=25).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=_texts, start=st.booleans(), data=st.data())
def test_any_split_matches_split_full(text, start, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    deltas = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert stream(deltas, start) == full(text, start) == oracle(text, start)


@settings(max_examples=200, deadline=None)
@given(text=_texts, start=st.booleans())
def test_one_char_deltas_match(text, start):
    assert stream(list(text), start) == full(text, start)
    # Verbatim mode keeps every non-tag character.
    r, c = stream(list(text), start, strip_newlines=False)
    assert len(r) + len(c) == len(re.sub(r"</?think>", "", text))
