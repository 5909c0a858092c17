"""Qwen3.5 on one rank of a tensor-parallel group.

The rank's model is a :class:`~headstart.models.qwen35.model.Qwen35Model` over its shard of the
weights (``shard.py``) with a config whose head counts are divided by the group size, so the
layers' code runs unchanged on the rank's heads and its state pool holds only their state. Four
collectives join the ranks: a sum after each row-parallel projection (attention ``o_proj``, GDN
``out_proj``, MLP ``down_proj``), a sum after the vocabulary-parallel embedding (each rank looks
up its rows, zeros elsewhere), and a gather of the logits along the vocabulary. A single-process
model is the plain class: none of this runs there.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import torch

from headstart.models.qwen35.config import ModelConfig, load_config
from headstart.models.qwen35.model import Qwen35Model
from headstart.models.qwen35.pipeline import EMBED
from headstart.models.qwen35.shard import ShardedWeights, check_split, local_config
from headstart.models.qwen35.weights import Weight, load_weights
from headstart.ops.quant_matmul.cpu import UNPACK_BYTES
from headstart.parallel.group import TPGroup
from headstart.parallel.peers import Peers, lockstep

__all__ = ["ParallelQwen35"]


class _Summed:
    """A layer whose output is a partial sum on each rank (row-parallel): the sum over ranks."""

    def __init__(self, layer: Callable[..., torch.Tensor], tp: TPGroup) -> None:
        self.layer, self.tp = layer, tp

    def __call__(self, *args: Any) -> torch.Tensor:
        return self.tp.all_reduce(self.layer(*args))


class ParallelQwen35(Qwen35Model):
    """One rank's Qwen3.5 (see the module docstring). ``cfg`` is the rank's config (its heads),
    except ``vocab_size``: logits come back whole. ``peers``: on rank 0, the channel to the
    other ranks (the embedding and head, when rank 0's drafter calls them, run on every rank);
    None on the others."""

    peers: Peers | None = None

    def __init__(
        self,
        cfg: ModelConfig,
        weights: MutableMapping[str, Weight],
        tp: TPGroup,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels: str = "auto",
        unpack_bytes: int = UNPACK_BYTES,
        arena: bool = True,
        dense_bytes: int | None = None,
    ) -> None:
        """``cfg`` and ``weights``: the whole model's (``weights`` is consumed, each tensor cut to
        this rank's part as it is taken); the rest as :class:`Qwen35Model`'s."""
        check_split(cfg, tp.world)
        self.tp = tp
        shard = ShardedWeights(weights, cfg, tp.rank, tp.world, device)
        local = local_config(cfg, tp.world)
        super().__init__(local, shard, dtype, device, kernels, unpack_bytes, arena, dense_bytes)
        self.attention = _Summed(self.attention, tp)
        self.gated_deltanet = _Summed(self.gated_deltanet, tp)

    @classmethod
    def load_rank(
        cls,
        model_dir: str | Path,
        tp: TPGroup,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels: str = "auto",
        dummy: bool = False,
        dense_bytes: int | None = None,
    ) -> ParallelQwen35:
        """:meth:`Qwen35Model.load`, for rank ``tp.rank``: checkpoint tensors are read on the
        CPU and only the rank's part moves to ``device``."""
        cfg = load_config(model_dir)
        check_split(cfg, tp.world)  # before anything is read
        if dummy:
            from headstart.models.qwen35.dummy import random_weights

            # The same seed on every rank: the same weights, of which each keeps its part.
            weights = random_weights(cfg, device, dtype)
        else:
            weights = load_weights(model_dir, cfg, dtype, "cpu", lazy=True)
        return cls(cfg, weights, tp, dtype, device, kernels, dense_bytes=dense_bytes)

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().mlp(p, x))

    @lockstep("model")
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids``: each rank looks up those in its vocabulary rows, zeros elsewhere."""
        rows = self.w[EMBED].shape[0]
        local = ids - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        x = super().embed(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))

    @lockstep("model")
    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Every rank's logits of its vocabulary rows, gathered (padding rows cut off)."""
        logits = self.tp.all_gather_last(super().lm_head(h))
        vocab = self.cfg.vocab_size
        return logits if logits.shape[-1] == vocab else logits[..., :vocab].contiguous()
