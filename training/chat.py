"""The supervised chat pass: conversations made from the corpus, and how code-like answers are.

Job: turn the corpus's documented functions into one-turn conversations (the docstring's first
sentence, or the comment right above the ``def``, phrased as a request; the function as the
answer), render them with the model's own chat template with thinking off, train on the
assistant tokens only, and measure the result: how many of :data:`CODE_PROMPTS`' greedy answers
hold code that ``ast.parse`` accepts.

The answer is the function **without its docstring**, in a ```` ```python ```` fence, then the
end-of-turn token. Without: the request already is the docstring's sentence, so keeping it would
spend the answer's first tokens copying the request back, and a small model that learns to open
answers with prose tends to stay in prose; every answer token is code. In a fence: chat clients
render it as code and :func:`extract_code` finds it even when the model adds words around it.
Every answer parses (``ast.parse``) before it is kept.

Rendering matches serving exactly: the prompt is ``Tokenizer.encode_chat`` of the user turn with
the generation prompt and ``enable_thinking=False`` (what ``headstart serve`` sends for a model
whose ``headstart.json`` says so), and the answer is encoded on its own after it, as generated
tokens would be; :func:`encode_example` checks that the template renders the same conversation
to the same text.

    python -m training.chat --examples chat.jsonl   # build the examples of the training split
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
import textwrap
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from headstart.tokenizer import Tokenizer

TEMPLATE_KWARGS = {"enable_thinking": False}
END_OF_TURN = "<|im_end|>"
MAX_CODE_LINES = 40

# Held fixed so runs compare: varied tasks, all phrased as users ask, none taken from the corpus.
CODE_PROMPTS = [
    "Write a function that returns the factorial of n.",
    "Write a function that checks whether a string is a palindrome.",
    "Write a function that reverses a list.",
    "Write a function that returns the largest number in a list.",
    "Write a function that counts the vowels in a string.",
    "Write a function that reads a file and returns its lines.",
    "Write a function that returns the n-th Fibonacci number.",
    "Write a function that merges two dictionaries.",
    "Write a function that removes duplicates from a list and keeps the order.",
    "Write a function that converts a temperature from Celsius to Fahrenheit.",
    "Write a function that returns True if a number is prime.",
    "Write a function that splits a string into words.",
    "Write a function that computes the average of a list of numbers.",
    "Write a function that flattens a nested list.",
    "Write a function that returns the keys of a dictionary sorted by their values.",
    "Write a function that joins a directory and a file name into a path.",
    "Write a function that parses an integer from a string and returns None if it fails.",
    "Write a function that returns the current time as a string.",
    "Write a function that counts how often each word appears in a text.",
    "Write a function that encodes a string as base64.",
]

# Imperative verbs docstrings open with ("Return the ..."); the request says "that returns".
_VERB_LIST = """
    accept acquire add adjust allocate append apply assert assign attach build calculate
    call cancel check clean clear close collect combine compare compile compute configure
    connect construct consume convert copy count create decode decorate define delete detach
    determine disable dispatch display do draw drop dump emit enable encode ensure enter
    escape evaluate execute exit expand export extend extract fetch fill filter find finish
    fix flatten flush format generate get give handle hash ignore import increment
    initialize insert install invoke is iterate join keep load locate lock log look make map
    mark match merge modify move normalize notify open override pack pad parse patch perform
    pick place pop populate prepare print process produce push put quote raise read receive
    record reduce refresh register release reload remove rename render repeat replace report
    reset resolve restore return reverse run save scan schedule search select send serialize
    set setup show skip sort split start stop store strip substitute swap take tell test
    toggle tokenize transform translate truncate try turn unpack unquote unregister update
    use validate verify visit wait walk wrap write yield
"""
_VERBS = frozenset(_VERB_LIST.split())


@dataclass(frozen=True)
class Example:
    """One conversation: ``request`` (the user turn), ``code`` (the answer's function),
    ``origin`` (corpus path and function name, to trace it back)."""

    request: str
    code: str
    origin: str


def first_sentence(doc: str) -> str | None:
    """The first sentence of a docstring or comment, or None when it is not a usable request
    (too short or long, doctest or markup, not starting with a letter)."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    sentence = match.group(1) if match else text
    if not 15 <= len(sentence) <= 200 or len(sentence.split()) < 3:
        return None
    if not sentence[0].isalpha() or any(s in sentence for s in (">>>", "::", "`", "TODO", "XXX")):
        return None
    return sentence if sentence.endswith((".", "!", "?")) else sentence + "."


def _third_person(verb: str) -> str:
    v = verb.lower()
    if v in ("do", "go"):
        return v + "es"
    if v == "is":
        return v
    if v.endswith(("s", "sh", "ch", "x", "z")):
        return v + "es"
    if v.endswith("y") and v[-2:-1] not in "aeiou":
        return v[:-1] + "ies"
    return v + "s"


def request_from(sentence: str, name: str) -> str:
    """A user request for a function ``name`` described by ``sentence``. "Return the sum."
    becomes "Write a function that returns the sum."; the wording varies (by a hash of the
    function's name, so it is reproducible) and sometimes names the function."""
    word, _, rest = sentence.partition(" ")
    low = word.lower()
    pick = hashlib.sha1(name.encode()).digest()[0] % 4
    if low in _VERBS:
        clause = f"{_third_person(word)} {rest}"
    elif low.endswith("s") and (low[:-1] in _VERBS or low[:-2] in _VERBS):
        clause = f"{low} {rest}"  # already "Returns the ..."
    else:
        lead = ("Write a Python function for this: ", "Implement this in Python: ")[pick % 2]
        return lead + sentence
    if pick == 3 and name.isidentifier() and not name.startswith("_"):
        return f"Write a function called {name} that {clause}"
    return ("Write a function that ", "Write a Python function that ")[pick % 2] + clause


def _leading_comment(lines: list[str], first: int) -> str | None:
    """The ``#`` comment block right above line ``first`` (0-based), as one text."""
    block: list[str] = []
    i = first - 1
    while i >= 0 and lines[i].strip().startswith("#"):
        block.insert(0, lines[i].strip().lstrip("#").strip())
        i -= 1
    text = " ".join(b for b in block if b)
    return text or None


def function_examples(text: str, origin: str = "") -> list[Example]:
    """Examples from the module-level functions and the methods of module-level classes of
    one source file that have a docstring (or a leading comment) usable as a request and a
    body besides it; nested functions are left out (they depend on their enclosing scope)."""
    try:
        with warnings.catch_warnings():  # invalid escapes in old code: noise, not errors
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    nodes = []
    for node in tree.body:
        nodes.append(node)
        if isinstance(node, ast.ClassDef):
            nodes.extend(node.body)
    out = []
    for node in nodes:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        body, drop = node.body, range(0)
        doc = ast.get_docstring(node)
        first = body[0]
        if doc is not None:
            if first.lineno == node.lineno or len(body) == 1 or first.end_lineno is None:
                continue  # a one-line def, or nothing but the docstring
            drop = range(first.lineno - 1, first.end_lineno)
            said = first_sentence(doc)
        else:
            comment = _leading_comment(lines, start)
            said = first_sentence(comment) if comment else None
        if said is None:
            continue
        skip = set(drop)
        if drop and drop.stop < node.end_lineno and not lines[drop.stop].strip():
            skip.add(drop.stop)  # the blank line that followed the docstring
        kept = [lines[i] for i in range(start, node.end_lineno) if i not in skip]
        code = textwrap.dedent("\n".join(kept)).strip("\n")
        if not 2 <= code.count("\n") + 1 <= MAX_CODE_LINES or len(code) > 2_000:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ast.parse(code)
        except SyntaxError:
            continue
        out.append(Example(request_from(said, node.name), code, f"{origin}:{node.name}"))
    return out


def corpus_examples(split: str = "train", max_chars: int = 10**12) -> list[Example]:
    """:func:`function_examples` of every file of ``split`` (training files only by default:
    the held-out perplexity stays measured on text the model never saw in any form)."""
    from training.data import candidate_files, deduplicated, split_of

    out: list[Example] = []
    total = 0
    for f, text in deduplicated(candidate_files()):
        if split_of(f.rel) != split:
            continue
        out.extend(function_examples(text, f.rel))
        total += len(text)
        if total >= max_chars:
            break
    return out


def answer_text(code: str) -> str:
    return f"```python\n{code}\n```"


def prompt_encoding(tokenizer: Tokenizer, request: str, template_kwargs: dict | None = None):
    """The prompt ``headstart serve`` feeds the model for a one-turn chat ``request``
    (a :class:`~headstart.tokenizer.ChatEncoding`: text and ids)."""
    kwargs = TEMPLATE_KWARGS if template_kwargs is None else template_kwargs
    messages = [{"role": "user", "content": request}]
    return tokenizer.encode_chat(messages, add_generation_prompt=True, **kwargs)


def encode_example(
    tokenizer: Tokenizer, example: Example, template_kwargs: dict | None = None
) -> tuple[list[int], list[bool]]:
    """``(ids, loss_mask)``: the serving prompt, then the answer's tokens and the end-of-turn
    token; the mask is True exactly on the answer and the end-of-turn token. Raises
    ValueError if the chat template renders the whole conversation differently (then the
    model would be trained on a layout it never sees when served)."""
    kwargs = TEMPLATE_KWARGS if template_kwargs is None else template_kwargs
    end = tokenizer.token_to_id(END_OF_TURN)
    if end is None:
        raise ValueError(f"the tokenizer has no {END_OF_TURN}")
    prompt = prompt_encoding(tokenizer, example.request, kwargs)
    answer = answer_text(example.code)
    full = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": example.request},
            {"role": "assistant", "content": answer},
        ],
        add_generation_prompt=False,
        **kwargs,
    )
    if not full.startswith(prompt.text + answer + END_OF_TURN):
        raise ValueError("the chat template renders the conversation differently from serving")
    reply = tokenizer.encode(answer) + [end]
    return list(prompt.ids) + reply, [False] * len(prompt.ids) + [True] * len(reply)


def chat_rows(
    tokenizer: Tokenizer, examples: Iterable[Example], seq_len: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``loss_mask`` ``[N, seq_len]``, right-padded with ``pad_id`` (never in
    the loss); conversations longer than ``seq_len`` are left out whole, never cut (a cut
    answer would teach answers that stop without the end-of-turn token)."""
    ids_rows, mask_rows = [], []
    for ex in examples:
        ids, mask = encode_example(tokenizer, ex)
        if len(ids) > seq_len:
            continue
        pad = seq_len - len(ids)
        ids_rows.append(ids + [pad_id] * pad)
        mask_rows.append(mask + [False] * pad)
    if not ids_rows:
        raise ValueError("no conversation fits the sequence length")
    return {
        "input_ids": torch.tensor(ids_rows, dtype=torch.int64),
        "loss_mask": torch.tensor(mask_rows, dtype=torch.bool),
    }


def masked_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions whose *target* token is masked in:
    ``logits[:, t]`` predicts ``ids[:, t + 1]``, counted iff ``mask[:, t + 1]``."""
    target, keep = ids[:, 1:], mask[:, 1:].float()
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="none"
    )
    return (ce * keep.reshape(-1)).sum() / keep.sum().clamp(min=1)


def train_chat(
    model,
    rows: dict[str, torch.Tensor],
    *,
    time_budget_s: float,
    steps: int | None = None,
    batch: int = 64,
    lr: float = 5e-4,
    corpus: torch.Tensor | None = None,
    corpus_rows: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """Fine-tune ``model`` (transformers ``Qwen3_5ForCausalLM``) on ``rows`` from
    :func:`chat_rows`: loss on the assistant tokens only; AdamW, 5% warmup, cosine to 10% over
    ``steps`` or the time budget, whichever ends first. ``corpus_rows`` rows of ``corpus``
    (plain pre-training rows, every token in the loss) join each batch so the pass does not
    erase plain completion. Returns steps, seconds, the loss history."""
    from training.target import _torch_gated_delta, optimizer_step

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    amp = {"device_type": device.split(":")[0], "dtype": dtype, "enabled": dtype != torch.float32}
    ids_all, mask_all = rows["input_ids"], rows["loss_mask"]
    if corpus is not None and corpus_rows and corpus.shape[1] < ids_all.shape[1]:
        raise ValueError("corpus rows must be at least as long as the chat rows")
    start, step, history = time.perf_counter(), 0, []
    with _torch_gated_delta():
        while True:
            elapsed = time.perf_counter() - start
            if (steps is not None and step >= steps) or elapsed >= time_budget_s:
                break
            progress = elapsed / time_budget_s if math.isfinite(time_budget_s) else 0.0
            if steps:
                progress = max(progress, step / steps)
            scale = (
                progress / 0.05
                if progress < 0.05
                else 0.55 + 0.45 * math.cos(math.pi * (progress - 0.05) / 0.95)
            )
            for group in opt.param_groups:
                group["lr"] = lr * max(scale, 0.01)
            pick = torch.randint(0, ids_all.shape[0], (batch,), generator=gen)
            ids, mask = ids_all[pick], mask_all[pick]
            if corpus is not None and corpus_rows:
                more = corpus[torch.randint(0, corpus.shape[0], (corpus_rows,), generator=gen)]
                ids = torch.cat([ids, more[:, : ids.shape[1]]])
                mask = torch.cat([mask, torch.ones(corpus_rows, ids.shape[1], dtype=torch.bool)])
            ids, mask = ids.to(device), mask.to(device)
            with torch.autocast(**amp):
                logits = model(ids).logits
            loss = masked_loss(logits, ids, mask)
            optimizer_step(model.parameters(), opt, loss)
            step += 1
            history.append((step, loss.item()))
            if step % 50 == 0 or step == 1:
                log(f"chat step {step} loss {loss.item():.3f} ({time.perf_counter() - start:.0f}s)")
    model.eval()
    log(f"chat: {step} steps in {time.perf_counter() - start:.0f}s")
    return {"steps": step, "seconds": time.perf_counter() - start, "loss_history": history}


# ----------------------------------------------------------------------------------------------
# How code-like the answers are
# ----------------------------------------------------------------------------------------------


def extract_code(content: str) -> str:
    """The first fenced block of ``content`` (its closing fence may be missing: the answer
    was cut), else the whole content."""
    match = re.search(r"```[\w+-]*\n(.*?)(?:```|\Z)", content, re.S)
    return match.group(1) if match else content


def parses(code: str) -> bool:
    """``ast.parse`` accepts it, and it holds at least one statement."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bool(ast.parse(code).body)
    except (SyntaxError, ValueError):
        return False


def served_greedy(loaded, max_tokens: int, repetition_penalty: float | None = None):
    """Greedy ``SamplingParams`` as ``serve`` (and ``run``) decode a request that sets only
    ``temperature=0``: the model folder's ``repetition_penalty`` unless one is given."""
    from headstart.sampling import SamplingParams

    if repetition_penalty is None:
        defaults = dict(loaded.model.cfg.generation_defaults)
        repetition_penalty = defaults.get("repetition_penalty", 1.0)
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, repetition_penalty=repetition_penalty
    )


def chat_answers(
    model_dir: str | Path,
    prompts: list[str],
    device: str = "cpu",
    max_tokens: int = 256,
    dtype: str | None = None,
    repetition_penalty: float | None = None,
) -> list[dict]:
    """Greedy answers of the model in ``model_dir`` through headstart's Engine, each prompt
    rendered as ``headstart serve`` renders a chat request (the folder's ``headstart.json``
    template defaults) and decoded as serve decodes a request that sets only
    ``temperature=0``: with the folder's ``repetition_penalty`` (generation_config.json), unless
    ``repetition_penalty`` is given. The reply is split into reasoning and content as the server
    splits it. One dict per prompt: prompt, content, reasoning, finish (``stop``: the model
    ended its turn; ``length``: ``max_tokens`` ran out), tokens."""
    import threading

    from headstart.engine.engine import Engine, EngineConfig, EngineRequest, Failed, Finish, Piece
    from headstart.loading import load
    from headstart.server.reasoning import prompt_opens_reasoning, split_full

    loaded = load(str(model_dir), device, dtype)
    tok, kwargs = loaded.tokenizer, loaded.template_defaults
    encoded = [
        tok.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True, **kwargs)
        for p in prompts
    ]
    params = served_greedy(loaded, max_tokens, repetition_penalty)
    context = max(len(e.ids) for e in encoded) + max_tokens + 1
    from training.selfdistill import decode_graphs_only

    config = EngineConfig(len(prompts), context, graphs=decode_graphs_only())
    engine = Engine(loaded.model, tok, loaded.eos_token_ids, config)
    results: list[dict] = [{} for _ in prompts]
    done = threading.Semaphore(0)
    engine.start()
    try:
        for i, enc in enumerate(encoded):
            tokens: list[int] = []
            text: list[str] = []

            def sink(ev, i=i, tokens=tokens, text=text) -> None:
                if isinstance(ev, Piece):
                    tokens.append(ev.token_id)
                    text.append(ev.text)
                elif isinstance(ev, (Finish, Failed)):
                    if isinstance(ev, Finish):
                        text.append(ev.text)
                    results[i] = {
                        "finish": ev.reason if isinstance(ev, Finish) else f"failed: {ev.message}",
                        "tokens": len(tokens),
                        "text": "".join(text),
                    }
                    done.release()

            engine.submit(EngineRequest(f"chat-{i}", enc.ids, params, max_tokens, sink))
        for _ in prompts:
            if not done.acquire(timeout=600):
                raise TimeoutError("a chat answer did not finish in 600 s")
    finally:
        engine.stop()
    out = []
    for prompt, enc, r in zip(prompts, encoded, results, strict=True):
        reasoning, content = split_full(r["text"], prompt_opens_reasoning(enc.text))
        out.append(
            {
                "prompt": prompt,
                "content": content,
                "reasoning": reasoning,
                "finish": r["finish"],
                "tokens": r["tokens"],
            }
        )
    return out


def evaluate_code(
    model_dir: str | Path,
    device: str = "cpu",
    max_tokens: int = 256,
    prompts: list[str] | None = None,
    repetition_penalty: float | None = None,
) -> dict:
    """:func:`chat_answers` of :data:`CODE_PROMPTS`; ``parsed``: how many answers' code
    (:func:`extract_code`) :func:`parses`; ``ended``: how many ended their turn themselves."""
    answers = chat_answers(
        model_dir,
        prompts or CODE_PROMPTS,
        device,
        max_tokens,
        repetition_penalty=repetition_penalty,
    )
    for a in answers:
        a["parses"] = parses(extract_code(a["content"]))
    return {
        "prompts": len(answers),
        "parsed": sum(a["parses"] for a in answers),
        "ended": sum(a["finish"] == "stop" for a in answers),
        "empty_content": sum(not a["content"].strip() for a in answers),
        "max_tokens": max_tokens,
        "answers": answers,
    }


def main(argv: list[str] | None = None) -> None:
    """Write the training split's conversations as JSON lines (request, code, origin)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--examples", required=True, help="output .jsonl")
    ap.add_argument("--max-chars", type=int, default=10**12, help="read at most this much text")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    examples = corpus_examples("train", args.max_chars)
    with open(args.examples, "w") as f:
        for ex in examples:
            f.write(json.dumps(asdict(ex)) + "\n")
    print(f"{len(examples)} conversations -> {args.examples} in {time.perf_counter() - t0:.0f}s")


def read_examples(path: str | Path) -> list[Example]:
    with open(path) as f:
        return [Example(**json.loads(line)) for line in f if line.strip()]


if __name__ == "__main__":
    main()
