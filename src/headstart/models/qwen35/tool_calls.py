"""Tool calls in Qwen3.5's output format, turned into OpenAI ``tool_calls``.

The Qwen3.5 chat template asks the model to answer a call as::

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

:class:`ToolCallParser` takes the answer's content as it streams. Text outside the blocks passes
through. Text from a ``<tool_call>`` (or a prefix that may become one) is held back until the
block closes, and then comes out as one call. Parameter values are typed by the tool's JSON
schema: a string parameter keeps the raw text; other parameters are decoded as JSON when they
parse, otherwise kept as text (the leniency of vLLM's qwen3_coder parser). Non-goals: other
models' formats, and partial argument streaming (each call arrives whole, in one delta).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI shape (``index`` set for streaming deltas)."""
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {
                "name": self.name,
                "arguments": json.dumps(self.arguments, ensure_ascii=False),
            },
        }
        if index is not None:
            out["index"] = index
        return out


def _schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    out = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") or {}
            out[fn["name"]] = params.get("properties", {}) if isinstance(params, dict) else {}
    return out


def _value(raw: str, schema: dict[str, Any] | None) -> Any:
    kind = (schema or {}).get("type")
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_block(block: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | None:
    """One ``<tool_call>...</tool_call>`` body; None when it holds no function."""
    m = _FUNCTION.search(block)
    if m is None:
        return None
    name = m.group(1).strip()
    props = schemas.get(name, {})
    args = {p.strip(): _value(v, props.get(p.strip())) for p, v in _PARAMETER.findall(m.group(2))}
    return ToolCall(name, args)


class ToolCallParser:
    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.schemas = _schemas(tools)
        self.buffer = ""  # held text: a block in progress, or a possible start of one
        self.calls: list[ToolCall] = []
        self._after_call = False  # newlines right after a call are its separator, dropped

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """Feed content; returns (content safe to emit, calls completed by this text)."""
        data = self.buffer + text
        self.buffer = ""
        out, calls = [], []
        while True:
            if self._after_call:
                stripped = data.lstrip("\n")
                if not stripped:  # only newlines so far: the separator may go on
                    data = ""
                else:
                    data, self._after_call = stripped, False
            start = data.find(OPEN)
            if start < 0:
                keep = _partial_open(data)
                out.append(data[: len(data) - keep])
                self.buffer = data[len(data) - keep :]
                break
            out.append(data[:start])
            end = data.find(CLOSE, start)
            if end < 0:
                self.buffer = data[start:]
                break
            call = parse_block(data[start + len(OPEN) : end], self.schemas)
            if call is None:  # not a call after all: keep the text
                out.append(data[start : end + len(CLOSE)])
            else:
                calls.append(call)
                self._after_call = True
            data = data[end + len(CLOSE) :]
        self.calls += calls
        return "".join(out), calls

    def flush(self) -> str:
        """End of output: an unfinished block is returned as plain text."""
        rest, self.buffer = self.buffer, ""
        return rest


def _partial_open(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0
