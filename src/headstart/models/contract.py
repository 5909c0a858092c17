"""The model contract: what the engine, the prompt cache and the server need from a model family.

A family (Qwen3.5 in ``models/qwen35``; Nemotron-H next) declares, through a :class:`ModelFamily`
registered in :mod:`headstart.models`:

- how to recognise and load a checkpoint (``architectures`` / ``model_types`` of its
  ``config.json``, and ``load``: config parsing, weight mapping, layers);
- its **state groups** (:meth:`CausalLM.state_groups`): named per-slot tensors with their shapes.
  The state pool, prompt-cache snapshots, graph scratch copies and byte budgets are built from
  them, so nothing outside the family names its state;
- its **forward** over a :class:`~headstart.batch.ForwardBatch` of rows from many streams, each
  reading and updating its slot of the pool, returning :class:`ForwardOutput`;
- optionally, speculative-decoding surgery (``rollback``, ``commit_tree``, window records) when a
  drafter targets it;
- its **chat format** (:class:`ChatFormat`): the reasoning tags, the tool-call syntax. The
  server reads these; it knows no family's strings.

Everything here is a description; nothing imports a family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from headstart.batch import ForwardBatch
from headstart.state import StateGroup, StatePool

__all__ = [
    "CausalLM",
    "ChatFormat",
    "ForwardOutput",
    "LMConfig",
    "ModelFamily",
    "ToolCallParsing",
    "dense_copy_budget",
]


def dense_copy_budget(fraction: float, free: int, total: int) -> int:
    """Bytes a loader's dense prefill copies may take by default: ``fraction`` of the device's
    ``total`` memory, and never more than half of what is ``free`` before loading (another
    process may hold part of the GPU). One rule for the loader and for what ``serve`` plans
    before the load (``ModelFamily.dense_fraction``)."""
    return int(min(fraction * total, free / 2))


@dataclass
class ForwardOutput:
    """One forward's results: logits of the asked rows, tapped features, rollback records."""

    logits: torch.Tensor  # [R, vocab], the batch's logit rows in order
    taps: torch.Tensor | None  # [T, len(taps) * hidden]: residual stream after each tapped layer
    records: dict[int, Any]  # by slot (or window index): what a rollback of that span replays


class LMConfig(Protocol):
    """The configuration fields that code outside the family reads."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    generation_defaults: tuple[tuple[str, float], ...]


@runtime_checkable
class CausalLM(Protocol):
    """A loaded model. ``kernels.graphs`` says whether its forward may be captured in CUDA
    graphs (its kernels do no host work), and ``kernels.graph_shapes``, if present, which
    batch shapes ("decode", "prompts", "continuations", "windows"; absent: all of them);
    ``kernels.name`` is "reference", "cpu" or "gpu"."""

    cfg: LMConfig
    dtype: torch.dtype
    device: torch.device
    kernels: Any
    arena: Any

    def state_groups(self) -> tuple[StateGroup, ...]:
        """Every per-slot state tensor the forward reads and writes."""
        ...

    def new_state_pool(self, num_slots: int, max_tokens: int) -> StatePool:
        """``StatePool.allocate(self.state_groups(), ...)`` in the model's dtype and device."""
        ...

    def forward_ex(
        self, batch: ForwardBatch, pool: StatePool, taps: Sequence[int] = ()
    ) -> ForwardOutput:
        """Run the batch: each span's rows continue its slot's stream from position ``start``
        (a span at position 0 ignores whatever the slot held) and leave the slot holding the
        state after its last row; return the logits of ``batch.logit_index`` rows, the
        residual stream after each layer in ``taps`` (the drafter's features), and a record
        per span marked ``record`` (for :meth:`rollback`)."""
        ...


class ToolCallParsing(Protocol):
    """A streaming parser of one answer's tool calls (see ``ChatFormat.tool_calls``)."""

    calls: list[Any]

    def push(self, text: str) -> tuple[str, list[Any]]:
        """Content to pass through and the calls completed by ``text``."""
        ...

    def flush(self) -> str:
        """Held-back text at the end of the answer."""
        ...


@dataclass(frozen=True)
class ChatFormat:
    """What the server needs to know of a family's chat format.

    Where the next turn of a conversation diverges is not part of it: the server finds that
    from the chat template itself (``server/turns.py``). ``thinks``: the model reasons inside
    ``<think>…</think>`` (the convention of Qwen3, DeepSeek-R1 and Nemotron), returned apart as
    ``reasoning_content``.
    ``tool_calls``: builds a parser of tool calls in the answer from the request's ``tools``
    (None: no parsing; calls stay text).
    """

    thinks: bool = False
    tool_calls: Callable[[list[dict[str, Any]]], ToolCallParsing] | None = None


@dataclass(frozen=True)
class ModelFamily:
    """A model family, as the registry knows it.

    ``load(model_dir, dtype, device, kernels)`` builds the model (raising
    :class:`~headstart.errors.CheckpointError` / ``ConfigError`` naming the file and field);
    a family that can make random weights at the config's shapes (``serve --load-format
    dummy``) also takes ``dummy=True``, and one that can keep dense prefill copies of its
    quantized weights takes ``dense_bytes`` (``serve --prefill-weights``).
    A checkpoint belongs to the family when one of its ``config.json`` ``architectures`` is in
    ``architectures`` or its ``model_type`` is in ``model_types``.

    ``split``: a family that runs tensor-parallel (``serve --tensor-parallel N``) gives
    ``split(model_dir, N)``, which raises HeadstartError when the checkpoint cannot be split N
    ways, and its ``load`` then takes ``tp`` (the rank's
    :class:`~headstart.parallel.group.TPGroup`) and returns that rank's part; None: one
    process only.

    ``planned_parameters(model_dir)``: the weights a token's forward multiplies by (what the
    loaded model's ``num_parameters`` gives), from config.json alone, for what is sized before
    the load (``serve``'s compile-ahead process); None: not known before loading.

    ``dense_fraction``: for a family that keeps dense prefill copies (``dense_bytes``), the
    fraction of the device's memory its loader gives them by default (they are kept where all
    fit it and half of what is free), for what is sized before the load; 0: none kept."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    load: Callable[[Path, torch.dtype, torch.device | str, str], CausalLM]
    chat: ChatFormat = field(default_factory=ChatFormat)
    split: Callable[[Path, int], None] | None = None
    planned_parameters: Callable[[Path], int] | None = None
    dense_fraction: float = 0.0

    def claims(self, config: Mapping[str, Any]) -> bool:
        archs = config.get("architectures") or ()
        kinds = {config.get("model_type"), (config.get("text_config") or {}).get("model_type")}
        return any(a in self.architectures for a in archs if isinstance(a, str)) or bool(
            kinds & set(self.model_types)
        )
