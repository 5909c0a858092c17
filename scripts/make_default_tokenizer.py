"""Build a small Qwen3.5-style tokenizer directory from text every machine already has.

The real Qwen3.5 tokenizer (248k tokens) cannot be downloaded in CI or on air-gapped machines, yet
tests and offline runs need a tokenizer with the same *shape*: byte-level BPE with Qwen's
pre-tokenizer, the ChatML/think/tool added tokens, a ``tokenizer_config.json`` that transformers
loads, and the real Qwen3.5 chat template. This script trains such a tokenizer on the Python
standard library's own source files (plus a short built-in multilingual sample, so that merges
which split multi-byte characters exist and streaming detokenization gets exercised), and writes
``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` into a directory.

The chat template is copied from ``src/headstart/models/qwen35/chat_template.jinja``, which holds
the Qwen3.5-9B template verbatim (its provenance is in ``headstart.tokenizer``'s docstring).

Usage: ``python scripts/make_default_tokenizer.py OUT_DIR [--vocab-size N] [--max-chars N]``.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

# Qwen3.5's split regex (Qwen2's, with combining marks \p{M} kept inside words). Keeping the same
# pre-tokenization as the real model means prompts split into pieces the same way.
QWEN35_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Added tokens in id order, right after the learned vocabulary. The flags follow Qwen3's
# tokenizer_config.json: the ChatML control tokens are special (dropped by
# skip_special_tokens), while think/tool markers are plain added tokens (special=False), so a
# decoded answer keeps "<think>" / "<tool_call>" text for the reasoning and tool parsers.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
)

DEFAULT_VOCAB_SIZE = 4096
# About 4 MB of source trains in well under 30 s on two cores and yields a few thousand merges.
DEFAULT_MAX_CHARS = 4_000_000

TEMPLATE_PATH = (
    Path(__file__).resolve().parent.parent
    / "src"
    / "headstart"
    / "models"
    / "qwen35"
    / "chat_template.jinja"
)

# A few sentences in scripts whose characters are 2, 3 and 4 UTF-8 bytes long. Repeated so BPE
# learns merges inside (and across) multi-byte characters, which is what makes characters span
# several tokens in unexpected ways.
_MULTILINGUAL_SAMPLE = (
    "Café, naïve façade, crème brûlée, Ångström, Øresund, Dvořák, Łódź, São Paulo.\n"
    "Съешь же ещё этих мягких французских булок, да выпей чаю.\n"
    "Γειά σου κόσμε, καλημέρα.\n"
    "你好，世界。今天天气很好，我们去公园散步吧。机器学习和自然语言处理。\n"
    "こんにちは、世界。東京は今日も晴れです。カタカナとひらがな。\n"
    "안녕하세요, 세계. 오늘은 날씨가 좋습니다.\n"
    "مرحبا بالعالم. שלום עולם. नमस्ते दुनिया।\n"
    "Emoji: 😀😃😄😁 🚀🔥✨ 👍🏽 🇫🇷 🧑‍💻 — “quotes” ‘single’ … ±×÷ €£¥ ∑∫√∞\n"
)


def _stdlib_files() -> list[Path]:
    """Every ``*.py`` file of the standard library, in a fixed (sorted) order.

    Third-party packages installed into the interpreter's own site-packages are skipped: they
    differ between machines, and the point is text that is the same wherever this Python is.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def training_texts(max_chars: int) -> Iterator[str]:
    """Yield the multilingual sample, then stdlib sources; ``max_chars`` characters in all."""
    budget = max_chars
    sample = _MULTILINGUAL_SAMPLE * 20
    yield sample
    budget -= len(sample)
    for path in _stdlib_files():
        if budget <= 0:
            return
        try:
            # A few test files are deliberately not UTF-8; replacing bad bytes keeps the order
            # (and so the result) stable instead of skipping them.
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        text = text[:budget]
        budget -= len(text)
        yield text


def _new_backend() -> HFTokenizer:
    """An untrained tokenizer with Qwen3.5's normalizer, pre-tokenizer and decoder."""
    backend = HFTokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False, dropout=None))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated"),
            # The regex above already split the text; ByteLevel only maps bytes to symbols.
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def _tokenizer_config(first_added_id: int) -> dict:
    """tokenizer_config.json contents, shaped like Qwen3's (the template lives in its own file)."""
    added_tokens_decoder = {
        str(first_added_id + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(ADDED_TOKENS)
    }
    config: dict = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": [c for c, special in ADDED_TOKENS if special],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        # Qwen3.5 checkpoints declare their split regex here too; headstart.tokenizer applies it.
        "pretokenize_regex": QWEN35_PRETOKENIZE_REGEX,
        "split_special_tokens": False,
        # What transformers 5.x loads for Qwen3.5 checkpoints (their model_type overrides the
        # Hub's "Qwen2Tokenizer"). Both Qwen classes rebuild the pre-tokenizer in code instead of
        # reading tokenizer.json's; Qwen2Tokenizer's regex lacks \p{M} and would tokenize text
        # with combining marks differently from our tokenizer.json, Qwen3_5Tokenizer's matches.
        "tokenizer_class": "Qwen3_5Tokenizer",
        "unk_token": None,
    }
    return config


def build_tokenizer(
    out_dir: Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> None:
    """Train a byte-level BPE tokenizer and write a loadable tokenizer directory to ``out_dir``.

    ``vocab_size`` is the size of the learned vocabulary (256 byte symbols plus merges); the
    nine added tokens of ``ADDED_TOKENS`` follow it, so ``<|endoftext|>`` gets id ``vocab_size``.
    ``max_chars`` caps the training text. The output is deterministic for a given Python
    version (its standard library is the corpus).
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must exceed the 256 byte symbols, got {vocab_size}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    backend = _new_backend()
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    backend.train_from_iterator(training_texts(max_chars), trainer=trainer)

    # Added tokens go after the learned vocabulary (as in Qwen, where they start at 248044);
    # added one by one so their ids follow ADDED_TOKENS' order.
    first_added_id = backend.get_vocab_size(with_added_tokens=False)
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, special=special, normalized=False)
        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
    for i, (content, _) in enumerate(ADDED_TOKENS):
        assert backend.token_to_id(content) == first_added_id + i, content

    backend.save(str(out_dir / "tokenizer.json"))
    template = TEMPLATE_PATH.read_text(encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    config = _tokenizer_config(first_added_id)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS)
    args = parser.parse_args(argv)
    build_tokenizer(args.out_dir, vocab_size=args.vocab_size, max_chars=args.max_chars)
    print(f"wrote {args.out_dir}/tokenizer.json, tokenizer_config.json, chat_template.jinja")


if __name__ == "__main__":
    main()
