"""Which part of each Qwen3.5 checkpoint tensor a rank keeps (a Megatron-style split).

Projections that read the hidden state and produce heads are split along their output (column
parallel), the projections that write the hidden state back along their input (row parallel: each
rank's product is a partial sum, all-reduced); the embedding table and the head by vocabulary rows.
Cuts are made by checkpoint name, before the loading pipeline fuses projections, and per head
group: rank r keeps attention heads ``r*nh/N ..`` with their key/value heads (query head h reads
key/value head ``h // (nh/nkv)``) and GDN key heads ``r*Hk/N ..`` with their value heads (value
head h reads key head ``h // (Hv/Hk)``), so once fused each rank's ``in_proj`` holds the
``q, k, v, z, b, a`` of its own heads and the forward runs unchanged on a config with the head
counts divided (:func:`local_config`). Norms are per head or over the full hidden state: every
rank keeps them whole.

MLX 4-bit weights are cut as they are stored: rows of packed words, scales and biases, or, along
the input, whole quantization groups (:func:`check_split` refuses a split that would cut one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, MutableMapping

import torch

from headstart.arena import to_meta
from headstart.errors import HeadstartError
from headstart.models.qwen35.config import FULL, ModelConfig
from headstart.models.qwen35.weights import Weight, stand_ins
from headstart.quant import QuantizedTensor

__all__ = ["ShardedWeights", "check_split", "local_config", "shard", "valid_sizes"]

VOCAB = ("embed_tokens.weight", "lm_head.weight")

# Row-parallel projections: (module within a layer, the layer kind it is in or None for every
# layer, its input width); their input is split, so a quantized one is split in whole groups.
_ROW_PARALLEL = (
    ("self_attn.o_proj", FULL, lambda c: c.num_attention_heads * c.head_dim),
    ("linear_attn.out_proj", "linear_attention", lambda c: c.value_dim),
    ("mlp.down_proj", None, lambda c: c.intermediate_size),
)


def _plan(name: str, cfg: ModelConfig) -> tuple[int, tuple[int, ...]] | None:
    """How ``name`` is split: (axis, segment sizes), each segment cut into ``world`` equal
    parts and rank r keeping part r of every segment; None: every rank keeps it whole."""
    if not name.startswith("layers."):
        return None
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    k, v, hv, inner = cfg.key_dim, cfg.value_dim, cfg.linear_num_value_heads, cfg.intermediate_size
    plans = {
        "self_attn.q_proj.weight": (0, (2 * nh * hd,)),  # per head [query | gate]
        "self_attn.k_proj.weight": (0, (nkv * hd,)),
        "self_attn.v_proj.weight": (0, (nkv * hd,)),
        "self_attn.o_proj.weight": (1, (nh * hd,)),
        # The conv input and its channels are [q | k | v]: each part cut by heads.
        "linear_attn.in_proj_qkv.weight": (0, (k, k, v)),
        "linear_attn.conv1d.weight": (0, (k, k, v)),
        "linear_attn.in_proj_z.weight": (0, (v,)),
        "linear_attn.in_proj_b.weight": (0, (hv,)),
        "linear_attn.in_proj_a.weight": (0, (hv,)),
        "linear_attn.A_log": (0, (hv,)),
        "linear_attn.dt_bias": (0, (hv,)),
        "linear_attn.out_proj.weight": (1, (v,)),
        "mlp.gate_proj.weight": (0, (inner,)),
        "mlp.up_proj.weight": (0, (inner,)),
        "mlp.down_proj.weight": (1, (inner,)),
    }
    return plans.get(name.split(".", 2)[2])


def _head_counts(cfg: ModelConfig) -> dict[str, int]:
    return {
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "linear_num_key_heads": cfg.linear_num_key_heads,
        "linear_num_value_heads": cfg.linear_num_value_heads,
        "intermediate_size": cfg.intermediate_size,
    }


def _split_problems(cfg: ModelConfig, world: int) -> list[str]:
    """Why ``cfg`` cannot be split ``world`` ways (empty: it can)."""
    problems = [f"{k} {n}" for k, n in _head_counts(cfg).items() if n % world]
    if problems or cfg.quantization is None:
        return problems
    for module, kind, width in _ROW_PARALLEL:
        n = width(cfg)
        for i, t in enumerate(cfg.layer_types):
            spec = cfg.quantization.spec_for(f"layers.{i}.{module}")
            # A width the group does not divide is stored unquantized (mlx-lm's rule).
            quantized = spec is not None and n % spec.group_size == 0
            if (kind is None or t == kind) and quantized and (n // world) % spec.group_size:
                problems.append(
                    f"{module} input {n} in {spec.bits}-bit groups of {spec.group_size}"
                )
                break
    return problems


def valid_sizes(cfg: ModelConfig, up_to: int = 16) -> list[int]:
    """The group sizes up to ``up_to`` that split ``cfg`` into whole heads and groups."""
    return [n for n in range(1, up_to + 1) if not _split_problems(cfg, n)]


def check_split(cfg: ModelConfig, world: int) -> None:
    """Raise HeadstartError, naming the counts, when ``world`` ranks cannot each hold whole
    heads (attention, key/value, GDN key and value heads), an equal part of the MLP, and whole
    quantization groups of the row-parallel projections' inputs."""
    if world < 1:
        raise HeadstartError(f"--tensor-parallel must be >= 1, not {world}")
    problems = _split_problems(cfg, world)
    if problems:
        sizes = ", ".join(map(str, valid_sizes(cfg)))
        raise HeadstartError(
            f"--tensor-parallel {world} does not divide this model's {'; '.join(problems)}: "
            f"every rank must hold whole heads and whole quantization groups "
            f"(sizes that split it: {sizes})"
        )


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """One rank's model: the head counts and the MLP width divided by ``world`` (the
    vocabulary stays whole: the logits are gathered)."""
    return dataclasses.replace(cfg, **{k: n // world for k, n in _head_counts(cfg).items()})


def _cut(w: Weight, axis: int, start: int, length: int, name: str) -> Weight:
    if isinstance(w, torch.Tensor):
        return w.narrow(axis, start, length)
    if axis == 0:
        return QuantizedTensor(
            *(t.narrow(0, start, length) for t in (w.packed, w.scales, w.biases)),
            w.bits,
            w.group_size,
        )
    if start % w.group_size or length % w.group_size:
        raise HeadstartError(
            f"'{name}': columns {start}..{start + length} cut a quantization group of "
            f"{w.group_size}; choose another --tensor-parallel"
        )
    per_word, g = 32 // w.bits, w.group_size
    return QuantizedTensor(
        w.packed.narrow(1, start // per_word, length // per_word),
        w.scales.narrow(1, start // g, length // g),
        w.biases.narrow(1, start // g, length // g),
        w.bits,
        w.group_size,
    )


def _cat(parts: list[Weight], axis: int) -> Weight:
    """The parts side by side along ``axis``: always a new tensor, never a view that would
    keep the whole checkpoint tensor alive."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=axis)
    return QuantizedTensor(
        *(
            torch.cat([getattr(p, f) for p in parts], dim=axis)
            for f in ("packed", "scales", "biases")
        ),
        parts[0].bits,
        parts[0].group_size,
    )


def _vocab_rows(w: Weight, rank: int, world: int) -> Weight:
    """Rank ``rank``'s vocabulary rows, ``ceil(V / world)`` of them; the last rank's are padded
    with zero rows (zero embeddings, zero logits: cut off after the gather)."""
    vocab = w.shape[0]
    rows = -(-vocab // world)
    start = min(rank * rows, vocab)
    kept = _cut(w, 0, start, min(rows, vocab - start), "")
    pad = rows - kept.shape[0]
    if isinstance(kept, torch.Tensor):
        return torch.cat([kept, kept.new_zeros(pad, *kept.shape[1:])])
    return QuantizedTensor(
        *(
            torch.cat([t, t.new_zeros(pad, t.shape[1])])
            for t in (kept.packed, kept.scales, kept.biases)
        ),
        kept.bits,
        kept.group_size,
    )


def shard(name: str, w: Weight, cfg: ModelConfig, rank: int, world: int) -> Weight:
    """Rank ``rank``'s part of checkpoint tensor ``name`` (canonical name, see weights.py) of a
    model with config ``cfg`` split ``world`` ways; works on meta stand-ins too."""
    if name in VOCAB:
        return _vocab_rows(w, rank, world)
    plan = _plan(name, cfg)
    if plan is None:
        return w
    axis, segments = plan
    parts, offset = [], 0
    for size in segments:
        part = size // world
        parts.append(_cut(w, axis, offset + rank * part, part, name))
        offset += size
    return _cat(parts, axis)


class ShardedWeights(MutableMapping[str, Weight]):
    """Rank ``rank``'s part of ``source``'s weights, as the model's loading pipeline takes them:
    each tensor is read whole from ``source`` when it is taken (one at a time), cut by
    :func:`shard` and moved to ``device``; values set here (fused stacks) are held as given."""

    def __init__(
        self,
        source: MutableMapping[str, Weight],
        cfg: ModelConfig,
        rank: int,
        world: int,
        device: torch.device | str,
    ) -> None:
        self._source, self._held = source, {}
        self.cfg, self.rank, self.world = cfg, rank, world
        self.device = torch.device(device)

    def __getitem__(self, key: str) -> Weight:
        if key in self._held:
            return self._held[key]
        return shard(key, self._source[key], self.cfg, self.rank, self.world).to(self.device)

    def __setitem__(self, key: str, value: Weight) -> None:
        if key in self._source:  # (pop would read it)
            del self._source[key]
        self._held[key] = value

    def __delitem__(self, key: str) -> None:
        if key in self._held:
            del self._held[key]
        else:
            del self._source[key]

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self._held or key in self._source

    def __iter__(self) -> Iterator[str]:
        return iter([*self._source, *self._held])  # a snapshot: callers pop as they go

    def __len__(self) -> int:
        return len(self._source) + len(self._held)

    def meta(self) -> Mapping[str, Weight]:
        """Meta stand-ins of every value, as a read would give them (nothing is read)."""
        cut = {
            k: shard(k, t, self.cfg, self.rank, self.world)
            for k, t in stand_ins(self._source).items()
        }
        return {**cut, **{k: to_meta(t) for k, t in self._held.items()}}
