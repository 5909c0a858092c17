"""The raw per-request row: its schema, the derived fields, and CSV/JSON round-trips.

Job: one place that says what a row holds, how TTFT/decode/e2e follow from its timestamps,
and how rows are written and read back *exactly* (floats as ``repr`` in CSV, so a CSV and a
JSON copy of the same rows parse to equal values). Both the runner and ``bench check`` use it,
so a check recomputes with the very rule that produced the numbers.

Non-goals: aggregation (``summary.py``) and judging a receipt (``check.py``).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Sequence
from typing import Any

Row = dict[str, Any]

#: Field name -> type, in column order. Times are seconds since the run's start on the
#: client's ``time.perf_counter()`` clock; ``None`` (empty in CSV) means "did not happen".
SCHEMA: dict[str, type] = {
    "arm": str,  # arm name
    "order": int,  # which order (0 = arms as given, 1 = reversed, ...)
    "slot": int,  # the arm's position within that order
    "prompt_id": str,
    "phase": str,  # cold | primed | steady
    "streams": int,  # concurrent streams in this burst (1 for cold)
    "rep": int,  # burst index within (prompt, streams); 0 is the primed burst
    "stream": int,  # index of this request within its burst
    "request_sha": str,  # sha256 of the request body without "model": same body, same output
    "t_send": float,  # just before the request was sent
    "t_head": float,  # the response's status line and headers received
    "t_first": float,  # first delta carrying a token (text, or logprobs/tool calls)
    "t_last": float,  # last such delta
    "t_done": float,  # data: [DONE]
    "ttft_s": float,  # derived: t_first - t_send
    "decode_tok_s": float,  # derived: (tokens - 1) / (t_last - t_first)
    "e2e_s": float,  # derived: t_done - t_send
    "prompt_tokens": int,  # from the server's usage chunk
    "completion_tokens": int,
    "cached_tokens": int,  # usage.prompt_tokens_details.cached_tokens
    "n_deltas": int,  # deltas received that carry a token
    "finish_reason": str,
    "fingerprint": str,  # sha256 (16 hex) of the output text (and token ids with --token-ids)
    "status": int,  # HTTP status
    "error": str,  # empty when the request succeeded
}
FIELDS: tuple[str, ...] = tuple(SCHEMA)
#: A request's timestamps, in the order they happen (each one that happened).
STAMPS = ("t_send", "t_head", "t_first", "t_last", "t_done")
#: Fields computed from others; ``bench check`` recomputes and compares them.
DERIVED = ("ttft_s", "decode_tok_s", "e2e_s")
#: The fields that name a row; a receipt must hold each key exactly once.
KEY = ("arm", "order", "prompt_id", "phase", "streams", "rep", "stream")
#: The fields that name a burst (the requests sent together).
BURST_KEY = ("arm", "order", "prompt_id", "phase", "streams", "rep")


def output_tokens(row: Row) -> int:
    """Tokens generated: the server's usage count, else (no usage chunk) the deltas seen."""
    n = row.get("completion_tokens")
    return int(n) if n is not None else int(row.get("n_deltas") or 0)


def derive(row: Row) -> Row:
    """The derived fields (:data:`DERIVED`) of ``row``, from its timestamps and token count."""
    send, first, last, done = (row.get(k) for k in ("t_send", "t_first", "t_last", "t_done"))
    ttft = first - send if first is not None and send is not None else None
    e2e = done - send if done is not None and send is not None else None
    decode = None
    tokens = output_tokens(row)
    # A single token (or all tokens in one delta) has no decode interval to divide by.
    if first is not None and last is not None and last > first and tokens > 1:
        decode = (tokens - 1) / (last - first)
    return {"ttft_s": ttft, "decode_tok_s": decode, "e2e_s": e2e}


def key_of(row: Row, fields: Sequence[str] = KEY) -> tuple:
    return tuple(row[f] for f in fields)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)  # shortest string that parses back to the same float
    return str(value)


def to_csv(rows: Iterable[Row]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(FIELDS)
    for row in rows:
        w.writerow([_cell(row.get(f)) for f in FIELDS])
    return out.getvalue()


def _parse(field: str, text: str) -> Any:
    kind = SCHEMA[field]
    if kind is str:
        return text
    if text == "":
        return None
    return kind(text)


def from_csv(text: str) -> list[Row]:
    """Rows from :func:`to_csv` text. Raises ValueError naming the line of a malformed cell."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if header is None or tuple(header) != FIELDS:
        raise ValueError(f"CSV header is {header!r}, expected the bench row schema")
    rows = []
    for line, cells in enumerate(reader, start=2):
        if len(cells) != len(FIELDS):
            raise ValueError(f"CSV line {line}: {len(cells)} cells, expected {len(FIELDS)}")
        try:
            rows.append({f: _parse(f, c) for f, c in zip(FIELDS, cells, strict=False)})
        except ValueError as e:
            raise ValueError(f"CSV line {line}: {e}") from None
    return rows


def to_json(rows: Iterable[Row]) -> str:
    return (
        json.dumps(
            {"fields": list(FIELDS), "rows": [{f: r.get(f) for f in FIELDS} for r in rows]},
            indent=1,
        )
        + "\n"
    )


def from_json(text: str) -> list[Row]:
    """Rows from :func:`to_json` text, type-checked against :data:`SCHEMA`."""
    doc = json.loads(text)
    if tuple(doc.get("fields", ())) != FIELDS:
        raise ValueError("JSON 'fields' differ from the bench row schema")
    rows = []
    for i, raw in enumerate(doc["rows"]):
        if set(raw) != set(FIELDS):
            raise ValueError(f"JSON row {i}: fields {sorted(set(raw) ^ set(FIELDS))} differ")
        for f, kind in SCHEMA.items():
            v = raw[f]
            number = (int,) if kind is int else (int, float)
            ok = (
                isinstance(v, str)
                if kind is str
                else v is None or (isinstance(v, number) and not isinstance(v, bool))
            )
            if not ok:
                raise ValueError(f"JSON row {i}: field {f!r} has {v!r}")
            if kind is float and isinstance(v, int):
                raw[f] = float(v)
        rows.append(raw)
    return rows
