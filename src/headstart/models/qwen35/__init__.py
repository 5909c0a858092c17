"""Qwen3.5: Gated DeltaNet layers interleaved with gated full attention (the default family)."""

from __future__ import annotations

from pathlib import Path

import torch

from headstart.models.contract import ChatFormat, ModelFamily
from headstart.models.qwen35.pipeline import DENSE_FRACTION
from headstart.models.qwen35.tool_calls import ToolCallParser

__all__ = ["CHAT", "CHAT_TEMPLATE_PATH", "FAMILY"]

#: The Qwen3.5-9B chat template, verbatim (see ``headstart.tokenizer`` for its provenance).
CHAT_TEMPLATE_PATH = Path(__file__).resolve().parent / "chat_template.jinja"

#: Qwen3.5 reasons inside <think>…</think> and calls tools in its XML-ish syntax.
CHAT = ChatFormat(thinks=True, tool_calls=ToolCallParser)


def _load(
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    kernels: str,
    dummy: bool = False,
    dense_bytes: int | None = None,
    tp=None,
):
    """The model, or with ``tp`` (a TPGroup) that rank's part of it."""
    if tp is not None:
        from headstart.models.qwen35.parallel import ParallelQwen35

        return ParallelQwen35.load_rank(
            model_dir, tp, dtype, device, kernels, dummy=dummy, dense_bytes=dense_bytes
        )
    from headstart.models.qwen35.model import Qwen35Model

    return Qwen35Model.load(model_dir, dtype, device, kernels, dummy=dummy, dense_bytes=dense_bytes)


def _split(model_dir: Path, world: int) -> None:
    from headstart.models.qwen35.config import load_config
    from headstart.models.qwen35.shard import check_split

    check_split(load_config(model_dir), world)


def _planned_parameters(model_dir: Path) -> int:
    """What :meth:`Qwen35Model.num_parameters` gives, from config.json: every weight but the
    embedding table, which counts once as the head."""
    import math

    from headstart.models.qwen35.config import load_config
    from headstart.models.qwen35.weights import expected_shapes

    cfg = load_config(model_dir)
    shapes = expected_shapes(cfg)
    total = sum(math.prod(s) for n, s in shapes.items() if n != "embed_tokens.weight")
    if cfg.tie_word_embeddings:
        total += math.prod(shapes["embed_tokens.weight"])
    return total


FAMILY = ModelFamily(
    name="qwen35",
    architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    model_types=("qwen3_5", "qwen3_5_text"),
    load=_load,
    chat=CHAT,
    split=_split,
    planned_parameters=_planned_parameters,
    dense_fraction=DENSE_FRACTION,
)
