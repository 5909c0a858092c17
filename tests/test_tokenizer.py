"""Tests for headstart.tokenizer: loading, chat-template parity with transformers, encode parity,
streaming detokenization, and checkpoint-file errors.

Everything runs on a small tokenizer trained locally by scripts/make_default_tokenizer.py (no
downloads). transformers is a test-only dependency: it is the reference the rendering and the
ids must match.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import string
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headstart.errors import CheckpointError
from headstart.models.qwen35 import CHAT_TEMPLATE_PATH as QWEN35_CHAT_TEMPLATE_PATH
from headstart.tokenizer import IncrementalDetokenizer, Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 1024
MAX_CHARS = 300_000  # keeps training well under a second
QWEN2_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _load_build_script() -> Any:
    path = REPO_ROOT / "scripts" / "make_default_tokenizer.py"
    spec = importlib.util.spec_from_file_location("make_default_tokenizer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD = _load_build_script()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    BUILD.build_tokenizer(out, vocab_size=VOCAB_SIZE, max_chars=MAX_CHARS)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf_tok(tok_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


def _copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------------------------------
# Conversations
# ------------------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Weather for a city; returns "°C" & <b>wind</b>',
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "tags": {"type": "array"}},
        },
    },
}

CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "single_user": ([{"role": "user", "content": "Hi"}], None),
    "system": (
        [
            {"role": "system", "content": "  You are terse.  "},
            {"role": "user", "content": "What is 2+2?"},
        ],
        None,
    ),
    "multi_turn_think_stripped": (
        [
            {"role": "system", "content": "Be helpful."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello!"},
            {"role": "user", "content": "Tell me a joke"},
            {"role": "assistant", "content": "<think>\nA pun.\n</think>\n\nWhy did the chicken…"},
            {"role": "user", "content": "Another, in 中文 please 😀"},
        ],
        None,
    ),
    "reasoning_content_after_query": (
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "  plan A \n"},
        ],
        None,
    ),
    "content_parts": (
        [
            {"role": "user", "content": [{"type": "text", "text": "part one, "}, {"text": "two"}]},
        ],
        None,
    ),
    "tools_declared": (
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather?"}],
        [WEATHER_TOOL, SEARCH_TOOL],
    ),
    "tool_loop": (
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "role": "assistant",
                "content": "Checking both.",
                "reasoning_content": "two cities",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Paris", "days": 2},
                        },
                    },
                    {
                        "type": "function",
                        "function": {
                            "name": "search",
                            "arguments": {"query": "Rome", "tags": ["a", "b c"], "opts": {"k": 1}},
                        },
                    },
                ],
            },
            {"role": "tool", "content": "18C sunny"},
            {"role": "tool", "content": '{"hits": 3}'},
        ],
        [WEATHER_TOOL, SEARCH_TOOL],
    ),
    "finished_tool_loop": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": "18C"},
            {"role": "assistant", "content": "<think>\nok\n</think>\n\nIt is 18C."},
            {"role": "user", "content": "Thanks"},
        ],
        [WEATHER_TOOL],
    ),
}

THINKING_MODES: dict[str, dict[str, Any]] = {
    "unset": {},
    "on": {"enable_thinking": True},
    "off": {"enable_thinking": False},
}


# ------------------------------------------------------------------------------------------
# Loading and basic properties
# ------------------------------------------------------------------------------------------


def test_build_writes_real_template_and_added_tokens(tok_dir: Path, tok: Tokenizer) -> None:
    template = QWEN35_CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    assert (tok_dir / "chat_template.jinja").read_text(encoding="utf-8") == template
    assert tok.chat_template == template
    config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None
    # Added tokens follow the learned vocabulary, in the documented order.
    names = [content for content, _ in BUILD.ADDED_TOKENS]
    assert [tok.token_to_id(name) for name in names] == list(range(VOCAB_SIZE, VOCAB_SIZE + 9))
    assert tok.vocab_size == VOCAB_SIZE + len(names)
    decoder = config["added_tokens_decoder"]
    assert {int(i): (d["content"], d["special"]) for i, d in decoder.items()} == {
        VOCAB_SIZE + i: entry for i, entry in enumerate(BUILD.ADDED_TOKENS)
    }


def test_build_is_deterministic(tmp_path: Path, tok_dir: Path) -> None:
    BUILD.build_tokenizer(tmp_path, vocab_size=VOCAB_SIZE, max_chars=MAX_CHARS)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).read_bytes() == (tok_dir / name).read_bytes(), name


def test_special_tokens_and_ids(tok: Tokenizer) -> None:
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    eot, think = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<think>")
    assert tok.special_token_ids == {eot, im_start, im_end}
    assert think not in tok.special_token_ids  # Qwen keeps think/tool markers non-special
    assert tok.eos_token_id == im_end
    assert tok.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert tok.id_to_token(im_start) == "<|im_start|>"
    assert tok.id_to_token(-1) is None
    assert tok.id_to_token(tok.vocab_size) is None
    assert tok.token_to_id("definitely not a token") is None

    ids = tok.encode("<|im_start|>user\nhi<think>x</think><|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end and think in ids
    assert tok.decode(ids) == "<|im_start|>user\nhi<think>x</think><|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi<think>x</think>"
    # No BOS/EOS is added to plain text.
    assert tok.decode(tok.encode("plain text")) == "plain text"


# ------------------------------------------------------------------------------------------
# Chat template parity with transformers
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen", "nogen"])
@pytest.mark.parametrize("mode", list(THINKING_MODES))
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, name: str, mode: str, add_generation_prompt: bool
) -> None:
    messages, tools = CONVERSATIONS[name]
    kwargs = THINKING_MODES[mode]
    ours = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
    )
    theirs = hf_tok.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    assert ours == theirs
    # The ids of the rendered prompt match transformers' tokenization of the same text.
    assert tok.encode(ours) == hf_tok(ours, add_special_tokens=False)["input_ids"]


def test_generation_prompt_matches_architecture_doc(tok: Tokenizer) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    head = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(hi, enable_thinking=False) == head + "<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(hi, enable_thinking=True) == head + "<think>\n"
    assert tok.apply_chat_template(hi) == head + "<think>\n"  # 9B template: thinking by default
    assert (
        tok.apply_chat_template(hi, add_generation_prompt=False)
        == "<|im_start|>user\nHi<|im_end|>\n"
    )
    think, end_think = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    blank = tok.encode("\n\n")
    assert tok.encode("<think>\n\n</think>\n\n") == [think, *blank, end_think, *blank]


def test_history_think_is_stripped(tok: Tokenizer) -> None:
    messages, _ = CONVERSATIONS["multi_turn_think_stripped"]
    text = tok.apply_chat_template(messages, enable_thinking=True)
    assert "The user greets me" not in text and "A pun" not in text
    assert "<|im_start|>assistant\nHello!<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_template_errors_become_value_errors(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="No user query found"):
        tok.apply_chat_template([{"role": "system", "content": "only a system prompt"}])
    with pytest.raises(ValueError, match="System message must be at the beginning"):
        tok.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
        )
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="JSON-schema dicts"):
        tok.apply_chat_template([{"role": "user", "content": "a"}], tools=[print])  # type: ignore[list-item]


ENV_PROBE_TEMPLATE = (
    "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ custom_flag }}\n"
    "{% for m in messages %}"
    "{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "{% generation %}{{ m.role }}={{ m.content | tojson }}{% endgeneration %}\n"
    "{% endfor %}"
    "{{ tools | tojson(indent=2) }}\n"
    "{{ {'b': '<&>', 'a': 'é'} | tojson(sort_keys=true, separators=(',', ':')) }}\n"
    "{{ strftime_now('%%') }}{{ documents is none }}{{ add_generation_prompt }}\n"
    "    {% if true %}\n  indented block (lstrip/trim)\n    {% endif %}\n"
)


def test_jinja_environment_matches_transformers(tok_dir: Path, hf_tok: Any) -> None:
    """Filters, globals, extensions and whitespace options behave as in transformers."""
    base = Tokenizer.from_dir(tok_dir)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    probe = Tokenizer(base.backend, config=config, chat_templates={"default": ENV_PROBE_TEMPLATE})
    messages = [
        {"role": "user", "content": 'say "hi" <b>&</b> ünïcödé'},
        {"role": "skip", "content": "ignored"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "after break"},
    ]
    for add_generation_prompt in (True, False):
        ours = probe.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=[WEATHER_TOOL],
            custom_flag=7,
        )
        theirs = hf_tok.apply_chat_template(
            messages,
            tools=[WEATHER_TOOL],
            chat_template=ENV_PROBE_TEMPLATE,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            custom_flag=7,
        )
        assert ours == theirs
    assert "ünïcödé" in ours and "<&>" in ours  # tojson neither escapes HTML nor non-ASCII


def _write_dir(path: Path, src: Path, config_updates: dict[str, Any], jinja: str | None) -> Path:
    path.mkdir()
    shutil.copy(src / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update(config_updates)
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return path


def test_template_sources_and_precedence(tmp_path: Path, tok_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    msgs = [{"role": "user", "content": "x"}]

    # chat_template.jinja wins over the config's chat_template, as in transformers.
    both = _write_dir(
        tmp_path / "both", tok_dir, {"chat_template": "CONFIG"}, "FILE{{ messages|length }}"
    )
    assert Tokenizer.from_dir(both).apply_chat_template(msgs) == "FILE1"

    # A list of named templates: "default", or "tool_use" when tools are given.
    named = [
        {"name": "default", "template": "D{{ add_generation_prompt }}"},
        {"name": "tool_use", "template": "T{{ tools|length }}"},
    ]
    listed = _write_dir(tmp_path / "listed", tok_dir, {"chat_template": named}, None)
    ours = Tokenizer.from_dir(listed)
    theirs = transformers.AutoTokenizer.from_pretrained(str(listed))
    assert ours.apply_chat_template(msgs) == "DTrue"
    assert ours.apply_chat_template(msgs, tools=[WEATHER_TOOL]) == "T1"
    assert ours.apply_chat_template(msgs, tools=[WEATHER_TOOL]) == theirs.apply_chat_template(
        msgs, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )

    # No template at all: loading works, rendering names the problem.
    bare = _write_dir(tmp_path / "bare", tok_dir, {}, None)
    bare_tok = Tokenizer.from_dir(bare)
    assert bare_tok.chat_template is None
    assert bare_tok.encode("ok") == ours.encode("ok")
    with pytest.raises(CheckpointError, match="no chat template"):
        bare_tok.apply_chat_template(msgs)


def test_pretokenize_regex_from_config_matches_transformers(tmp_path: Path, tok_dir: Path) -> None:
    """Like Qwen3.5 checkpoints: tokenizer.json splits on \\p{L}+ but the config declares the
    [\\p{L}\\p{M}]+ regex that transformers' Qwen3_5Tokenizer uses; we must follow the config."""
    transformers = pytest.importorskip("transformers")
    qwen_like = _copy_dir(tok_dir, tmp_path / "qwen_like")
    raw = json.loads((qwen_like / "tokenizer.json").read_text(encoding="utf-8"))
    split = raw["pre_tokenizer"]["pretokenizers"][0]
    assert split["type"] == "Split"
    split["pattern"]["Regex"] = QWEN2_REGEX
    (qwen_like / "tokenizer.json").write_text(json.dumps(raw), encoding="utf-8")

    ours = Tokenizer.from_dir(qwen_like)
    theirs = transformers.AutoTokenizer.from_pretrained(str(qwen_like))
    assert type(theirs).__name__ == "Qwen3_5Tokenizer"
    import tokenizers

    plain = tokenizers.Tokenizer.from_file(str(qwen_like / "tokenizer.json"))
    texts = ["नमस्ते दुनिया", "สวัสดีครับ", "cafe\u0301 de\u0301ja\u0300 vu", "ok <|im_end|>"]
    differs = False
    for text in texts:
        expected = theirs(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == expected, text
        differs |= plain.encode(text, add_special_tokens=False).ids != expected
    assert differs, "the raw tokenizer.json should split these texts differently"


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!  Multiple   spaces\tand\ttabs\n\n\nnewlines\r\n",
        "def f(x):\n    return x ** 2  # comment\n",
        "Numbers 1234567 and 3.14159, 'quotes' we're they'll I'd",
        "中文字符和日本語のテキスト、한국어도 😀🚀👍🏽 🇫🇷 🧑‍💻",
        "Ångström naïve e\u0301 नमस्ते สวัสดี مرحبا שלום",
        "<|im_start|>system\nliteral specials <think></think><tool_call></tool_call><|im_end|>",
        "<|im_start|><|im_start|>nested<|endoftext|>",
    ],
)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(tok.encode(text)) == hf_tok.decode(
        hf_tok(text, add_special_tokens=False)["input_ids"]
    )


# ------------------------------------------------------------------------------------------
# Incremental detokenization
# ------------------------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    return [detok.push(i) for i in ids] + [detok.flush()]


def _check_stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool) -> None:
    pieces = _stream(tok, ids, skip_special_tokens)
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(pieces) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in piece for piece in pieces), pieces


# Text built from pieces (not single code points) so that multi-code-point emoji and literal
# added tokens appear whole.
MULTIBYTE_TEXT = st.lists(
    st.one_of(
        st.sampled_from(list(string.ascii_letters + string.digits + " \n\t.,;!?'\"")),
        st.sampled_from(list("éèçàüößñøåłžčÅÉ你好世界中文字日本語のテキスト한국어")),
        st.sampled_from(["😀", "🚀", "👍🏽", "🇫🇷", "🧑\u200d💻", "∑", "€", "\u0301", "\ufffd"]),
        st.sampled_from(["<think>", "</think>", "<|im_end|>", "<|im_start|>", "<tool_call>"]),
        st.characters(min_codepoint=0x80, max_codepoint=0x10FFFF, exclude_categories=("Cs",)),
    ),
    max_size=60,
).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=MULTIBYTE_TEXT, skip=st.booleans())
def test_stream_of_encoded_text_equals_decode(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = tok.encode(text)
    _check_stream(tok, ids, skip)
    # Byte-level BPE round-trips any text, up to the NFC normalizer.
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans())
def test_stream_of_random_ids_equals_decode(
    tok: Tokenizer, data: st.DataObject, skip: bool
) -> None:
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=80))
    _check_stream(tok, ids, skip)


def _byte_token_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte, via the byte-level alphabet (GPT-2's bytes_to_unicode)."""
    from headstart.tokenizer import byte_level_alphabet

    table = byte_level_alphabet()
    ids = [tok.token_to_id(table[b]) for b in text.encode("utf-8")]
    assert all(i is not None for i in ids)
    return ids  # type: ignore[return-value]


def test_multibyte_character_is_held_until_complete(tok: Tokenizer) -> None:
    ids = _byte_token_ids(tok, "a😀b中")
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert pieces == ["a", "", "", "", "😀", "b", "", "", "中"]
    assert detok.flush() == ""

    # An incomplete character at the end of the stream comes out of flush(), as decode has it.
    ids = _byte_token_ids(tok, "x😀")[:-1]
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(i) for i in ids] == ["x", "", "", ""]
    assert detok.flush() == tok.decode(ids)[1:] == "\ufffd"
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.push(ids[0])


def test_learned_tokens_split_characters(tok: Tokenizer) -> None:
    """The trained vocabulary has tokens that end inside a character; streaming stays exact."""
    text = BUILD._MULTILINGUAL_SAMPLE
    ids = tok.encode(text)
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert partial, "expected some tokens holding only part of a multi-byte character"
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_special_tokens_in_stream(tok: Tokenizer) -> None:
    ids = tok.encode("<think>\nhmm\n</think>\n\nAnswer: 42<|im_end|>")
    assert "".join(_stream(tok, ids)) == "<think>\nhmm\n</think>\n\nAnswer: 42<|im_end|>"
    assert (
        "".join(_stream(tok, ids, skip_special_tokens=True))
        == "<think>\nhmm\n</think>\n\nAnswer: 42"
    )


def test_stream_cost_is_bounded(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each push decodes a short window, not the whole sequence so far."""
    text = (BUILD._MULTILINGUAL_SAMPLE + "plain ascii text, more of it. ") * 20
    ids = tok.encode(text)
    assert len(ids) > 2000
    sizes: list[int] = []
    original: Callable[..., str] = Tokenizer.decode

    def recording_decode(self: Tokenizer, ids: Any, skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        sizes.append(len(ids))
        return original(self, ids, skip_special_tokens)

    monkeypatch.setattr(Tokenizer, "decode", recording_decode)
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push(i) for i in ids) + detok.flush()
    monkeypatch.undo()
    assert out == tok.decode(ids)
    assert max(sizes) <= 16, max(sizes)


# ------------------------------------------------------------------------------------------
# Broken checkpoint files
# ------------------------------------------------------------------------------------------


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_missing_tokenizer_json(tmp_path: Path, tok_dir: Path) -> None:
    shutil.copy(tok_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json.*not found"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.5, 0.99])
def test_truncated_tokenizer_json(tmp_path: Path, tok_dir: Path, fraction: float) -> None:
    data = (tok_dir / "tokenizer.json").read_bytes()
    (tmp_path / "tokenizer.json").write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(CheckpointError, match=r"tokenizer\.json.*truncated or corrupt"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    "payload, problem",
    [
        (b'{"version": "1.0", "model": {"type": "Nope"}}', "not a usable tokenizer"),
        (b"[1, 2, 3]", "not a usable tokenizer"),
        (b"\xff\xfe\x00garbage", "not UTF-8"),
    ],
)
def test_corrupt_tokenizer_json(tmp_path: Path, payload: bytes, problem: str) -> None:
    (tmp_path / "tokenizer.json").write_bytes(payload)
    with pytest.raises(CheckpointError, match=problem) as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)


def test_corrupt_config_and_template(tmp_path: Path, tok_dir: Path) -> None:
    broken_config = _copy_dir(tok_dir, tmp_path / "config")
    (broken_config / "tokenizer_config.json").write_text('{"eos_token": "<|im_e', encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json.*truncated or corrupt"):
        Tokenizer.from_dir(broken_config)

    broken_template = _copy_dir(tok_dir, tmp_path / "template")
    (broken_template / "chat_template.jinja").write_text(
        "{% if messages %}unclosed", encoding="utf-8"
    )
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja.*does not compile"):
        Tokenizer.from_dir(broken_template)

    bad_field = _write_dir(tmp_path / "field", tok_dir, {"chat_template": 42}, None)
    with pytest.raises(CheckpointError, match="chat_template"):
        Tokenizer.from_dir(bad_field)
