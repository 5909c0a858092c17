"""Where the next turn of a conversation diverges, found from the chat template (any template).

Each template renders a conversation; the next turn appends the model's answer and a new user
message. The point ``divergence`` finds must be a prefix of both this prompt and the next
turn's, and the longest such point before the answer (the answer itself is the model's)."""

from __future__ import annotations

import pytest

from headstart.loading import default_model_dir
from headstart.server.turns import divergence
from headstart.tokenizer import Tokenizer

CHATML_THINKING = """{%- for m in messages -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
<think>
{% endif -%}"""

LLAMA3 = (
    "{{- bos_token }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim"
    " + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

GEMMA = """{%- for m in messages -%}
{%- set role = 'model' if m.role == 'assistant' else m.role -%}
<start_of_turn>{{ role }}
{{ m.content | trim }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt %}<start_of_turn>model
{% endif -%}"""

# Gemma's shape, and a reasoning block opened in the generation prompt that history drops: the
# next turn parts from this prompt inside it, so only the point serves the next turn.
GEMMA_THINKING = GEMMA.replace(
    "<start_of_turn>model\n{% endif", "<start_of_turn>model\n<think>\n{% endif"
)


def tokenizer(template: str | None) -> Tokenizer:
    base = Tokenizer.from_dir(default_model_dir())
    if template is None:
        return base
    return Tokenizer(base.backend, chat_templates={"default": template})


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Reverse a list?"},
]
ANSWER = "xs[::-1]"


@pytest.mark.parametrize(
    "template,cut",
    [
        (None, "<|im_start|>assistant\n"),  # the shipped Qwen3.5 template
        (CHATML_THINKING, "<|im_start|>assistant\n"),  # <think> only in the generation prompt
        (LLAMA3, "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        (GEMMA, "<start_of_turn>model\n"),
        (GEMMA_THINKING, "<start_of_turn>model\n"),
    ],
)
@pytest.mark.parametrize("thinking", [True, False])
def test_the_next_turn_renders_this_prompt_up_to_the_point(template, cut, thinking):
    tok = tokenizer(template)
    kwargs = {"enable_thinking": thinking}
    prompt = tok.apply_chat_template(CONVERSATION, **kwargs)
    at = divergence(tok.apply_chat_template, CONVERSATION, prompt, **kwargs)
    following = [
        *CONVERSATION,
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "And a string?"},
    ]
    nxt = tok.apply_chat_template(following, **kwargs)
    assert at is not None and prompt[:at] == nxt[:at]
    # The longest such point before the answer: right after the template's own header.
    assert prompt[:at].endswith(cut) and at == prompt.rfind(cut) + len(cut)
    assert nxt[at:].startswith(ANSWER) or ANSWER in nxt[at:]


def test_a_template_that_refuses_an_answer_gives_no_point():
    refusing = (
        "{%- for m in messages %}{%- if m.role == 'assistant' %}"
        "{{ raise_exception('no') }}{%- endif %}{{ m.content }}{%- endfor %}"
    )
    tok = tokenizer(refusing)
    prompt = tok.apply_chat_template(CONVERSATION)
    assert divergence(tok.apply_chat_template, CONVERSATION, prompt) is None


@pytest.mark.slow
def test_a_server_with_another_template_reuses_the_first_turn(tmp_path):
    """The embedded model served with a Gemma-shaped template (its own header, trims, no
    ChatML, a reasoning block the next turn drops): the second turn restores the first up to
    the point, with the official client, and answers as a server without the cache."""
    import shutil

    import openai
    from server_proc import serving

    model = tmp_path / "model"
    shutil.copytree(default_model_dir(), model)
    assert GEMMA_THINKING != GEMMA
    (model / "chat_template.jinja").write_text(GEMMA_THINKING)
    tok = Tokenizer.from_dir(model)
    turn1 = [{"role": "user", "content": "A function that reverses a list?"}]
    prompt = tok.apply_chat_template(turn1)
    at = divergence(tok.apply_chat_template, turn1, prompt)
    header = len(tok.encode(prompt[:at]))
    answers = []
    for cache in ("64", "0"):
        with serving("--model", str(model), "--prompt-cache-mib", cache) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)

            def ask(messages, client=client):
                return client.chat.completions.create(
                    model="model", messages=messages, max_tokens=8, temperature=0
                )

            r1 = ask(turn1)
            turn2 = [
                *turn1,
                {"role": "assistant", "content": r1.choices[0].message.content or "ok"},
                {"role": "user", "content": "Now for a string."},
            ]
            r2 = ask(turn2)
            cached = r2.usage.prompt_tokens_details.cached_tokens
            assert cached == (header if cache != "0" else 0)
            assert cached < r2.usage.prompt_tokens
            answers.append(r2.choices[0].message.content)
    assert answers[0] == answers[1]
