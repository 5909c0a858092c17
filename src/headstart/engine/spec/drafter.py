"""The DFlash block drafter: config, checkpoint, context ring and one-forward block proposals.

A DFlash drafter (block drafting after z-lab's DFlash) is a small Qwen3-style stack that proposes
the ``B - 1`` tokens after an anchor in one non-causal forward. The target's hidden states at the
tapped layers, fused by ``fc`` + ``hidden_norm``, enter every drafter layer as extra keys/values
(context); queries come only from the block ``[anchor, MASK x (B-1)]``. It shares the target's
embedding and LM head. Per stream, the context keys/values live in a ring of the newest
``window`` rows of a preallocated :class:`DrafterPool` slot (long prompts keep the newest rows).

Checkpoint: ``config.json`` (Qwen3 fields + ``dflash_config``: ``mask_token_id``,
``target_layer_ids``, ``block_size``) and safetensors with ``fc.weight``, ``hidden_norm.weight``,
``norm.weight`` and ``layers.{i}.{input_layernorm,post_attention_layernorm,self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm,mlp.{gate,up,down}_proj}.weight``. Drafter norms are plain RMSNorm.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from headstart.checkpoint import safetensors_files
from headstart.errors import CheckpointError, ConfigError
from headstart.models.contract import CausalLM
from headstart.ops.attention.reference import attend_block
from headstart.ops.linear import linear
from headstart.ops.pointwise.reference import add_rms_norm, rotate_signed, signed_rotation
from headstart.ops.pointwise.reference import qk_norm_rope as reference_qk_norm_rope
from headstart.ops.triton_support import HAVE_TRITON


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    causal: tuple[bool, ...]  # per layer: causal within the block
    sliding_window: tuple[int, ...]  # per layer: 0 = full attention over the context


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's rule when the list is absent: evenly spaced from layer 1 to L-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


def _read_config(file: str) -> dict:
    try:
        raw = json.loads(Path(file).read_text())
    except FileNotFoundError:
        raise ConfigError("(file)", file, "file not found") from None
    except (OSError, ValueError) as e:
        raise ConfigError("(file)", file, f"cannot be read: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError("(file)", file, "must hold a JSON object")
    return raw


def _causality(raw: dict, dc: dict, types: list[str], layers: int) -> list[bool]:
    # In the order the reference loaders resolve it.
    if "is_causal" in raw:
        return [bool(raw["is_causal"])] * layers
    if "causal" in dc:
        return [bool(dc["causal"])] * layers
    return [t == "sliding_attention" for t in types]


def _positive(src: dict, key: str, file: str, default: int | None = None) -> int:
    """``src[key]`` (``default`` when absent) as a positive integer; ConfigError otherwise."""
    v = src.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(key, file, f"must be a positive integer, got {v!r}")
    return v


def _attention_shape(raw: dict, file: str, target_hidden: int) -> tuple[int, int, int, int]:
    """``(hidden_size, heads, kv_heads, head_dim)``; the hidden size must be the target's, as
    the drafter reads the target's embeddings and feeds its LM head."""
    hidden = _positive(raw, "hidden_size", file)
    if hidden != target_hidden:
        raise ConfigError(
            "hidden_size", file, f"{hidden} differs from the target's {target_hidden}"
        )
    heads = _positive(raw, "num_attention_heads", file)
    kv = _positive(raw, "num_key_value_heads", file)
    if heads % kv:
        raise ConfigError("num_key_value_heads", file, f"{kv} does not divide {heads}")
    return hidden, heads, kv, _positive(raw, "head_dim", file, hidden // heads)


def _target_layer_ids(
    raw: dict, dc: dict, file: str, layers: int, target_layers: int
) -> tuple[int, ...]:
    """The target layers whose hidden states the drafter reads (DFlash's default if unlisted)."""
    ids = dc.get("target_layer_ids")
    if ids is None:
        ids = default_target_layer_ids(
            _positive(raw, "num_target_layers", file, target_layers), layers
        )
    if (
        not isinstance(ids, (list, tuple))
        or not ids
        or not all(isinstance(i, int) and 0 <= i < target_layers for i in ids)
        or len(set(ids)) != len(ids)
    ):
        raise ConfigError(
            "dflash_config.target_layer_ids",
            file,
            f"must be distinct layer indices below {target_layers}, got {ids!r}",
        )
    return tuple(ids)


def _block_tokens(raw: dict, dc: dict, file: str, target_vocab: int) -> tuple[int, int]:
    """``(mask_token_id, block_size)``: the filler of a block's drafted positions, and the
    block's length (the anchor and at least one drafted token)."""
    mask = dc.get("mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < target_vocab:
        raise ConfigError(
            "dflash_config.mask_token_id",
            file,
            f"must be a token id below {target_vocab}, got {mask!r}",
        )
    block = dc.get("block_size", raw.get("block_size", 16))
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise ConfigError("dflash_config.block_size", file, f"must be >= 2, got {block!r}")
    return mask, block


def _layer_types(raw: dict, file: str, layers: int) -> list[str]:
    types = raw.get("layer_types") or ["full_attention"] * layers
    if not isinstance(types, list) or len(types) != layers:
        raise ConfigError("layer_types", file, f"must list {layers} layer types")
    return types


def load_drafter_config(
    path: Path, target_layers: int, target_hidden: int, target_vocab: int
) -> DrafterConfig:
    """The drafter's ``config.json``, checked against its target; ConfigError names the field."""
    file = str(path / "config.json")
    raw = _read_config(file)
    dc = raw.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise ConfigError("dflash_config", file, "must be an object")
    layers = _positive(raw, "num_hidden_layers", file)
    hidden, heads, kv, head_dim = _attention_shape(raw, file, target_hidden)
    ids = _target_layer_ids(raw, dc, file, layers, target_layers)
    mask, block = _block_tokens(raw, dc, file, target_vocab)
    rope = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", rope.get("rope_theta", 1e6) if isinstance(rope, dict) else 1e6)
    types = _layer_types(raw, file, layers)
    window = raw.get("sliding_window") or 0
    return DrafterConfig(
        hidden_size=hidden,
        intermediate_size=_positive(raw, "intermediate_size", file),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        block_size=block,
        mask_token_id=mask,
        target_layer_ids=ids,
        causal=tuple(_causality(raw, dc, types, layers)),
        sliding_window=tuple(int(window) if t == "sliding_attention" else 0 for t in types),
    )


def drafter_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    H, m = cfg.hidden_size, len(cfg.target_layer_ids)
    nh, nkv, hd, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (H, m * H),
        "hidden_norm.weight": (H,),
        "norm.weight": (H,),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (nh * hd, H),
                p + "self_attn.k_proj.weight": (nkv * hd, H),
                p + "self_attn.v_proj.weight": (nkv * hd, H),
                p + "self_attn.o_proj.weight": (H, nh * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, H),
                p + "mlp.up_proj.weight": (inter, H),
                p + "mlp.down_proj.weight": (H, inter),
            }
        )
    return shapes


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMSNorm (the drafter's; no +1), in float32. torch's own: one kernel where it is
    fused (CUDA), not the six of the written-out form; a drafter forward is launch-bound."""
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


def _fuse_projections(weights: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """Each layer's q/k/v projections as one ``qkv_proj`` and gate/up as one ``gate_up_proj``
    (rows stacked in that order; the parts are views of them): one matmul where there were
    three and two, as a drafter forward is launch-bound. Weights without them pass as they
    are."""
    w = dict(weights)
    for i in range(layers):
        p = f"layers.{i}."
        parts = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        if all(k in w for k in parts):
            w[p + "self_attn.qkv_proj.weight"] = torch.cat([w.pop(k) for k in parts])
        parts = [p + f"mlp.{x}_proj.weight" for x in ("gate", "up")]
        if all(k in w for k in parts):
            w[p + "mlp.gate_up_proj.weight"] = torch.cat([w.pop(k) for k in parts])
    return w


@dataclass(frozen=True)
class DrafterOps:
    """The pieces of a proposal forward between its matmuls, with the same signatures on every
    device: the reference (PyTorch) or Triton kernels on a GPU, where a proposal is
    launch-bound (each kernel here replaces several torch ones) and the reference's attention
    reads the whole ring of every stream through a mask."""

    # (x + residual, its plain RMSNorm) of rows [T, H]; the weight as the scale (no +1)
    add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # pointwise.qk_norm_rope
    attend_block: Callable[..., torch.Tensor]  # attention.reference.attend_block


REFERENCE_OPS = DrafterOps(add_rms_norm, reference_qk_norm_rope, attend_block)


def drafter_ops(device: torch.device) -> DrafterOps:
    """Triton's on a CUDA device where Triton is installed, else the reference."""
    if device.type != "cuda" or not HAVE_TRITON:
        return REFERENCE_OPS
    from headstart.ops.attention.triton import block_attention
    from headstart.ops.pointwise import triton as fused

    return DrafterOps(fused.add_rms_norm, fused.qk_norm_rope, block_attention)


@dataclass
class DrafterPool:
    """Per slot: the newest ``window`` context keys/values (post-RoPE) of every drafter layer."""

    keys: torch.Tensor  # [layers, slots, nkv, window, hd]
    values: torch.Tensor
    positions: torch.Tensor  # [slots, window] absolute position of each ring row (-1 = empty)

    @property
    def window(self) -> int:
        return self.keys.shape[3]

    def reset(self, slot: int) -> None:
        self.positions[slot] = -1


class DFlashDrafter:
    def __init__(
        self, cfg: DrafterConfig, weights: dict[str, torch.Tensor], target: CausalLM
    ) -> None:
        self.cfg = cfg
        self.w = _fuse_projections(weights, cfg.num_layers)
        self.target = target
        self.device = target.device
        self.dtype = target.dtype
        hd = cfg.head_dim
        self.inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, hd, 2, device=self.device).float() / hd)
        )
        self.forwards = 0  # proposal forwards run (tests check first-token-first with it)
        self.ops = drafter_ops(self.device)
        self._stack_layers()

    def _stack_layers(self) -> None:
        """Per-layer weights stacked for fewer launches (a round is launch-bound): every layer's
        context k and v rows (a copy of those rows of the qkv weights, small beside the
        target) and k norms, so that a block's context rows take one matmul, one norm and one
        rotation for all layers (:meth:`add_context_rows`); and per layer the q and k norms as
        one row per head, ``[nh + nkv, hd]`` (``ops.qk_norm_rope``). A drafter without weights
        (an oracle that overrides the forward) has none."""
        c, hd, layers = self.cfg, self.cfg.head_dim, range(self.cfg.num_layers)
        qkv = [self.w.get(f"layers.{i}.self_attn.qkv_proj.weight") for i in layers]
        if any(t is None for t in qkv):
            self.context_kv_weight = self.context_k_norm = None
            self.qk_norm = []
            return
        self.context_kv_weight = torch.cat([t[c.num_heads * hd :] for t in qkv])
        self.context_k_norm = torch.stack(
            [self.w[f"layers.{i}.self_attn.k_norm.weight"].float() for i in layers]
        )[:, None]  # [layers, 1, hd]
        self.qk_norm = [
            torch.cat(
                [
                    self.w[f"layers.{i}.self_attn.{x}_norm.weight"].float().expand(heads, hd)
                    for x, heads in (("q", c.num_heads), ("k", c.num_kv_heads))
                ]
            )
            for i in layers
        ]

    @classmethod
    def load(cls, path: str | Path, target: CausalLM) -> DFlashDrafter:
        from safetensors import safe_open

        path = Path(path)
        tc = target.cfg
        cfg = load_drafter_config(path, tc.num_hidden_layers, tc.hidden_size, tc.vocab_size)
        raw: dict[str, torch.Tensor] = {}
        for f in safetensors_files(path):
            try:
                with safe_open(str(f), framework="pt", device="cpu") as st:
                    for k in st.keys():  # noqa: SIM118 - safe_open is not iterable
                        raw[k] = st.get_tensor(k)
            except Exception as e:
                raise CheckpointError(f"{f}: cannot read safetensors file: {e}") from None
        weights = {}
        for name, shape in drafter_shapes(cfg).items():
            if name not in raw:
                raise CheckpointError(f"{path}: drafter tensor '{name}' is missing")
            if tuple(raw[name].shape) != shape:
                raise CheckpointError(
                    f"{path}: drafter tensor '{name}' has shape "
                    f"{tuple(raw[name].shape)}, config implies {shape}"
                )
            t = raw[name]
            weights[name] = (t.float() if name.endswith("norm.weight") else t.to(target.dtype)).to(
                target.device
            )
        return cls(cfg, weights, target)

    def new_pool(self, num_slots: int, window: int) -> DrafterPool:
        c = self.cfg
        shape = (c.num_layers, num_slots, c.num_kv_heads, window, c.head_dim)
        return DrafterPool(
            torch.zeros(shape, dtype=self.dtype, device=self.device),
            torch.zeros(shape, dtype=self.dtype, device=self.device),
            torch.full((num_slots, window), -1, dtype=torch.int64, device=self.device),
        )

    def _rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and signed sin at ``positions`` ``[...]``, as ``[..., 1, head_dim]`` (a
        heads axis to broadcast over), for :func:`rotate_signed`."""
        cos, sin = signed_rotation(positions, self.inv_freq, self.dtype)
        return cos[..., None, :], sin[..., None, :]

    def _context_kv(
        self, u: torch.Tensor, i: int, rotation: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s context keys (normed, rotated) and values ``[..., nkv, hd]`` of the
        fused context rows ``u`` ``[..., H]``: the k and v rows of its qkv projection."""
        c, p = self.cfg, f"layers.{i}.self_attn."
        q_rows = c.num_heads * c.head_dim
        kv = linear(u, self.w[p + "qkv_proj.weight"][q_rows:])
        k, v = kv.view(*u.shape[:-1], 2 * c.num_kv_heads, c.head_dim).chunk(2, dim=-2)
        return rotate_signed(_norm(k, self.w[p + "k_norm.weight"], c.rms_norm_eps), *rotation), v

    @torch.no_grad()
    def add_context(self, pool: DrafterPool, slot: int, features: torch.Tensor, start: int) -> None:
        """Write context rows for positions ``start .. start+n-1`` (``features``: the target's
        tapped hidden states ``[n, m*H]``) into the slot's ring, keeping the newest rows."""
        c, w = self.cfg, self.w
        window = pool.window
        if features.shape[0] > window:
            start += features.shape[0] - window
            features = features[-window:]
        n = features.shape[0]
        if n == 0:
            return
        u = _norm(
            linear(features.to(self.dtype), w["fc.weight"]), w["hidden_norm.weight"], c.rms_norm_eps
        )
        positions = torch.arange(start, start + n, device=self.device)
        rows = positions % window
        rotation = self._rotation(positions)
        for i in range(c.num_layers):
            k, v = self._context_kv(u, i, rotation)
            pool.keys[i, slot][:, rows] = k.transpose(0, 1)
            pool.values[i, slot][:, rows] = v.transpose(0, 1)
        pool.positions[slot, rows] = positions

    @torch.no_grad()
    def add_context_rows(
        self,
        pool: DrafterPool,
        slot_t: torch.Tensor,
        features: torch.Tensor,
        start_t: torch.Tensor,
        count_t: torch.Tensor,
    ) -> None:
        """:meth:`add_context` for ``n`` streams at once from device tensors (no host work:
        what a CUDA graph captures): stream ``j`` writes the first ``count_t[j]`` of its rows
        ``features[j]`` (``[n, B, m*H]``, ``B`` <= the ring's window) for positions
        ``start_t[j] ..`` into ring slot ``slot_t[j]``; its other rows leave the ring as it was.
        """
        c, w = self.cfg, self.w
        n, B = features.shape[:2]
        assert pool.window >= B, "a block's rows must fit the ring"
        u = _norm(
            linear(features.reshape(n * B, -1).to(self.dtype), w["fc.weight"]),
            w["hidden_norm.weight"],
            c.rms_norm_eps,
        )
        positions = start_t[:, None] + torch.arange(B, device=self.device)  # [n, B]
        rows = positions % pool.window
        slots = slot_t[:, None].expand(n, B)
        new = torch.arange(B, device=self.device)[None, :] < count_t[:, None]  # [n, B]
        # All layers at once, [n, B, layers, nkv, hd]: what _context_kv gives layer by layer.
        kv = linear(u, self.context_kv_weight).view(n, B, c.num_layers, 2 * c.num_kv_heads, -1)
        k, v = kv.chunk(2, dim=-2)
        k = F.rms_norm(k.float(), (c.head_dim,), eps=c.rms_norm_eps) * self.context_k_norm
        cos, sin = self._rotation(positions)  # [n, B, 1, hd]
        k = rotate_signed(k.to(self.dtype), cos[:, :, None], sin[:, :, None])
        for ring, rows_new in ((pool.keys, k), (pool.values, v)):
            # ring[:, slots, :, rows] is [n, B, layers, nkv, hd]: rows not written keep theirs.
            old = ring[:, slots, :, rows]
            ring[:, slots, :, rows] = torch.where(new[..., None, None, None], rows_new, old)
        pool.positions[slots, rows] = torch.where(new, positions, pool.positions[slots, rows])

    @torch.no_grad()
    def propose_logits(
        self,
        pool: DrafterPool,
        slots: Sequence[int],
        anchors: Sequence[int],
        positions: Sequence[int],
        block: int,
    ) -> torch.Tensor:
        """Logits ``[n, block-1, vocab]`` for the tokens after each anchor (anchor at
        ``positions[j]``, context already in the ring)."""
        self.forwards += 1
        dev = self.device
        # Before the ring wraps, a stream at position p has context only in rows 0..p-1: the
        # rows past every stream's are left out (read and masked, they cost most of a short
        # context's forward on a CPU), in steps of 64 rows.
        rows = min(pool.window, -(-max(positions, default=1) // 64) * 64)
        return self.propose_from(
            pool,
            torch.tensor(list(slots), device=dev),
            torch.tensor(list(anchors), device=dev),
            torch.tensor(list(positions), device=dev),
            block,
            rows,
        )

    @torch.no_grad()
    def propose_from(
        self,
        pool: DrafterPool,
        slot_t: torch.Tensor,
        anchor_t: torch.Tensor,
        position_t: torch.Tensor,
        block: int,
        rows: int | None = None,
    ) -> torch.Tensor:
        """:meth:`propose_logits` from device tensors, with no host work: what a CUDA graph
        captures (engine/cuda_graph.py DraftGraphs). Not counted in ``forwards``. ``rows``:
        read only the ring's first rows (every stream's context lies in them)."""
        c, w, ops = self.cfg, self.w, self.ops
        n, B = slot_t.shape[0], block
        T, eps = n * B, c.rms_norm_eps
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        ids = torch.full((n, B), c.mask_token_id, dtype=torch.int64, device=self.device)
        ids[:, 0] = anchor_t
        x = self.target.embed(ids.view(-1))  # [T, H]
        pending = None  # the last MLP's output, added to x by the next norm
        masks: dict = {}  # layers of one kind share their mask (reference attention)
        for i in range(c.num_layers):
            p = f"layers.{i}."
            x, a = ops.add_norm(x, pending, w[p + "input_layernorm.weight"], eps)
            qkv = linear(a, w[p + "self_attn.qkv_proj.weight"])  # [T, (nh + 2 nkv) hd]
            q, kb = ops.qk_norm_rope(
                qkv, nh, nkv, self.qk_norm[i], self.inv_freq, position_t, B, eps
            )
            vb = qkv.view(T, nh + 2 * nkv, hd)[:, nh + nkv :]
            o = ops.attend_block(
                q.view(n, B, nh, hd),
                kb.view(n, B, nkv, hd),
                vb.view(n, B, nkv, hd),
                pool.keys[i],
                pool.values[i],
                pool.positions,
                slot_t,
                position_t,
                c.causal[i],
                c.sliding_window[i],
                rows,
                masks,
            )
            attn = linear(o.reshape(T, nh * hd), w[p + "self_attn.o_proj.weight"])
            x, h = ops.add_norm(attn, x, w[p + "post_attention_layernorm.weight"], eps)
            mid = self.target.kernels.silu_mul(linear(h, w[p + "mlp.gate_up_proj.weight"]))
            pending = linear(mid, w[p + "mlp.down_proj.weight"])
        z = ops.add_norm(x, pending, w["norm.weight"], eps)[1].view(n, B, -1)[:, 1:]
        return self.target.lm_head(z.reshape(n * (B - 1), -1)).view(n, B - 1, -1)
