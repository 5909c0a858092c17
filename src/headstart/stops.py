"""Stop-string detection over streamed, incrementally decoded text.

:class:`StopStringMatcher` sits between the detokenizer and the client: it receives each
text delta of one sequence and returns the part that is safe to emit. Text that might be
the start of a stop string is held back until the following text settles it; when a stop
string completes, the text before it is released, the stop string itself is dropped (as in
the OpenAI API) and the matcher reports that the sequence must stop. Non-goals: stop token
ids, EOS and ``max_tokens`` (the engine checks those on token ids), tokenisation or
detokenisation, and regular-expression stops.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    """Incremental matcher for one sequence's stop strings.

    Contract: over a whole stream, the concatenation of every emitted piece (from
    :meth:`push`, plus :meth:`flush` if generation ended for another reason) equals the
    full text truncated at the *first stop string to complete*: among all occurrences of
    any stop string, the one that ends earliest, and among those ending at the same
    character the one that starts earliest (the longest). This is the only consistent
    choice while streaming, since generation halts as soon as any stop string appears;
    for stop strings that are not substrings of one another it is simply the earliest
    occurrence. With no stop strings every delta passes straight through.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            stop = (stop,)
        stops = tuple(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))  # dedupe, keep order
        self._longest = max((len(s) for s in self._stops), default=0)
        # Suffix of the text so far that is a proper prefix of some stop string, starting
        # at the earliest such position; everything before it has been emitted.
        self._pending = ""
        self._matched: str | None = None

    @property
    def stopped(self) -> bool:
        """True once a stop string has been seen."""
        return self._matched is not None

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the sequence (for the API's stop reason), or None."""
        return self._matched

    @property
    def pending(self) -> str:
        """Text currently held back because it may begin a stop string."""
        return self._pending

    def push(self, text_delta: str) -> tuple[str, bool]:
        """Feed the next delta; return ``(text_safe_to_emit, stopped)``.

        Once stopped, every further call returns ``("", True)``.
        """
        if self._matched is not None:
            return "", True
        if not self._stops:
            return text_delta, False

        text = self._pending + text_delta
        hit = self._first_completed(text)
        if hit is not None:
            start, stop = hit
            self._matched = stop
            self._pending = ""
            return text[:start], True

        hold_from = self._hold_start(text)
        self._pending = text[hold_from:]
        return text[:hold_from], False

    def flush(self) -> str:
        """Release held-back text when generation ends without a stop string.

        Returns "" if a stop string was matched (its prefix was already emitted).
        """
        out, self._pending = self._pending, ""
        return out

    def _first_completed(self, text: str) -> tuple[int, str] | None:
        """Start and string of the occurrence in ``text`` that ends first, or None.

        No occurrence existed before this delta (we would have stopped), and every new
        one must start inside ``text`` because held-back text begins at the earliest
        position where a stop string could still start.
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self._stops:
            # str.find gives the earliest start, hence the earliest end, for this string.
            i = text.find(s)
            if i >= 0:
                key = (i + len(s), i, s)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _hold_start(self, text: str) -> int:
        """Earliest index from which ``text``'s suffix is a proper prefix of a stop string."""
        # A proper prefix is shorter than the longest stop string, so only the last
        # (longest - 1) characters can be held.
        for i in range(max(0, len(text) - self._longest + 1), len(text)):
            tail = text[i:]
            if any(s.startswith(tail) for s in self._stops):
                return i
        return len(text)
