"""Where the next turn of a conversation diverges from this turn's prompt, from the template.

A chat client sends the whole conversation every turn: the next prompt renders this one's
messages again, then the model's answer as an assistant message, then something new. Where
the rendered text of the next turn first differs from this prompt is the last point a snapshot
of this prompt's state can serve the next turn (a Gated DeltaNet state cannot be rewound, so the
engine snapshots exactly there while it prefills).

Any template: the point is found by rendering the conversation the way its next turn will be
rendered, with an assistant answer and a new question appended, twice with different probes,
and keeping
the characters the prompt and both renderings share. A template's own header, whitespace
control, thinking blocks (added to the prompt, dropped from history) and the like all end up
before or after that point as the template decides; no template text is known here. Probing
costs two renders on the request's worker thread, no encoding. The engine confirms every
restore token by token, so a point that turns out wrong costs a cache miss, never a wrong
answer; where the template renders the answer itself again verbatim, the end-of-generation
snapshot (prompt + answer) serves the next turn instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

Render = Callable[..., str]

# Two answers that differ in their first character and share nothing a template might strip.
_PROBES = ("A1", "b2")


def divergence(
    render: Render,
    messages: Sequence[Mapping[str, Any]],
    prompt_text: str,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> int | None:
    """The number of leading characters of ``prompt_text`` (``messages`` rendered with the
    generation prompt) that the next turn of the conversation renders again; None when the
    template cannot render an answer after these messages (then no snapshot is worth it)."""
    rendered = [prompt_text]
    for probe in _PROBES:
        # The answer followed by a new question, as the next turn sends it: a template may
        # render the last message differently (Qwen3.5 keeps the reasoning block of an answer
        # that follows the last question), and history is what the next turn renders.
        answered = [
            *messages,
            {"role": "assistant", "content": probe},
            {"role": "user", "content": probe},
        ]
        try:
            rendered.append(
                render(answered, add_generation_prompt=True, tools=tools, **template_kwargs)
            )
        except Exception:  # a template that refuses this shape: no boundary, nobody's error
            return None
    return _common_prefix(rendered)


def _common_prefix(texts: Sequence[str]) -> int:
    """The length of the longest prefix all ``texts`` share (a binary search of startswith:
    a few slices, not a loop over characters)."""
    shortest = min(texts, key=len)
    lo, hi = 0, len(shortest)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if all(t.startswith(shortest[:mid]) for t in texts):
            lo = mid
        else:
            hi = mid - 1
    return lo
