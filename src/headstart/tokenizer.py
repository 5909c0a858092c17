"""Text <-> token ids: a checkpoint's tokenizer, its chat template, and streaming decode.

``Tokenizer`` loads a checkpoint's ``tokenizer.json`` with the Rust ``tokenizers`` library (no
transformers at runtime), reads ``tokenizer_config.json`` and the chat template, and renders chat
messages into prompt text exactly as transformers' ``apply_chat_template(..., tokenize=False)``
does: same sandboxed Jinja environment, same filters and globals, same template variables.
``IncrementalDetokenizer`` turns generated ids into text one token at a time for streaming,
holding back bytes of a multi-byte character until the character is complete, so that the
concatenated pieces always equal ``Tokenizer.decode`` of all ids. Broken or missing checkpoint
files raise ``headstart.errors.CheckpointError`` naming the file.

``Tokenizer.encode_chat`` renders and encodes a conversation so that text the client wrote
(system, developer, user and tool messages, tool definitions) can never produce the template's
control tokens: added-token text written there (``<|im_start|>``, ``<think>``) is encoded as
ordinary text, while the template's own tokens and the assistant's history keep their ids.

The Qwen3.5 chat template shipped in ``models/qwen35/chat_template.jinja`` is the Qwen3.5-9B
template verbatim (taken from the rendered-golden fixture ``testdata/chat_think_goldens/
qwen35_tools.json`` of townsendmerino/goinfer, checkpoint "qwen3.5-9b", and checked against the
prompts recorded there).
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from headstart.errors import CheckpointError

__all__ = [
    "ChatEncoding",
    "IncrementalDetokenizer",
    "Tokenizer",
]


TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# The named special-token attributes transformers passes to every chat template (its
# SPECIAL_TOKENS_ATTRIBUTES). Other "*_token" string entries of tokenizer_config.json become
# "model-specific" special tokens and are passed too.
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

_REPLACEMENT_CHAR = "\ufffd"

# encode_chat: while the template renders, each added-token text in a client string is replaced
# by a placeholder: private-use characters around a random per-call nonce (decimal digits, so no
# case or escaping filter alters it) and the index of the token it stands for.
_MARK_OPEN = "\ue000"
_MARK_CLOSE = "\ue001"
_NONCE_DIGITS = 24  # about 80 random bits
_MARK_RE = re.compile(
    re.escape(_MARK_OPEN) + rf"(\d{{{_NONCE_DIGITS}}})(\d+)" + re.escape(_MARK_CLOSE)
)
# The role whose messages the model wrote: its text keeps today's encoding.
_MODEL_ROLE = "assistant"


def _new_nonce() -> str:
    return f"{secrets.randbelow(10**_NONCE_DIGITS):0{_NONCE_DIGITS}d}"


def _client_strings(value: Any, skip_role: bool = False) -> Iterable[str]:
    """Every string in ``value`` (dict keys included), depth first; with ``skip_role`` the
    value of a top-level ``"role"`` key is left out."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _client_strings(key)
            if not (skip_role and key == "role"):
                yield from _client_strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _client_strings(item)


def _map_strings(value: Any, fn: Callable[[str], str], skip_role: bool = False) -> Any:
    """``value`` with ``fn`` applied to every string (as ``_client_strings`` walks them);
    containers are copied only where something changed, and the input is never modified."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        changed = False
        for key, item in value.items():
            new_key = _map_strings(key, fn)
            new_item = item if skip_role and key == "role" else _map_strings(item, fn)
            changed = changed or new_key is not key or new_item is not item
            out[new_key] = new_item
        return out if changed else value
    if isinstance(value, (list, tuple)):
        items = [_map_strings(item, fn) for item in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        return items if isinstance(value, list) else tuple(items)
    return value


def _literal_backend(backend: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """A copy of ``backend`` that encodes the text of every added token as ordinary text.

    ``encode_special_tokens`` only affects added tokens flagged special (``<think>`` is not), so
    the copy flags them all special first. Made once; only read afterwards (thread-safe).
    """
    state = json.loads(backend.to_str())
    for token in state.get("added_tokens") or ():
        token["special"] = True
    literal = tokenizers.Tokenizer.from_str(json.dumps(state))
    literal.encode_special_tokens = True
    return literal


@dataclass(frozen=True)
class ChatEncoding:
    """A rendered conversation and its tokens (``Tokenizer.encode_chat``).

    ``text`` is the prompt text, ``ids`` its token ids (treat the list as read-only) and
    ``token_ends[i]`` the offset in ``text`` (in characters) where token ``i`` ends; tokens that
    each hold some bytes of one character all end where that character ends.
    """

    text: str
    ids: list[int]
    token_ends: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.token_ends):
            raise ValueError(f"{len(self.ids)} ids but {len(self.token_ends)} token ends")

    def tokens_within(self, char_pos: int) -> int:
        """The number of leading tokens whose text lies inside ``text[:char_pos]`` (all of
        it when ``char_pos`` ends a token, one fewer when it falls inside one)."""
        return bisect_right(self.token_ends, max(0, min(char_pos, len(self.text))))


# --------------------------------------------------------------------------------------------
# Jinja environment (mirrors transformers.utils.chat_template_utils._cached_compile_jinja_template)
# --------------------------------------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """Accept ``{% generation %}…{% endgeneration %}`` and render its body unchanged.

    transformers marks assistant spans with this tag to build training masks. We never need the
    mask, but templates that use the tag must still compile, and the body must render in the
    same (call-block) scope transformers gives it, so variables set inside stay inside.
    """

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes '<', '>', '&' and "'"; chat templates must emit the raw
    # JSON, so (like transformers) we replace it with plain json.dumps and its usual options.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@cache
def _jinja_environment() -> ImmutableSandboxedEnvironment:
    # trim_blocks/lstrip_blocks decide the whitespace of every rendered prompt, so they must
    # match transformers exactly; the sandbox keeps a checkpoint's template from touching
    # anything but the values we pass in.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# --------------------------------------------------------------------------------------------
# Loading helpers
# --------------------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text ({exc})") from exc
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read file ({exc.strerror or exc})") from exc


def _load_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found (every checkpoint needs a {TOKENIZER_FILE})")
    text = _read_text(path)
    try:
        return tokenizers.Tokenizer.from_str(text)
    except Exception as exc:  # the Rust side raises a bare Exception
        # Tell "cut short / not JSON" apart from "JSON but not a tokenizer": the first usually
        # means an interrupted download, the second a wrong or incompatible file.
        try:
            json.loads(text)
        except json.JSONDecodeError as json_exc:
            raise CheckpointError(
                f"{path}: not valid JSON, the file is truncated or corrupt ({json_exc})"
            ) from exc
        raise CheckpointError(f"{path}: not a usable tokenizer definition ({exc})") from exc


def _load_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    text = _read_text(path)
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{path}: not valid JSON, the file is truncated or corrupt ({exc})"
        ) from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _apply_pretokenize_regex(
    backend: tokenizers.Tokenizer, regex: str, tokenizer_path: Path, config_path: Path
) -> None:
    """Use the split regex that tokenizer_config.json declares instead of tokenizer.json's.

    Qwen3.5 checkpoints ship a tokenizer.json whose Split regex lacks ``\\p{M}`` (combining
    marks), while their tokenizer_config.json's ``pretokenize_regex`` and transformers'
    ``Qwen3_5Tokenizer`` (which rebuilds the pre-tokenizer in code) use ``[\\p{L}\\p{M}]+``. The
    two give different ids for text with marks (Devanagari, Thai, decomposed accents). Following
    the declared regex keeps our ids equal to transformers' for those checkpoints.
    """
    pre_tokenizer = backend.pre_tokenizer
    if pre_tokenizer is None:
        raise CheckpointError(
            f"{config_path}: declares pretokenize_regex but {tokenizer_path} has no pre-tokenizer"
        )
    state = json.loads(pre_tokenizer.__getstate__())
    parts = state["pretokenizers"] if state.get("type") == "Sequence" else [state]
    splits = [p for p in parts if p.get("type") == "Split" and "Regex" in p.get("pattern", {})]
    if len(splits) != 1:
        raise CheckpointError(
            f"{config_path}: declares pretokenize_regex but {tokenizer_path}'s pre-tokenizer has "
            f"{len(splits)} regex Split steps, expected exactly one to replace"
        )
    if splits[0]["pattern"]["Regex"] == regex:
        return
    splits[0]["pattern"]["Regex"] = regex
    try:
        pre_tokenizer.__setstate__(json.dumps(state).encode("utf-8"))
    except Exception as exc:
        raise CheckpointError(
            f"{config_path}: pretokenize_regex is not a valid regex ({exc})"
        ) from exc
    backend.pre_tokenizer = pre_tokenizer


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _template_special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The special-token variables transformers hands every template (its special_tokens_map)."""
    tokens: dict[str, str] = {}
    for key, value in config.items():
        if key in _NAMED_SPECIAL_TOKENS or key.endswith("_token"):
            text = _token_text(value)
            if text is not None:
                tokens[key] = text
    extra = config.get("extra_special_tokens")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            text = _token_text(value)
            if text is not None:
                tokens[str(key)] = text
    return tokens


def _load_chat_templates(directory: Path, config: Mapping[str, Any]) -> tuple[dict[str, str], Path]:
    """Named template sources and the file they came from; ``{}`` when there is no template.

    ``chat_template.jinja`` wins over ``tokenizer_config.json["chat_template"]``, as in
    transformers; the config value may be a string or a list of ``{"name", "template"}``.
    """
    jinja_path = directory / CHAT_TEMPLATE_FILE
    if jinja_path.is_file():
        return {"default": _read_text(jinja_path)}, jinja_path
    config_path = directory / TOKENIZER_CONFIG_FILE
    raw = config.get("chat_template")
    if raw is None:
        return {}, config_path
    if isinstance(raw, str):
        return {"default": raw}, config_path
    if isinstance(raw, list):
        templates: dict[str, str] = {}
        for entry in raw:
            if not (
                isinstance(entry, Mapping)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise CheckpointError(
                    f"{config_path}: field 'chat_template': list entries must be "
                    '{"name": str, "template": str}'
                )
            templates[entry["name"]] = entry["template"]
        return templates, config_path
    raise CheckpointError(
        f"{config_path}: field 'chat_template': expected a string or a list, "
        f"got {type(raw).__name__}"
    )


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode through ``tokenizers`` plus chat-template rendering.

    Build one with ``Tokenizer.from_dir``. It keeps no per-call state (the Rust tokenizer and the
    compiled templates are only read), so one instance can serve every request.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        config: Mapping[str, Any] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        template_source: str = "<chat template>",
    ) -> None:
        """Wrap a loaded ``tokenizers.Tokenizer``; prefer ``from_dir``.

        ``config`` is the parsed tokenizer_config.json (special tokens are taken from it) and
        ``chat_templates`` maps template names to Jinja sources (``"default"`` is used, or
        ``"tool_use"`` when tools are passed and it exists). Templates compile here, once; a
        syntax error raises ``CheckpointError`` naming ``template_source``.
        """
        self._backend = backend
        self._special_tokens = _template_special_tokens(config or {})
        self._template_source = template_source
        self._template_texts = dict(chat_templates or {})
        self._templates: dict[str, jinja2.Template] = {}
        env = _jinja_environment()
        for name, source in self._template_texts.items():
            try:
                self._templates[name] = env.from_string(source)
            except jinja2.TemplateSyntaxError as exc:
                raise CheckpointError(
                    f"{template_source}: chat template {name!r} does not compile "
                    f"(line {exc.lineno}: {exc.message})"
                ) from exc
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(
            token_id for token_id, token in added.items() if token.special
        )
        self._added_ids = frozenset(added)
        # encode_chat protects every added token's text in client strings; whitespace-only
        # tokens carry no structure (and a template's trim would treat a placeholder for them
        # differently), so they are left alone. Longest first: the alternation then matches
        # leftmost-longest, like the tokenizers added-token matcher.
        protected = sorted(
            {token.content for token in added.values() if token.content.strip()},
            key=lambda text: (-len(text), text),
        )
        self._protected = tuple(protected)
        self._protected_index = {text: i for i, text in enumerate(protected)}
        self._protected_re = re.compile("|".join(map(re.escape, protected))) if protected else None
        self._protected_first = tuple(sorted({text[0] for text in protected}))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required), ``tokenizer_config.json`` and the chat template.

        Raises ``CheckpointError`` naming the file when tokenizer.json is missing, unreadable,
        truncated or not a tokenizer, or when the config or template is malformed. A missing
        chat template is allowed; ``apply_chat_template`` then raises.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: tokenizer directory not found")
        tokenizer_path = directory / TOKENIZER_FILE
        config_path = directory / TOKENIZER_CONFIG_FILE
        backend = _load_backend(tokenizer_path)
        config = _load_config(config_path)
        regex = config.get("pretokenize_regex")
        if isinstance(regex, str):
            _apply_pretokenize_regex(backend, regex, tokenizer_path, config_path)
        templates, template_path = _load_chat_templates(directory, config)
        return cls(
            backend, config=config, chat_templates=templates, template_source=str(template_path)
        )

    # ---- ids ---------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; adds no BOS/EOS. Added tokens written literally
        (``<|im_start|>``, ``<think>``) map to their single ids. Releases the GIL while the
        Rust tokenizer works (the binding's ``encode_batch`` does, its ``encode`` does not)."""
        return self._backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Bytes that are not valid UTF-8 become U+FFFD; unknown ids are
        skipped; ``skip_special_tokens`` drops the ids in ``special_token_ids``."""
        # The tokenizers binding defaults to skip_special_tokens=True; always pass it.
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (ids run 0..vocab_size-1)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry (byte-level form, e.g. ``"Ġthe"``) or added token."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary entry for ``token_id``, or ``None`` when out of range."""
        if token_id < 0:
            return None
        return self._backend.id_to_token(token_id)

    @functools.cached_property
    def _literal(self) -> tokenizers.Tokenizer:
        # A JSON round-trip of the whole tokenizer: made only when a prompt first holds
        # added-token text in client strings, not at every load.
        return _literal_backend(self._backend)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` of each text, in one call (without the GIL, in parallel)."""
        if not texts:
            return []
        return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token covers (the longest vocabulary
        entry, in bytes of its written form, which is never shorter than the text it stands
        for): a text of ``n`` bytes encodes to at least ``n / max_token_bytes`` tokens."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return max((len(piece.encode("utf-8")) for piece in vocab), default=1)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of added tokens flagged special (for Qwen: ``<|im_end|>``, not ``<think>``)."""
        return self._special_ids

    @property
    def special_tokens(self) -> Mapping[str, str]:
        """Named special tokens of tokenizer_config.json, as templates see them."""
        return dict(self._special_tokens)

    @property
    def eos_token_id(self) -> int | None:
        """Id of tokenizer_config.json's ``eos_token`` (Qwen: ``<|im_end|>``), if any."""
        eos = self._special_tokens.get("eos_token")
        return None if eos is None else self._backend.token_to_id(eos)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for batch encoding and offsets)."""
        return self._backend

    # ---- chat ----------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """Source of the default chat template, or ``None`` when the checkpoint has none."""
        return self._template_texts.get("default")

    def _select_template(self, tools: list | None) -> jinja2.Template:
        # Same choice as transformers' get_chat_template for a dict of templates.
        if not self._templates:
            raise CheckpointError(
                f"{self._template_source}: the checkpoint has no chat template "
                f"(neither {CHAT_TEMPLATE_FILE} nor a 'chat_template' field in "
                f"{TOKENIZER_CONFIG_FILE})"
            )
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        raise CheckpointError(
            f"{self._template_source}: several chat templates "
            f"({', '.join(sorted(self._templates))}) and none named 'default'"
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` into prompt text, identical to transformers'
        ``apply_chat_template(messages, tokenize=False, ...)``.

        ``tools`` are JSON-schema dicts; ``template_kwargs`` (e.g. ``enable_thinking=False``)
        become template variables and override the special tokens of the same name. Note the
        default ``add_generation_prompt=True`` (transformers defaults to False).

        Raises ``ValueError`` for an empty conversation, a non-dict tool, or when the template
        rejects the messages (its ``raise_exception`` message is kept), and ``CheckpointError``
        when the checkpoint has no chat template.
        """
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        if tools is not None:
            for tool in tools:
                if not isinstance(tool, Mapping):
                    raise ValueError(f"tools must be JSON-schema dicts, got {type(tool).__name__}")
        template = self._select_template(tools)
        variables: dict[str, Any] = {"documents": None, **self._special_tokens, **template_kwargs}
        variables["messages"] = messages
        variables["tools"] = tools
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return template.render(**variables)
        except (jinja2.TemplateError, TypeError) as exc:
            # raise_exception() in the template, or message fields of the wrong type (e.g. a
            # None role concatenated to a string): either way the request is at fault.
            raise ValueError(f"chat template rejected the conversation: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> ChatEncoding:
        """Render ``messages`` like ``apply_chat_template`` and encode the prompt so that client
        text cannot write control tokens.

        Client text is every string (dict keys included) of the messages whose role is not
        ``"assistant"`` (system, developer, user, tool: content, content parts, ``name``, ...;
        the ``role`` value itself excepted) and every string inside ``tools``. There, the text
        of any added token, special or not (``<|im_start|>``, ``<think>``, ``<tool_call>``), is
        encoded as ordinary text, as ``encode_special_tokens`` does. The template's own tokens
        keep their single ids, and so does everything in assistant messages (content,
        ``reasoning_content``, ``tool_calls``): the history tokenizes as it was generated.

        When the client text holds no added-token text (checked first, cheaply), ``text`` is
        ``apply_chat_template``'s and ``ids == encode(text)``. Otherwise each such occurrence
        is replaced, while the template renders, by a placeholder that cannot be forged (a
        random nonce per call) and then by its text again; the prompt is cut at the template's
        own added tokens (as the tokenizer itself cuts it) and each stretch holding client
        tokens is encoded with added tokens split. The result depends only on the
        conversation. ``text`` differs from ``apply_chat_template`` only where the template
        inspects such text (Qwen3.5: a user message wrapped in ``<tool_response>`` tags counts
        as a tool result there, as a user query here, as its tokens say); ``decode(ids)``
        gives ``text`` back (for NFC text). The inputs are not modified.

        Limits: ``template_kwargs`` are not client text; added tokens made only of whitespace
        are not protected; ``normalized`` added tokens are looked for in the raw client text;
        a token the template would complete from a client string's first or last characters
        is not caught. Raises like ``apply_chat_template``, and ``ValueError`` when the
        template transforms client text so that the placeholders are damaged.
        """
        # Both are walked several times: iterate a one-shot iterable only once.
        if not isinstance(messages, (list, tuple)):
            messages = list(messages)
        if tools is not None and not isinstance(tools, (list, tuple, Mapping)):
            tools = list(tools)
        if not any(map(self._has_protected, self._conversation_strings(messages, tools))):
            text = self.apply_chat_template(
                messages, add_generation_prompt, tools, **template_kwargs
            )
            encoding = self._backend.encode_batch([text], add_special_tokens=False)[0]
            return ChatEncoding(text, encoding.ids, tuple(end for _, end in encoding.offsets))
        nonce = _new_nonce()
        while any(nonce in text for text in self._conversation_strings(messages, tools)):
            nonce = _new_nonce()  # the client wrote this nonce: practically never
        placeholders = {
            token: f"{_MARK_OPEN}{nonce}{i}{_MARK_CLOSE}"
            for token, i in self._protected_index.items()
        }
        pattern = self._protected_re
        assert pattern is not None  # some client string matched it

        def mark(text: str) -> str:
            if not self._has_protected(text):
                return text
            return pattern.sub(lambda m: placeholders[m.group()], text)

        marked_messages = [
            _map_strings(m, mark, skip_role=True) if self._is_client(m) else m for m in messages
        ]
        marked_tools = None if tools is None else _map_strings(tools, mark)
        marked = self.apply_chat_template(
            marked_messages, add_generation_prompt, marked_tools, **template_kwargs
        )
        return self._encode_marked(marked, nonce)

    def _has_protected(self, text: str) -> bool:
        # The `in` scans (C speed, usually for "<" alone) skip the regex for most strings.
        return (
            self._protected_re is not None
            and any(first in text for first in self._protected_first)
            and self._protected_re.search(text) is not None
        )

    @staticmethod
    def _is_client(message: Any) -> bool:
        return not (isinstance(message, Mapping) and message.get("role") == _MODEL_ROLE)

    @classmethod
    def _conversation_strings(
        cls, messages: Sequence[Any], tools: list[Any] | None
    ) -> Iterable[str]:
        for message in messages:
            if cls._is_client(message):
                yield from _client_strings(message, skip_role=True)
        if tools is not None:
            yield from _client_strings(tools)

    def _encode_marked(self, marked: str, nonce: str) -> ChatEncoding:
        """Encode a prompt rendered with placeholders for client added-token text.

        The marked prompt is encoded normally to find the template's own added tokens (a
        placeholder contains no token text, so none is found in one). They cut the prompt
        into stretches, exactly where the tokenizer cuts the prompt itself. A stretch without
        placeholders keeps its ids from that encoding; a stretch with some is restored and
        encoded with added tokens split, all such stretches in one batch. Tokens never join
        across a cut (the tokenizer does not join them either), and the cuts and each
        stretch's text are fixed by the conversation, not by the nonce: deterministic.
        """
        # Placeholders: where they are in `marked`, and the restored text.
        starts: list[int] = []  # in `marked`
        ends: list[int] = []  # in `marked`
        shifts: list[int] = []  # restored = marked - shifts[k] after placeholder k
        parts: list[str] = []
        prev = shift = 0
        for m in _MARK_RE.finditer(marked):
            if m.group(1) != nonce:
                continue  # client text that merely looks like a placeholder
            token = self._protected[int(m.group(2))]
            parts += (marked[prev : m.start()], token)
            shift += (m.end() - m.start()) - len(token)
            starts.append(m.start())
            ends.append(m.end())
            shifts.append(shift)
            prev = m.end()
        parts.append(marked[prev:])
        text = "".join(parts)
        if nonce in text:
            raise ValueError(
                "the chat template altered client text containing added-token text, so it "
                "cannot be encoded safely"
            )

        def restored(pos: int) -> int:  # a position in `marked` outside any placeholder
            k = bisect_right(ends, pos)
            return pos - (shifts[k - 1] if k else 0)

        encoding = self._backend.encode_batch([marked], add_special_tokens=False)[0]
        marked_ids, offsets = encoding.ids, encoding.offsets
        added = self._added_ids
        # Chunks in order: (ids, ends) kept from `encoding`, or (None, start) for a stretch of
        # `text` starting at `start` to encode literally (its text is in `literal_texts`).
        chunks: list[tuple[list[int] | None, Any]] = []
        literal_texts: list[str] = []

        def stretch(lo_char: int, hi_char: int, lo_tok: int, hi_tok: int) -> None:
            if lo_char >= hi_char:
                return
            k = bisect_left(starts, lo_char)
            if k < len(starts) and starts[k] < hi_char:  # holds a placeholder
                begin = restored(lo_char)
                literal_texts.append(text[begin : restored(hi_char)])
                chunks.append((None, begin))
            else:
                delta = restored(lo_char) - lo_char
                chunks.append(
                    (marked_ids[lo_tok:hi_tok], [end + delta for _, end in offsets[lo_tok:hi_tok]])
                )

        lo_char = lo_tok = 0
        for i, token_id in enumerate(marked_ids):
            if token_id in added:
                start, end = offsets[i]
                stretch(lo_char, start, lo_tok, i)
                chunks.append(([token_id], [restored(end)]))
                lo_char, lo_tok = end, i + 1
        stretch(lo_char, len(marked), lo_tok, len(marked_ids))

        literal = iter(self._literal.encode_batch(literal_texts, add_special_tokens=False))
        ids: list[int] = []
        token_ends: list[int] = []
        for chunk_ids, info in chunks:
            if chunk_ids is None:
                piece = next(literal)
                ids += piece.ids
                token_ends += [end + info for _, end in piece.offsets]
            else:
                ids += chunk_ids
                token_ends += info
        return ChatEncoding(text, ids, tuple(token_ends))


# --------------------------------------------------------------------------------------------
# Streaming detokenization
# --------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turn generated token ids into text one token at a time, for streaming.

    Uses the prefix/read-offset scheme of vLLM and HF's TextStreamer: each step decodes only a
    short window (the tokens emitted last time, as context, plus the tokens not yet emitted)
    and emits what the new tokens added, unless that ends in U+FFFD, which means a multi-byte
    character is still incomplete; such tokens are held until a later token completes it.
    Decoding the previous tokens as context (rather than the new token alone) keeps decoders
    that change a token's text by position (leading-space stripping) correct.

    Guarantees: ``"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids,
    skip_special_tokens)``, and no piece carries a U+FFFD standing for part of a character
    that later tokens complete. Cost per push is proportional to the window, normally a few
    tokens; it only grows while consecutive tokens keep ending inside a character (each such
    token is held), which valid text does for at most a handful of tokens.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # _window holds the ids from the prefix offset on (older ids are dropped: bounded
        # memory); _window[:_read] were emitted last step and decode to _prefix_len chars.
        self._window: list[int] = []
        self._read = 0
        self._prefix_len = 0
        self._flushed = False

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often ``""`` while a character is
        incomplete, or several characters when held tokens complete)."""
        if self._flushed:
            raise RuntimeError("push() after flush(): the stream has ended")
        if token_id < 0:
            raise ValueError(f"token ids are non-negative, got {token_id}")
        self._window.append(int(token_id))
        text = self._decode(self._window)
        if len(text) <= self._prefix_len or text.endswith(_REPLACEMENT_CHAR):
            # Nothing new yet (e.g. a skipped special token), or the new bytes end inside a
            # character. A legitimate trailing U+FFFD only waits one token, or until flush().
            return ""
        new_text = text[self._prefix_len :]
        # Slide: the tokens just emitted become the next step's context.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_len = len(self._decode(self._window))
        return new_text

    def flush(self) -> str:
        """End the stream and return the text still held back (possibly containing U+FFFD for
        bytes that never formed a character). Later calls return ``""``."""
        if self._flushed:
            return ""
        self._flushed = True
        return self._decode(self._window)[self._prefix_len :]


def byte_level_alphabet() -> dict[int, str]:
    """Byte -> the character that stands for it in byte-level BPE vocabularies (GPT-2's map):
    printable Latin-1 bytes stand for themselves, the rest are shifted to code points from 256
    up, in byte order."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
