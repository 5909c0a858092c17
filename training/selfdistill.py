"""``headstart train-drafter``: a DFlash drafter for any Qwen3.5 checkpoint headstart loads, trained
on the target's own greedy continuations of a prompt file (self-distillation, DFlash's recipe).

Job, in order: load the target with headstart (any layout it reads: transformers safetensors in
either placement, MLX 4-bit), read the prompts (:func:`read_prompts`), generate the target's
greedy continuation of each with headstart's own forward, many prompts in one batch
(:func:`batched_continuations`; its reference, through headstart's Engine, is
:func:`generate_continuations`; a continuation ends at an end-of-sequence token, which is kept,
or at ``max_new_tokens``), train a
drafter with :func:`training.drafter.train_drafter` against the same loaded model
(:class:`HeadstartTarget`: its tapped features, embedding and head are what serving feeds the
drafter, quantized weights included), and write it where ``headstart serve --drafter DIR``
reads it (``config.json`` + ``model.safetensors``, DFlash's format) with ``train_report.json``.

Non-goals: sampling-based or multi-turn data generation, continuing from an existing drafter,
several GPUs.

Prompt file: a ``.jsonl`` file holds one JSON object per line, ``{"prompt": "text"}`` (raw text,
no template: code completion) or ``{"messages": [...]}`` (a conversation, rendered with the
target's chat template and generation prompt); any other file holds one user message per line
(blank lines skipped), rendered like ``messages``. Chat rendering uses the target folder's
serving defaults (``headstart.json``), overridden by ``--think`` / ``--no-think``: a drafter is
accepted best in the thinking mode it was trained in.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn


def read_prompts(
    path: str | Path, tokenizer, template_kwargs: dict | None = None
) -> list[list[int]]:
    """The token ids of every prompt of ``path`` (format: this module's docstring), encoded as
    ``headstart serve`` encodes a completion or chat request. Raises ValueError naming the line
    of a malformed JSON line, and when the file holds no prompt."""
    kwargs = dict(template_kwargs or {})
    path = Path(path)
    out: list[list[int]] = []

    def chat(messages: list) -> list[int]:
        return list(tokenizer.encode_chat(messages, add_generation_prompt=True, **kwargs).ids)

    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            out.append(chat([{"role": "user", "content": line}]))
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            out.append(tokenizer.encode(item["prompt"]))
        elif isinstance(item, dict) and isinstance(item.get("messages"), list):
            out.append(chat(item["messages"]))
        else:
            raise ValueError(f'{path}:{n}: expected {{"prompt": str}} or {{"messages": [...]}}')
    out = [ids for ids in out if ids]
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def decode_graphs_only():
    """Graphs for decode steps only (see :func:`generate_continuations`)."""
    from headstart.engine.config import GraphConfig

    return GraphConfig(prefill_tokens=0, continuations=False, windows=False)


def generate_continuations(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    *,
    streams: int = 64,
    timeout_s: float = 3600,
) -> list[list[int] | None]:
    """The greedy continuation of each prompt by ``model`` (a headstart model), through
    headstart's Engine with up to ``streams`` prompts decoding at once. A continuation that
    ends at an end-of-sequence token keeps that token (the drafter learns where turns end).
    Prompts still unfinished ``timeout_s`` after the call get None (the rest is kept: a
    time-boxed run trains on what it has); the engine's start (graph capture, and on a fresh
    machine the kernels' compilation) counts inside it, so a caller's budget holds."""
    from headstart.engine.engine import Engine, EngineConfig, EngineRequest, Failed, Finish, Piece
    from headstart.sampling import SamplingParams

    deadline = time.monotonic() + timeout_s

    # The EOS ids as stop tokens, not as EOS: the final event then names the id that ended it.
    params = SamplingParams(
        temperature=0,
        max_tokens=max_new_tokens,
        ignore_eos=True,
        stop_token_ids=tuple(eos_token_ids),
    )
    context = max(len(p) for p in prompts) + max_new_tokens + 1
    n = len(prompts)
    # On a GPU, decode steps replay graphs (where the time goes: many streams, one row each);
    # prompt and continuation graphs would cost capture time at start and save little here.
    config = EngineConfig(min(streams, n), context, max_queue=n, graphs=decode_graphs_only())
    engine = Engine(model, tokenizer, (), config)
    tokens: list[list[int]] = [[] for _ in prompts]
    finished = [False] * n
    failures: list[str] = []
    lock = threading.Lock()
    all_done = threading.Event()

    def sink_for(i: int):
        def sink(ev) -> None:
            if isinstance(ev, Piece):
                tokens[i].append(ev.token_id)
            elif isinstance(ev, Failed):
                failures.append(f"prompt {i}: {ev.message}")
            elif isinstance(ev, Finish) and ev.reason != "abort":
                if isinstance(ev.stop_reason, int):
                    tokens[i].append(ev.stop_reason)
                with lock:
                    finished[i] = True
                    if all(finished):
                        all_done.set()

        return sink

    engine.start()
    try:
        for i, ids in enumerate(prompts):
            engine.submit(EngineRequest(f"c{i}", list(ids), params, max_new_tokens, sink_for(i)))
        all_done.wait(max(0.0, deadline - time.monotonic()))
    finally:
        engine.stop()  # what is still running ends here, unfinished
    if failures:
        raise RuntimeError(f"{len(failures)} continuation(s) failed; {failures[0]}")
    with lock:
        return [t if done else None for t, done in zip(tokens, finished, strict=True)]


def batched_continuations(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    *,
    rows: int = 512,
    prefill_tokens: int = 16384,
    timeout_s: float = 3600,
) -> list[list[int] | None]:
    """What :func:`generate_continuations` returns (its reference), computed by the model's
    forward directly: ``rows`` prompts at a time, prefilled together (in forwards of at most
    ``prefill_tokens`` tokens), then one decode row per unfinished prompt per step.

    Why beside the engine: self-distillation needs many continuations of a small target, and
    through the engine they were bound by its per-stream bookkeeping (on an H200, an 8M-parameter
    target gave about 7k tokens/s at 128 streams, so a time-boxed training run got a few hundred
    thousand tokens); a plain batched greedy loop has no per-request work beyond an argmax.
    Prompts of similar length go together (fewer padded steps at the end of a group). A group
    not finished by ``timeout_s`` after the call, and every group after it, gets None."""
    from headstart.batch import ForwardBatch, SeqChunk

    deadline = time.monotonic() + timeout_s
    stops = set(eos_token_ids)
    device = model.device
    out: list[list[int] | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for g in range(0, len(order), rows):
        group = order[g : g + rows]
        longest = max(len(prompts[i]) for i in group)
        pool = model.new_state_pool(len(group), longest + max_new_tokens + 1)
        firsts: list[torch.Tensor] = []
        chunk: list[SeqChunk] = []
        chunk_tokens = 0
        for j, i in enumerate(group):
            chunk.append(SeqChunk(j, 0, tuple(prompts[i])))
            chunk_tokens += len(prompts[i])
            if j + 1 == len(group) or chunk_tokens >= prefill_tokens:
                firsts.append(model.forward(ForwardBatch.build(chunk, device), pool))
                chunk, chunk_tokens = [], 0
        logits = torch.cat(firsts)
        tokens: list[list[int]] = [[] for _ in group]
        alive = list(range(len(group)))
        while alive:
            if time.monotonic() > deadline:
                return out  # this group and the ones after it: unfinished
            picked = logits.argmax(-1).tolist()
            still = []
            for j, t in zip(alive, picked, strict=True):
                tokens[j].append(t)
                if t not in stops and len(tokens[j]) < max_new_tokens:
                    still.append(j)
            alive = still
            if alive:
                step = [
                    SeqChunk(j, len(prompts[group[j]]) + len(tokens[j]) - 1, (tokens[j][-1],))
                    for j in alive
                ]
                logits = model.forward(ForwardBatch.build(step, device), pool)
        for j, i in enumerate(group):
            out[i] = tokens[j]
    return out


class HeadstartTarget(nn.Module):
    """A headstart-loaded Qwen3.5 model in the role :func:`training.drafter.train_drafter` gives
    its frozen target: ``tapped_features`` by headstart's own forward (so the drafter learns
    from exactly the features serving gives it, quantized weights included), the embedding
    lookup, and the output head as a dense frozen weight. Nothing here is trained."""

    def __init__(self, model) -> None:
        super().__init__()
        self.hs = model
        cfg = model.cfg
        self.config = SimpleNamespace(
            num_hidden_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
        )
        # The head's dense weight, read back through the model's own head (any layout:
        # tied or not, packed 4-bit or dense): head(I) is W^T, exactly.
        with torch.no_grad():
            eye = torch.eye(cfg.hidden_size, dtype=model.dtype, device=model.device)
            weight = model.lm_head(eye).T.contiguous()
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
        self.head.weight = nn.Parameter(weight, requires_grad=False)
        self._pools: dict[tuple[int, int], object] = {}

    def get_output_embeddings(self) -> nn.Linear:
        return self.head

    def get_input_embeddings(self):
        return lambda ids: self.hs.embed(ids.to(self.hs.device))

    @torch.no_grad()
    def tapped_features(self, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
        """``[N, T, m*H]``: the residual stream after each layer of ``layer_ids`` (in that
        order), every row of every sequence, from one packed forward."""
        from headstart.batch import ForwardBatch, SeqChunk

        N, T = input_ids.shape
        order = sorted(range(len(layer_ids)), key=lambda j: layer_ids[j])
        taps = sorted(layer_ids)
        pool = self._pools.get((N, T))
        if pool is None:  # one per batch shape: sequences restart at position 0 each call
            self._pools = {(N, T): (pool := self.hs.new_state_pool(N, T))}
        chunks = [SeqChunk(i, 0, tuple(row), 1) for i, row in enumerate(input_ids.tolist())]
        # Outside any autocast of the caller: the model computes in its own dtype.
        with torch.autocast(self.hs.device.type, enabled=False):
            out = self.hs.forward_ex(ForwardBatch.build(chunks, self.hs.device), pool, taps)
        H = self.config.hidden_size
        feats = out.taps.view(N, T, len(taps), H)
        # forward_ex concatenates in layer order; put them back in the caller's order.
        back = [order.index(j) for j in range(len(layer_ids))]
        return feats[:, :, back].reshape(N, T, len(taps) * H)


def sequence_batches(
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    batch: int,
    pad_id: int,
    seed: int = 1,
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless right-padded batches for ``train_drafter``: ``input_ids``, ``attention_mask``
    and ``loss_mask`` (the generated tokens only: anchors and targets are what the target
    said, never the prompt). Sequences of similar length are batched together (sorted within
    windows of 32 batches) so little of a batch is padding."""
    gen = torch.Generator().manual_seed(seed)
    n = len(sequences)
    while True:
        perm = torch.randperm(n, generator=gen).tolist()
        window = 32 * batch
        groups = []
        for s in range(0, n, window):
            part = sorted(perm[s : s + window], key=lambda i: len(sequences[i]))
            groups.extend(part[b : b + batch] for b in range(0, len(part), batch))
        for g in torch.randperm(len(groups), generator=gen).tolist():
            idx = groups[g]
            T = max(len(sequences[i]) for i in idx)
            ids = torch.full((len(idx), T), pad_id, dtype=torch.int64)
            valid = torch.zeros(len(idx), T, dtype=torch.bool)
            loss = torch.zeros(len(idx), T, dtype=torch.bool)
            for r, i in enumerate(idx):
                seq = sequences[i]
                ids[r, : len(seq)] = torch.tensor(seq)
                valid[r, : len(seq)] = True
                loss[r, prompt_lengths[i] : len(seq)] = True
            yield {"input_ids": ids, "attention_mask": valid, "loss_mask": loss}


def drafter_config_for(
    cfg,
    *,
    layers: int,
    block: int,
    mask_token_id: int,
    taps: Sequence[int] | None = None,
    intermediate: int | None = None,
):
    """A full-attention DFlash drafter config for the headstart model config ``cfg``: the
    target's hidden size (it reads the target's embeddings and feeds its head) and attention
    geometry; taps default to DFlash's rule (evenly spaced from layer 1 to L-3), made
    distinct and kept below the last layer (whose output headstart does not tap pre-norm)."""
    from headstart.engine.spec.drafter import DrafterConfig, default_target_layer_ids

    L = cfg.num_hidden_layers
    ids = list(taps) if taps else sorted(set(default_target_layer_ids(L, layers)))
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i < L - 1 for i in ids):
        raise ValueError(f"taps must be distinct layer indices below {L - 1}, got {ids}")
    return DrafterConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=intermediate or cfg.intermediate_size,
        num_layers=layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=float(cfg.rms_norm_eps),
        rope_theta=float(cfg.rope_theta),
        block_size=block,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(ids),
        causal=(False,) * layers,
        sliding_window=(0,) * layers,
    )


def default_mask_token(vocab_rows: int, tokenizer_size: int) -> int:
    """The block filler: the embedding's last row when the table has rows past the
    tokenizer's ids (padding rows no text ever produces). Raises ValueError otherwise."""
    if vocab_rows > tokenizer_size:
        return vocab_rows - 1
    raise ValueError(
        f"the embedding has no row past the tokenizer's {tokenizer_size} ids: "
        "give --mask-token-id (an id that never occurs in text)"
    )


@dataclass(frozen=True)
class DrafterRecipe:
    """What a drafter is trained as, given the continuations: its geometry (``block`` with the
    anchor, ``layers``, the target ``taps``, by default DFlash's rule, the MLP width, the
    block filler id) and its training (``steps`` or ``minutes``, the nearer; ``batch``
    sequences of ``anchors`` blocks a step; AdamW at ``lr``)."""

    block: int = 16
    layers: int = 2
    taps: tuple[int, ...] | None = None
    intermediate: int | None = None
    mask_token_id: int | None = None
    steps: int | None = None
    minutes: float | None = None
    batch: int = 16
    anchors: int = 32
    lr: float = 6e-4
    seed: int = 0


def train_drafter_for(
    target: str | Path,
    prompts: str | Path | Sequence[Sequence[int]],
    out: str | Path,
    recipe: DrafterRecipe,
    *,
    device: str = "auto",
    dtype: str | None = None,
    max_new_tokens: int = 256,
    streams: int = 64,
    think: bool | None = None,
    generation_timeout_s: float = 3600,
    report_file: bool = True,
    log=print,
) -> dict:
    """Self-distil a drafter for the checkpoint folder ``target`` and write it to ``out``.

    ``prompts``: a prompt file (:func:`read_prompts`) or token-id lists. Generation stops at
    ``generation_timeout_s`` (unfinished continuations are left out); training runs for the
    recipe's ``steps`` or ``minutes`` (at least one must be given). Returns the report that
    is also written to ``out/train_report.json``: counts, continuation tokens, seconds per
    phase, the drafter's geometry, the loss at the start and end (``report_file=False``: only
    returned)."""
    from headstart.loading import load, resolve_device
    from headstart.models.qwen35.model import Qwen35Model

    if recipe.steps is None and recipe.minutes is None:
        raise ValueError("give steps or minutes")
    device = resolve_device(device)
    t0 = time.perf_counter()
    loaded = load(str(target), device, dtype)
    if not isinstance(loaded.model, Qwen35Model):
        raise ValueError(f"{target}: train-drafter supports Qwen3.5 targets only")
    model, tok = loaded.model, loaded.tokenizer
    kwargs = loaded.template_defaults
    if think is not None:
        kwargs["enable_thinking"] = think
    ids = prompts if not isinstance(prompts, (str, Path)) else read_prompts(prompts, tok, kwargs)
    ids = [list(p) for p in ids]
    load_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    conts = batched_continuations(
        model,
        ids,
        max_new_tokens,
        loaded.eos_token_ids,
        rows=streams,
        timeout_s=generation_timeout_s,
    )
    gen_s = time.perf_counter() - t1
    fit = fit_drafter(
        model,
        ids,
        conts,
        out,
        recipe,
        tokenizer_size=tok.vocab_size,
        eos_token_ids=loaded.eos_token_ids,
        log=log,
        generation_s=gen_s,
    )
    report = {
        "target": str(target),
        "device": str(model.device),
        "dtype": str(model.dtype),
        "prompts": len(ids),
        **{k: v for k, v in fit.items() if k != "seconds"},
        "max_new_tokens": max_new_tokens,
        "template_kwargs": kwargs,
        "seconds": {"load": load_s, "continuations": gen_s, **fit["seconds"]},
    }
    if report_file:
        (Path(out) / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    log(f"drafter -> {out} ({report['steps']} steps in {fit['seconds']['training']:.0f}s)")
    return report


def fit_drafter(
    model,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int] | None],
    out: str | Path,
    recipe: DrafterRecipe,
    *,
    tokenizer_size: int,
    eos_token_ids: Sequence[int],
    log=print,
    generation_s: float | None = None,
    init: str | Path | None = None,
) -> dict:
    """Train a drafter for the loaded headstart ``model`` on ``prompts`` and their
    ``continuations`` (what :func:`batched_continuations` returns; None and one-token ones are
    left out) as ``recipe`` says and write it to ``out``: the second half of
    :func:`train_drafter_for`, apart so that one set of continuations can train several
    geometries. ``init``: a drafter checkpoint of the recipe's geometry to go on training
    (a new warm-up and schedule) instead of random weights. Returns counts, the geometry, the
    loss at the start and end and ``seconds`` {"training"}."""
    from training.drafter import TrainableDrafter, save_drafter_checkpoint, train_drafter

    # A block needs an anchor and a target; None: not finished in the generation time.
    keep = [i for i, c in enumerate(continuations) if c is not None and len(c) >= 2]
    if not keep:
        raise ValueError("no continuation is long enough to train on")
    seqs = [list(prompts[i]) + list(continuations[i]) for i in keep]
    lengths = [len(prompts[i]) for i in keep]
    n_tokens = sum(len(continuations[i]) for i in keep)
    took = f" in {generation_s:.1f}s" if generation_s is not None else ""
    log(f"continuations: {len(keep)} of {len(prompts)} prompts, {n_tokens} tokens{took}")

    r = recipe
    mask = (
        r.mask_token_id
        if r.mask_token_id is not None
        else default_mask_token(model.cfg.vocab_size, tokenizer_size)
    )
    cfg = drafter_config_for(
        model.cfg,
        layers=r.layers,
        block=r.block,
        mask_token_id=mask,
        taps=r.taps,
        intermediate=r.intermediate,
    )
    start = None
    if init is not None:
        mc = model.cfg
        start = TrainableDrafter.from_checkpoint(
            init, mc.num_hidden_layers, mc.hidden_size, mc.vocab_size
        )
        got = (start.cfg.num_layers, start.cfg.block_size, tuple(start.cfg.target_layer_ids))
        if got != (cfg.num_layers, cfg.block_size, tuple(cfg.target_layer_ids)):
            raise ValueError(f"{init}: layers, block and taps {got} are not the recipe's")
    pad = eos_token_ids[0] if eos_token_ids else 0
    history: list[float] = []
    t2 = time.perf_counter()
    # Forwards under autocast on a GPU (the drafter's weights stay fp32 while it trains).
    amp = torch.bfloat16 if model.device.type == "cuda" else torch.float32
    drafter = train_drafter(
        HeadstartTarget(model),
        sequence_batches(seqs, lengths, r.batch, pad, r.seed + 1),
        cfg,
        steps=r.steps,
        time_budget_s=r.minutes * 60 if r.minutes is not None else float("inf"),
        lr=r.lr,
        anchors_per_seq=r.anchors,
        device=model.device,
        dtype=amp,
        seed=r.seed,
        init=start,
        history=history,
        log=log,
    )
    train_s = time.perf_counter() - t2
    save_drafter_checkpoint(
        drafter,
        cfg,
        Path(out),
        num_target_layers=model.cfg.num_hidden_layers,
        vocab_size=model.cfg.vocab_size,
    )
    first = history[: max(1, len(history) // 20)]
    last = history[-max(1, len(history) // 20) :]
    stops = set(eos_token_ids)
    return {
        "continuations": len(keep),
        "unfinished": sum(c is None for c in continuations),
        "continuation_tokens": n_tokens,
        "ended_by_eos": sum(1 for i in keep if continuations[i][-1] in stops),
        "drafter": {
            "layers": r.layers,
            "block_size": r.block,
            "target_layer_ids": list(cfg.target_layer_ids),
            "mask_token_id": mask,
            "intermediate_size": cfg.intermediate_size,
        },
        "steps": len(history),
        "batch": r.batch,
        "anchors_per_seq": r.anchors,
        "loss_first": sum(first) / len(first) if history else None,
        "loss_last": sum(last) / len(last) if history else None,
        "seconds": {"training": train_s},
    }


def run(args: argparse.Namespace) -> int:
    """``headstart train-drafter`` (options: ``headstart.cli.add_train_drafter_args``)."""
    taps = [int(t) for t in args.taps.split(",")] if args.taps else None
    minutes = args.minutes if args.minutes is not None or args.steps is not None else 10.0
    recipe = DrafterRecipe(
        block=args.block,
        layers=args.layers,
        taps=tuple(taps) if taps else None,
        intermediate=args.intermediate,
        mask_token_id=args.mask_token_id,
        steps=args.steps,
        minutes=minutes,
        batch=args.batch,
        anchors=args.anchors,
        lr=args.lr,
        seed=args.seed,
    )
    train_drafter_for(
        args.target,
        args.prompts,
        args.out,
        recipe,
        device=args.device,
        dtype=args.dtype,
        max_new_tokens=args.max_new_tokens,
        streams=args.streams,
        think=args.think,
    )
    return 0
