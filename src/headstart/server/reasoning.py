"""Split generated text into reasoning (``<think>…</think>``) and answer content.

Qwen3 / Qwen3.5 models think inside ``<think>…</think>``; the OpenAI-style API returns that
text as ``reasoning_content`` / ``reasoning`` and the rest as ``content``. With thinking on,
the Qwen3.5 chat template ends the prompt inside an open ``<think>`` block, so the output
starts as reasoning and only ``</think>`` appears in it (:func:`prompt_opens_reasoning` tells
which case a prompt is in). :class:`ReasoningSplitter` does the split over streamed text
deltas, holding back a possible tag prefix (``"</th"``) until the next delta settles it, and
:func:`split_full` gives the identical split for a whole text. The tags are dropped, and so
are the template's separators: one ``"\\n"`` right after ``<think>`` and up to two right after
``</think>`` (``strip_newlines=False`` keeps them, which is exactly what vLLM's ``qwen3``
parser returns: it strips nothing). Non-goals: tool-call parsing (``<tool_call>`` is passed
through as content or reasoning like any other text), token-id based detection, and reasoning
budgets.
"""

from __future__ import annotations

__all__ = [
    "THINK_CLOSE",
    "THINK_OPEN",
    "ReasoningSplitter",
    "prompt_opens_reasoning",
    "split_full",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_TAGS = (THINK_OPEN, THINK_CLOSE)

# Newlines the template puts after each tag: "<think>\n" and "</think>\n\n" (see the Qwen3.5
# template's generation prompt and how it re-renders assistant history with lstrip('\n')).
_STRIP_AFTER = {THINK_OPEN: 1, THINK_CLOSE: 2}


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True iff the prompt's last ``<think>`` has no ``</think>`` after it.

    That is the case when the chat template opened the thinking block for the model (Qwen3.5
    with thinking on); with ``enable_thinking=False`` the template closes it
    (``<think>\\n\\n</think>\\n\\n``) and this returns False.
    """
    start = prompt_text.rfind(THINK_OPEN)
    return start != -1 and THINK_CLOSE not in prompt_text[start + len(THINK_OPEN) :]


def _held_tag_prefix(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a tag."""
    longest = max(len(tag) for tag in _TAGS) - 1
    for size in range(min(longest, len(text)), 0, -1):
        tail = text[-size:]
        if any(tag.startswith(tail) for tag in _TAGS):
            return size
    return 0


class ReasoningSplitter:
    """Incremental reasoning/content splitter for one generated sequence.

    Contract: for any way of cutting a text into deltas, concatenating the results of every
    :meth:`push` and the final :meth:`flush` gives the same ``(reasoning, content)`` pair as
    processing the whole text in one push. Text between ``<think>`` and ``</think>`` is
    reasoning, the rest content; the tags are dropped wherever they appear (a stray
    ``</think>`` in content, or a repeated ``<think>`` inside reasoning, only re-enters the
    state it names). If the block is never closed, everything after it stays reasoning.
    Text is held back only while it could still be the start of a tag; separator newlines
    are dropped as they arrive (the count still to drop carries across pushes).
    """

    def __init__(self, start_in_reasoning: bool, *, strip_newlines: bool = True) -> None:
        """``start_in_reasoning``: the prompt ended inside an open ``<think>`` block (see
        :func:`prompt_opens_reasoning`). ``strip_newlines``: drop the template's newline
        separators after the tags (default); False keeps the text verbatim, as vLLM does."""
        self._in_reasoning = start_in_reasoning
        self._strip_newlines = strip_newlines
        self._held = ""  # a possible tag prefix, not yet emitted
        self._strip = 0  # newlines still to drop right after the last tag
        self._flushed = False

    @classmethod
    def for_prompt(cls, prompt_text: str, *, strip_newlines: bool = True) -> ReasoningSplitter:
        """A splitter for the output of ``prompt_text``: starts in reasoning iff the prompt
        left a ``<think>`` block open, and if the prompt ends right at ``<think>`` (no
        newline yet) the output's leading newline is that tag's separator and is dropped."""
        splitter = cls(prompt_opens_reasoning(prompt_text), strip_newlines=strip_newlines)
        if strip_newlines and prompt_text.endswith(THINK_OPEN):
            splitter._strip = _STRIP_AFTER[THINK_OPEN]
        return splitter

    @property
    def in_reasoning(self) -> bool:
        """True while the text being produced is reasoning."""
        return self._in_reasoning

    def push(self, text: str) -> tuple[str, str]:
        """Feed the next delta; return ``(reasoning_delta, content_delta)`` safe to emit."""
        if self._flushed:
            raise RuntimeError("push() after flush(): the stream has ended")
        data = self._held + text
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        pos = 0
        while True:
            pos = self._skip_separator(data, pos)
            tag, at = self._next_tag(data, pos)
            if tag is None:
                break
            (reasoning if self._in_reasoning else content).append(data[pos:at])
            self._in_reasoning = tag == THINK_OPEN
            self._strip = _STRIP_AFTER[tag] if self._strip_newlines else 0
            pos = at + len(tag)
        rest = data[pos:]
        hold = _held_tag_prefix(rest)
        if hold:
            self._held = rest[-hold:]
            rest = rest[:-hold]
        (reasoning if self._in_reasoning else content).append(rest)
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """End the stream: return held-back text (a tag prefix that never completed)."""
        if self._flushed:
            return "", ""
        self._flushed = True
        held, self._held = self._held, ""
        return (held, "") if self._in_reasoning else ("", held)

    def _skip_separator(self, data: str, pos: int) -> int:
        # Drop up to self._strip newlines; any other character ends the separator. If the
        # data runs out first the remaining count carries over to the next push, which is
        # what keeps streaming and whole-text results identical.
        while self._strip and pos < len(data):
            if data[pos] != "\n":
                self._strip = 0
                break
            pos += 1
            self._strip -= 1
        return pos

    @staticmethod
    def _next_tag(data: str, pos: int) -> tuple[str | None, int]:
        best: tuple[str | None, int] = (None, -1)
        for tag in _TAGS:
            at = data.find(tag, pos)
            if at != -1 and (best[0] is None or at < best[1]):
                best = (tag, at)
        return best


def split_full(
    text: str, start_in_reasoning: bool, *, strip_newlines: bool = True
) -> tuple[str | None, str]:
    """Split a whole generated text: ``(reasoning or None when empty, content)``.

    Same result as streaming ``text`` through :class:`ReasoningSplitter` in any pieces.
    """
    splitter = ReasoningSplitter(start_in_reasoning, strip_newlines=strip_newlines)
    r1, c1 = splitter.push(text)
    r2, c2 = splitter.flush()
    reasoning = r1 + r2
    return (reasoning or None), c1 + c2
