"""What ``headstart bench`` sends: the prompts and the exact request bodies.

Job: load the built-in prompts (``prompts.json``, short coding and chat prompts) and the user's
prompt files (JSON or JSONL), and turn a prompt plus the sampling settings into the one request
body every arm receives. The body is fixed by design: temperature 0 and a seed by default, a
fixed output length (``max_tokens`` with ``ignore_eos``), streaming with a usage chunk, and
``chat_template_kwargs.enable_thinking`` when thinking is set on or off.

A *salt* (a short tag put in front of the first message) makes a prompt new to a server that
outlives one order (a URL arm), so that the "cold" request really is uncached.

Non-goals: sending requests (``client.py``) and choosing when (``runner.py``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from headstart.errors import HeadstartError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class Prompt:
    """One prompt: chat ``messages`` (a conversation) or a raw completion ``prompt``."""

    id: str
    messages: tuple[dict[str, Any], ...] | None = None
    prompt: str | None = None
    source: str = "builtin"

    @property
    def endpoint(self) -> str:
        return CHAT if self.messages is not None else COMPLETIONS

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "source": self.source, "endpoint": self.endpoint}
        if self.messages is not None:
            out["messages"] = list(self.messages)
        else:
            out["prompt"] = self.prompt
        return out


@dataclass(frozen=True)
class Sampling:
    """Settings shared by every request of a run."""

    max_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = 0
    thinking: str = "off"  # on | off | omit (send no chat_template_kwargs)
    token_ids: bool = False  # ask for token ids (logprobs) so fingerprints cover tokens
    extra: dict[str, Any] = field(default_factory=dict)  # merged into every body last


def _prompt_from_item(item: Any, default_id: str, source: str) -> Prompt:
    """A prompt file item: a string (one user turn), a list of messages, or an object with
    ``messages`` or ``prompt`` (and optionally ``id``)."""
    pid = default_id
    if isinstance(item, str):
        messages: Any = [{"role": "user", "content": item}]
        text = None
    elif isinstance(item, list):
        messages, text = item, None
    elif isinstance(item, dict):
        pid = str(item.get("id", default_id))
        messages, text = item.get("messages"), item.get("prompt")
        if (messages is None) == (text is None):
            raise HeadstartError(
                f"{source}: prompt {pid!r} needs exactly one of "
                "'messages' (chat) or 'prompt' (completions)"
            )
    else:
        raise HeadstartError(
            f"{source}: item {default_id!r} is {type(item).__name__}; expected "
            "a string, a list of messages, or an object"
        )
    if messages is not None:
        if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise HeadstartError(
                f"{source}: prompt {pid!r}: messages must be a non-empty list "
                "of objects with a 'role'"
            )
        return Prompt(pid, messages=tuple(messages), source=source)
    if not isinstance(text, str) or not text:
        raise HeadstartError(f"{source}: prompt {pid!r}: 'prompt' must be a non-empty string")
    return Prompt(pid, prompt=text, source=source)


def load_prompt_file(path: str | Path) -> list[Prompt]:
    """Prompts from a ``.jsonl`` file (one item per line) or a JSON file (a list of items, or
    an object with a ``prompts`` list). Items default to ids ``<file stem>-<n>``."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise HeadstartError(f"prompt file {p}: {e.strerror or e}") from None
    try:
        if p.suffix == ".jsonl":
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            doc = json.loads(text)
            items = doc["prompts"] if isinstance(doc, dict) else doc
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise HeadstartError(
            f"prompt file {p}: not a JSON list or JSONL of prompts ({e})"
        ) from None
    if not isinstance(items, list) or not items:
        raise HeadstartError(f"prompt file {p}: no prompts")
    return [_prompt_from_item(item, f"{p.stem}-{i}", str(p)) for i, item in enumerate(items)]


def builtin_prompts(kind: str = "all") -> list[Prompt]:
    """The shipped prompts; ``kind`` is all, code, chat or none."""
    if kind == "none":
        return []
    doc = json.loads((resources.files("headstart.bench") / "prompts.json").read_text())
    return [
        _prompt_from_item(item, item["id"], "builtin")
        for item in doc["prompts"]
        if kind == "all" or item["kind"] == kind
    ]


def select_prompts(prompts: list[Prompt], ids: list[str], limit: int | None) -> list[Prompt]:
    """Keep the prompts named in ``ids`` (all when empty), in their order, at most ``limit``."""
    seen: set[str] = set()
    for p in prompts:
        if p.id in seen:
            raise HeadstartError(f"two prompts share the id {p.id!r}; give them distinct ids")
        seen.add(p.id)
    unknown = [i for i in ids if i not in seen]
    if unknown:
        raise HeadstartError(f"unknown prompt id(s) {unknown}; known: {sorted(seen)}")
    chosen = [p for p in prompts if not ids or p.id in ids]
    chosen = chosen[:limit] if limit else chosen
    if not chosen:
        raise HeadstartError("the workload is empty: give --prompts FILE or --builtin")
    return chosen


def _salted(prompt: Prompt, salt: str | None) -> tuple[list[dict[str, Any]] | None, str | None]:
    if salt is None:
        return (list(prompt.messages) if prompt.messages is not None else None), prompt.prompt
    tag = f"[{salt}]\n"
    if prompt.messages is None:
        return None, tag + (prompt.prompt or "")
    first, *rest = prompt.messages
    content = first.get("content")
    # At the very front, so no cached prefix from an earlier order can match past it.
    first = {**first, "content": tag + content if isinstance(content, str) else content}
    return [first, *rest], None


def request_body(prompt: Prompt, sampling: Sampling, salt: str | None = None) -> dict[str, Any]:
    """The streamed request for ``prompt``, without ``model`` (each arm adds its own name)."""
    messages, text = _salted(prompt, salt)
    body: dict[str, Any] = {
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if messages is not None:
        body["messages"] = messages
        if sampling.thinking != "omit":
            body["chat_template_kwargs"] = {"enable_thinking": sampling.thinking == "on"}
        if sampling.token_ids:
            body.update(logprobs=True, return_tokens_as_token_ids=True)
    else:
        body["prompt"] = text
        if sampling.token_ids:
            body.update(logprobs=0, return_tokens_as_token_ids=True)
    body.update(sampling.extra)
    return body


def request_sha(body: dict[str, Any]) -> str:
    """Identity of a request's content: equal bodies (model name aside) must give equal
    outputs at temperature 0 or with a fixed seed."""
    rest = {k: v for k, v in body.items() if k != "model"}
    blob = json.dumps(rest, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def salt_for(run_id: str, order: int, prompt_id: str) -> str:
    """The salt of one prompt in one order of one run (unique, so nothing is cached)."""
    return f"bench {run_id} o{order} {prompt_id}"


def schedule(streams: list[int], bursts: int) -> list[tuple[str, int, int]]:
    """Per prompt, the bursts in the order they are sent, as (phase, streams, rep): one cold
    (first-use) request, then ``bursts`` rounds of one burst per stream count. Round 0 is
    "primed" (the prompt was just seen once; first time at this concurrency), later rounds
    are "steady"."""
    out = [("cold", 1, 0)]
    for rep in range(bursts):
        out += [("primed" if rep == 0 else "steady", s, rep) for s in streams]
    return out
