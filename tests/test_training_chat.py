"""The supervised chat pass (training/chat.py): conversations from source files, rendered with
the model's own template (thinking off) with the loss on the answer alone, ending the turn; a
short pass that teaches a tiny model to answer and stop; the code-ness evaluation."""

from __future__ import annotations

import textwrap

import pytest
import torch

from headstart.loading import default_model_dir, load, serving_defaults
from headstart.tokenizer import Tokenizer
from training.chat import (
    END_OF_TURN,
    Example,
    answer_text,
    chat_rows,
    encode_example,
    extract_code,
    function_examples,
    masked_loss,
    parses,
    prompt_encoding,
    request_from,
    train_chat,
)

SOURCE = textwrap.dedent(
    '''
    import functools


    def add(a, b):
        """Return the sum of a and b.

        Longer text that is not part of the request.
        """

        return a + b


    # Check whether the value is even.
    def is_even(n):
        return n % 2 == 0


    def only_doc():
        """Do nothing at all, really."""


    def doctested(x):
        """>>> doctested(1)"""
        return x


    class Box:
        @functools.cache
        def size(self):
            """Compute the number of items in the box."""
            total = 0
            for item in self.items:
                total += 1
            return total


    def outer():
        """Build a closure over a counter."""
        def inner():
            """Increment the counter."""
            return 1
        return inner
    '''
)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(default_model_dir())


def test_function_examples_take_the_docstring_or_comment_and_drop_the_docstring():
    got = {e.origin.split(":")[1]: e for e in function_examples(SOURCE, "x.py")}
    # No body besides the docstring, a doctest as the docstring, nested: left out.
    assert set(got) == {"add", "is_even", "size", "outer"}
    assert got["add"].code == "def add(a, b):\n    return a + b"
    assert got["is_even"].code.startswith("def is_even(n):")
    assert got["is_even"].request.endswith("that checks whether the value is even.")
    assert got["add"].request.endswith("that returns the sum of a and b.")
    size = got["size"].code
    assert size.startswith("@functools.cache\ndef size(self):\n    total = 0")  # dedented
    assert '"""' not in size and '"""Increment' in got["outer"].code  # only its own docstring
    for e in got.values():
        compile(e.code, "<answer>", "exec")


@pytest.mark.parametrize(
    ("sentence", "name", "want"),
    [
        ("Return the sum of a and b.", "a", "that returns the sum of a and b."),
        ("Returns the sum.", "a", "that returns the sum."),
        ("Copy the file.", "a", "that copies the file."),
        ("Push the item.", "a", "that pushes the item."),
        ("The helper for the parser.", "a", ": The helper for the parser."),
    ],
)
def test_requests_read_as_a_user_would_ask(sentence, name, want):
    assert want in request_from(sentence, name)


def test_encoded_conversation_is_the_serving_prompt_then_answer_and_end_of_turn(tokenizer):
    ex = Example("Write a function that adds two numbers.", "def add(a, b):\n    return a + b", "x")
    ids, mask = encode_example(tokenizer, ex)
    prompt = prompt_encoding(tokenizer, ex.request)
    n = len(prompt.ids)
    assert ids[:n] == list(prompt.ids) and not any(mask[:n]) and all(mask[n:])
    # Thinking off, as headstart.json makes serve render it: the think block comes closed.
    assert prompt.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.decode(ids[n:]) == answer_text(ex.code) + END_OF_TURN
    assert ids[-1] == tokenizer.token_to_id(END_OF_TURN)
    # With thinking on the template renders the history differently from the generation
    # prompt: training on it would teach a layout serving never shows, so it is refused.
    with pytest.raises(ValueError, match="differently"):
        encode_example(tokenizer, ex, {"enable_thinking": True})


def test_chat_rows_leave_out_long_conversations_and_pad_outside_the_loss(tokenizer):
    short = Example("Write a function that returns one.", "def one():\n    return 1", "a")
    long = Example("Write a function that returns many.", "def f():\n" + "    x = 1\n" * 60, "b")
    pad = tokenizer.token_to_id("<|endoftext|>")
    rows = chat_rows(tokenizer, [short, long], 96, pad)
    ids, mask = encode_example(tokenizer, short)
    assert rows["input_ids"].shape == (1, 96)
    assert rows["input_ids"][0, : len(ids)].tolist() == ids
    assert (rows["input_ids"][0, len(ids) :] == pad).all()
    assert rows["loss_mask"][0].tolist() == mask + [False] * (96 - len(ids))
    with pytest.raises(ValueError):
        chat_rows(tokenizer, [long], 96, pad)


def test_masked_loss_is_the_mean_over_masked_targets_only():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=gen)
    ids = torch.randint(0, 11, (2, 6), generator=gen)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 3:] = True
    mask[1, 5] = True
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none"
    )
    want = ce[mask[:, 1:]].mean()
    assert torch.allclose(masked_loss(logits, ids, mask), want)
    other = logits.clone()
    other[0, 0] += 5.0  # predicts ids[0, 1], which is not in the loss
    assert torch.allclose(masked_loss(other, ids, mask), want)


def _tiny_target(vocab: int, eos: list[int]):
    from transformers import Qwen3_5ForCausalLM

    from training.target import target_config

    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(target_config(vocab, eos, layers=4, hidden=64))


def test_a_short_pass_teaches_answers_that_end_the_turn(tokenizer, tmp_path):
    """A tiny model trained on two conversations, exported like the default model: served
    through the engine with the folder's defaults (thinking off), it answers each request with
    its function, in a fence that parses, and ends its turn."""
    from training.chat import evaluate_code
    from training.export import export_default

    examples = [
        Example("Write a function that adds two numbers.", "def add(a, b):\n    return a + b", "a"),
        Example(
            "Write a function that returns the list reversed.",
            "def rev(x):\n    return x[::-1]",
            "b",
        ),
    ]
    eos = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    model = _tiny_target(4160, eos)
    rows = chat_rows(tokenizer, examples, 64, eos[1])
    corpus = torch.randint(5, 4000, (8, 64), generator=torch.Generator().manual_seed(1))
    report = train_chat(
        model,
        rows,
        time_budget_s=120,
        steps=60,
        batch=4,
        lr=3e-3,
        corpus=corpus,
        corpus_rows=1,
        log=lambda *_: None,
    )
    losses = [loss for _, loss in report["loss_history"]]
    assert report["steps"] == 60 and sum(losses[-5:]) < 0.5 * sum(losses[:5])
    out = export_default(model.float(), default_model_dir(), tmp_path / "m", eos, bits=4, group=64)
    assert serving_defaults(out)["chat_template_kwargs"] == {"enable_thinking": False}
    assert load(str(out)).template_defaults == {"enable_thinking": False}
    result = evaluate_code(out, "cpu", max_tokens=48, prompts=[e.request for e in examples])
    assert result["parsed"] == 2 and result["ended"] == 2 and result["empty_content"] == 0
    for ex, answer in zip(examples, result["answers"], strict=True):
        assert answer["content"] == answer_text(ex.code) and answer["reasoning"] is None


def test_extract_code_and_parses():
    assert extract_code("Here:\n```python\nx = 1\n```\nDone.") == "x = 1\n"
    assert extract_code("```\ndef f():\n    return 1\n") == "def f():\n    return 1\n"  # cut off
    assert parses(extract_code("```python\ndef f():\n    return 1\n```"))
    assert not parses(extract_code("```python\ndef f(:\n```"))
    assert parses(extract_code("y = 2"))
    assert not parses("This writes a function that adds.")
    assert not parses("")


def test_the_shipped_default_model_states_thinking_off():
    assert serving_defaults(default_model_dir())["chat_template_kwargs"] == {
        "enable_thinking": False
    }
