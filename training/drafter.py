"""Training a DFlash block drafter against a frozen Qwen3.5 target, saving it, measuring it.

Job: the trainable twin of :class:`headstart.engine.spec.drafter.DFlashDrafter` (same tensor
names, same math), the DFlash training recipe (random
anchors, blocks ``[x_a, MASK x (B-1)]`` that see the target's tapped features of positions
before the anchor, same-position cross-entropy with decaying position weights), a checkpoint
writer whose output ``DFlashDrafter.load`` reads, and an acceptance measurement that drives
headstart's own engine.

Non-goals: flex-attention / fused kernels (attention uses an explicit boolean mask, fine at the
sizes trained here), offline feature caches, KD on target logits, multi-GPU, data preparation
(the caller hands in token batches; see :func:`as_batch`).

Layout of one training forward (per sequence of ``T`` tokens and ``K`` anchors, block ``Bs``):
context keys/values come from ``hidden_norm(fc(features))`` of all ``T`` positions; each block's
queries attend to the context rows strictly before its anchor and to the rows of its own block,
never to other blocks. Scores are computed as [context | own block] per block, so the cost is
``K * Bs * (T + Bs)`` rather than ``(K * Bs)^2``.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from headstart.engine.spec.drafter import (
    DrafterConfig,
    default_target_layer_ids,
    drafter_shapes,
    load_drafter_config,
)
from training.target import optimizer_step

logger = logging.getLogger("training.drafter")

__all__ = [
    "TrainBatch",
    "TrainableDrafter",
    "as_batch",
    "block_inputs",
    "block_targets",
    "chunked_loss",
    "default_gamma",
    "drafter_config_json",
    "evaluate_acceptance",
    "loss_fn",
    "make_drafter_config",
    "position_weights",
    "sample_anchors",
    "save_drafter_checkpoint",
    "tapped_features",
    "train_drafter",
]

LMHead = Callable[[torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


def make_drafter_config(
    target_config,
    *,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: Sequence[int] | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    rope_theta: float = 1e7,
    causal: bool = False,
) -> DrafterConfig:
    """A full-attention drafter config for a transformers target config (Qwen3.5 text config).

    Geometry defaults to the target's attention geometry; taps default to DFlash's rule."""
    L = target_config.num_hidden_layers
    ids = (
        tuple(target_layer_ids)
        if target_layer_ids is not None
        else default_target_layer_ids(L, num_layers)
    )
    return DrafterConfig(
        hidden_size=target_config.hidden_size,
        intermediate_size=intermediate_size or target_config.intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads or target_config.num_attention_heads,
        num_kv_heads=num_kv_heads or target_config.num_key_value_heads,
        head_dim=head_dim or target_config.head_dim,
        rms_norm_eps=float(target_config.rms_norm_eps),
        rope_theta=float(rope_theta),
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=ids,
        causal=(causal,) * num_layers,
        sliding_window=(0,) * num_layers,
    )


# ----------------------------------------------------------------------------------------------
# The module
# ----------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Plain RMSNorm (``x / rms * w``, no ``1 + w``), in fp32, cast back: the drafter's norm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return y.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE over the whole head. ``x``: ``[..., heads, hd]``; ``positions``: ``[...]``.

    The inverse frequencies are rebuilt per call in fp32 (a module buffer would be cast along
    with the weights by ``.to(bfloat16)``, which changes the angles)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device).float() / hd))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]  # broadcast over heads
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def _linear(inp: int, out: int) -> nn.Linear:
    return nn.Linear(inp, out, bias=False)


class DrafterAttention(nn.Module):
    """Block queries over [context K/V (shared projections) ; own-block K/V]."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.nh, self.nkv, self.hd, self.theta = nh, nkv, hd, cfg.rope_theta
        self.q_proj, self.k_proj = _linear(H, nh * hd), _linear(H, nkv * hd)
        self.v_proj, self.o_proj = _linear(H, nkv * hd), _linear(nh * hd, H)
        self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps), RMSNorm(hd, cfg.rms_norm_eps)

    def context_kv(
        self, u: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the fused context ``u`` ``[N, T, H]``: the same k_proj/v_proj/k_norm as
        the block rows (DFlash's KV injection), RoPE at the context positions."""
        N, T, _ = u.shape
        k = self.k_norm(self.k_proj(u).view(N, T, self.nkv, self.hd))
        v = self.v_proj(u).view(N, T, self.nkv, self.hd)
        return apply_rope(k, positions, self.theta), v

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        ctx_allowed: torch.Tensor,
        blk_allowed: torch.Tensor,
    ) -> torch.Tensor:
        """x: ``[N, K, Bs, H]`` block rows at ``positions`` ``[N, K, Bs]``; kc, vc:
        ``[N, T, nkv, hd]``; ctx_allowed: ``[N, K, Bs, T]``; blk_allowed: ``[Bs, Bs]``."""
        N, K, Bs, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        g = nh // nkv
        # q/k norm before RoPE (Qwen3 order); V is not normed.
        q = apply_rope(self.q_norm(self.q_proj(x).view(N, K, Bs, nh, hd)), positions, self.theta)
        kb = apply_rope(self.k_norm(self.k_proj(x).view(N, K, Bs, nkv, hd)), positions, self.theta)
        vb = self.v_proj(x).view(N, K, Bs, nkv, hd)
        # GQA: query head h reads kv head h // g (same grouping as headstart's propose_logits).
        q = q.view(N, K, Bs, nkv, g, hd)
        s_ctx = torch.einsum("nkbhgd,nthd->nhgkbt", q, kc)
        s_blk = torch.einsum("nkbhgd,nkchd->nhgkbc", q, kb)
        T = kc.shape[1]
        scores = torch.cat([s_ctx, s_blk], dim=-1).float() * hd**-0.5
        allowed = torch.cat([ctx_allowed, blk_allowed.expand(N, K, Bs, Bs)], dim=-1)
        probs = scores.masked_fill(~allowed[:, None, None], float("-inf")).softmax(-1)
        probs = probs.to(vc.dtype)
        o = torch.einsum("nhgkbt,nthd->nkbhgd", probs[..., :T], vc) + torch.einsum(
            "nhgkbc,nkchd->nkbhgd", probs[..., T:], vb
        )
        return self.o_proj(o.reshape(N, K, Bs, nh * hd))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        H, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj = _linear(H, inter), _linear(H, inter)
        self.down_proj = _linear(inter, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)
        self.causal = cfg.causal[index]
        self.window = cfg.sliding_window[index]


class TrainableDrafter(nn.Module):
    """The DFlash drafter as trainable parameters; ``state_dict()`` keys equal
    :func:`headstart.engine.spec.drafter.drafter_shapes` names (``fc.weight``,
    ``layers.0.self_attn.q_proj.weight``, ...). It owns no embedding and no head: the target's
    are passed in."""

    def __init__(self, cfg: DrafterConfig, *, init_std: float = 0.02, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        H, m = cfg.hidden_size, len(cfg.target_layer_ids)
        self.fc = _linear(m * H, H)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.reset_parameters(init_std, seed)

    def reset_parameters(self, std: float, seed: int) -> None:
        """Norms to one, projections N(0, std^2), from a private generator (reproducible, and
        leaves the global RNG alone)."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _name, p in self.named_parameters():
                if p.ndim == 1:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, target_layers: int, target_hidden: int, target_vocab: int
    ) -> TrainableDrafter:
        """Load a DFlash checkpoint (ours or a released one) to continue training it."""
        from safetensors.torch import load_file

        from headstart.checkpoint import safetensors_files

        cfg = load_drafter_config(Path(path), target_layers, target_hidden, target_vocab)
        model = cls(cfg)
        state: dict[str, torch.Tensor] = {}
        for f in safetensors_files(Path(path)):
            state.update(load_file(str(f)))
        model.load_state_dict({k: state[k].float() for k in drafter_shapes(cfg)})
        return model

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(features))``: ``[N, T, m*H]`` -> ``[N, T, H]``."""
        return self.hidden_norm(self.fc(features))

    def forward(
        self,
        features: torch.Tensor,
        block_embeds: torch.Tensor,
        anchors: torch.Tensor,
        ctx_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[N, K, Bs-1, H]`` of rows 1..Bs-1 of every block.

        features: ``[N, T, m*H]`` the target's tapped hidden states of positions ``0..T-1``;
        block_embeds: ``[N, K, Bs, H]`` target embeddings of ``[x_a, MASK x (Bs-1)]``;
        anchors: ``[N, K]`` anchor positions ``a`` (block row j sits at ``a + j``);
        ctx_valid: ``[N, T]`` bool, False for padding rows (default: all valid)."""
        N, T, _ = features.shape
        K, Bs = block_embeds.shape[1], block_embeds.shape[2]
        dev = features.device
        ctx_pos = torch.arange(T, device=dev).expand(N, T)
        pos = anchors[..., None] + torch.arange(Bs, device=dev)  # [N, K, Bs]
        if ctx_valid is None:
            ctx_valid = torch.ones(N, T, dtype=torch.bool, device=dev)
        # Context rows strictly before the anchor: at inference the anchor's own features do
        # not exist yet (it is not in the target cache when the drafter runs).
        before = ctx_pos[:, None, :] < anchors[..., None]  # [N, K, T]
        ctx_base = (before & ctx_valid[:, None, :])[:, :, None, :].expand(N, K, Bs, T)
        j = torch.arange(Bs, device=dev)
        u = self.fuse_context(features)
        x = block_embeds
        for layer in self.layers:
            ctx_ok, blk_ok = ctx_base, torch.ones(Bs, Bs, dtype=torch.bool, device=dev)
            if layer.causal:
                blk_ok = j[None, :] <= j[:, None]
            if layer.window:
                ctx_ok = ctx_ok & ((pos[..., None] - ctx_pos[:, None, None, :]) < layer.window)
                blk_ok = blk_ok & ((j[:, None] - j[None, :]) < layer.window)
            attn = layer.self_attn
            kc, vc = attn.context_kv(u, ctx_pos)
            x = x + attn(layer.input_layernorm(x), pos, kc, vc, ctx_ok, blk_ok)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x[:, :, 1:])

    def block_logits(
        self,
        features: torch.Tensor,
        block_embeds: torch.Tensor,
        anchors: torch.Tensor,
        lm_head: LMHead,
        ctx_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[N, K, Bs-1, V]`` through the target's head (row j predicts ``x_{a+j}``)."""
        return lm_head(self(features, block_embeds, anchors, ctx_valid))


# ----------------------------------------------------------------------------------------------
# Blocks, targets, loss
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainBatch:
    """input_ids ``[N, T]`` (right-padded); valid: real tokens; loss_mask: tokens to predict
    (e.g. assistant turns), a subset of valid. Anchors are drawn from loss_mask positions."""

    input_ids: torch.Tensor
    valid: torch.Tensor
    loss_mask: torch.Tensor


def as_batch(item: torch.Tensor | Mapping | Sequence[Sequence[int]]) -> TrainBatch:
    """Accept what a data pipeline yields: an id tensor ``[N, T]`` (all tokens real and
    trained), a list of equal-length id lists, or a mapping with ``input_ids`` and optional
    ``attention_mask`` / ``loss_mask`` (1 = yes)."""
    if isinstance(item, Mapping):
        ids = torch.as_tensor(item["input_ids"], dtype=torch.int64)
        valid = torch.as_tensor(item.get("attention_mask", torch.ones_like(ids))).bool()
        loss = torch.as_tensor(item.get("loss_mask", valid)).bool() & valid
        return TrainBatch(ids, valid, loss)
    ids = torch.as_tensor(item, dtype=torch.int64)
    if ids.dim() != 2:
        raise ValueError(f"token batches must be [N, T], got shape {tuple(ids.shape)}")
    ones = torch.ones_like(ids, dtype=torch.bool)
    return TrainBatch(ids, ones, ones)


def sample_anchors(
    loss_mask: torch.Tensor, valid: torch.Tensor, num: int, block: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``num`` distinct anchors per sequence, uniform over trained positions ``a >= 1``
    with room for a whole block (``a + Bs - 1 < length``); short sequences fall back to any
    ``a`` with at least one target. Returns (anchors ``[N, num]``, usable ``[N, num]``)."""
    N, T = valid.shape
    lengths = valid.sum(1)
    anchors = torch.zeros(N, num, dtype=torch.int64)
    ok = torch.zeros(N, num, dtype=torch.bool)
    pos = torch.arange(T)
    for n in range(N):
        # a >= 1: at inference the anchor follows at least one committed (prompt) token.
        cand = loss_mask[n].cpu() & (pos >= 1)
        roomy = cand & (pos + block - 1 < lengths[n].cpu())
        pool = roomy if roomy.any() else cand & (pos + 1 < lengths[n].cpu())
        where = pool.nonzero().flatten()
        if where.numel() == 0:
            continue
        pick = where[torch.randperm(where.numel(), generator=generator)[:num]].sort().values
        anchors[n, : pick.numel()] = pick
        ok[n, : pick.numel()] = True
    return anchors, ok


def block_inputs(
    input_ids: torch.Tensor, anchors: torch.Tensor, block: int, mask_token_id: int
) -> torch.Tensor:
    """Block token ids ``[N, K, Bs]``: ``[x_a, MASK x (Bs-1)]``."""
    N, K = anchors.shape
    ids = torch.full((N, K, block), mask_token_id, dtype=torch.int64, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, anchors.to(input_ids.device))
    return ids


def block_targets(
    batch: TrainBatch, anchors: torch.Tensor, anchor_ok: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels: row k (1..Bs-1) of the block at ``a`` targets ``x_{a+k}``.
    Returns (targets ``[N, K, Bs-1]``, mask) with positions past the sequence, untrained
    tokens and unusable anchors masked out."""
    T = batch.input_ids.shape[1]
    pos = anchors[..., None] + torch.arange(1, block)  # [N, K, Bs-1]
    inside = pos < T
    safe = pos.clamp(max=T - 1)
    flat = safe.flatten(1)
    targets = batch.input_ids.cpu().gather(1, flat).view_as(pos)
    trained = batch.loss_mask.cpu().gather(1, flat).view_as(pos)
    return targets, inside & trained & anchor_ok[..., None]


def default_gamma(block: int) -> float:
    """Position-weight decay: 7 for Bs=16 and 4 for Bs=8 (DFlash paper); otherwise ~Bs/2."""
    return {16: 7.0, 8: 4.0}.get(block, max(1.0, block / 2))


def position_weights(block: int, gamma: float) -> torch.Tensor:
    """``w_k = exp(-(k-1)/gamma)`` for rows k = 1..Bs-1: early rows matter most, because a
    draft is only useful up to its first miss."""
    return torch.exp(-torch.arange(block - 1, dtype=torch.float32) / gamma)


def loss_fn(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """``sum(w * CE) / sum(w)`` over unmasked rows; logits ``[..., Bs-1, V]``."""
    w = position_weights(logits.shape[-2] + 1, gamma).to(logits.device) * mask.to(logits.device)
    ce = F.cross_entropy(
        logits.float().flatten(0, -2), targets.to(logits.device).flatten(), reduction="none"
    ).view_as(w)
    return (w * ce).sum() / w.sum().clamp(min=1e-12)


def _weighted_ce_sum(
    z: torch.Tensor, targets: torch.Tensor, w: torch.Tensor, lm_head: LMHead
) -> torch.Tensor:
    return (w * F.cross_entropy(lm_head(z).float(), targets, reduction="none")).sum()


def chunked_loss(
    hidden: torch.Tensor,
    lm_head: LMHead,
    targets: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    chunk_rows: int = 4096,
) -> torch.Tensor:
    """:func:`loss_fn` of ``lm_head(hidden)`` without holding all logits: only weighted rows go
    through the head, in chunks whose logits are recomputed in backward (a Qwen3.5 vocabulary
    is 248k wide; K blocks x 15 rows of it would not fit)."""
    Bs = hidden.shape[-2] + 1
    w = position_weights(Bs, gamma).to(hidden.device) * mask.to(hidden.device)
    keep = w.flatten() > 0
    z = hidden.flatten(0, -2)[keep]
    t = targets.to(hidden.device).flatten()[keep]
    wk = w.flatten()[keep]
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, z.shape[0], chunk_rows):
        part = (z[s : s + chunk_rows], t[s : s + chunk_rows], wk[s : s + chunk_rows])
        if torch.is_grad_enabled() and z.requires_grad:
            total = total + checkpoint(_weighted_ce_sum, *part, lm_head, use_reentrant=False)
        else:
            total = total + _weighted_ce_sum(*part, lm_head)
    return total / w.sum().clamp(min=1e-12)


# ----------------------------------------------------------------------------------------------
# The target side (a transformers Qwen3_5ForCausalLM, frozen)
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def tapped_features(
    target_model, input_ids: torch.Tensor, layer_ids: Sequence[int]
) -> torch.Tensor:
    """``[N, T, m*H]``: the outputs of target decoder layers ``layer_ids`` (HF
    ``hidden_states[i+1]``; index 0 is the embeddings), concatenated in that order. This is what
    headstart's ``forward_ex(taps=...)`` feeds the drafter at inference.

    Runs the base model only (no ``[N, T, V]`` logits). Right padding needs no attention mask:
    the target is causal, so real rows never see the padding after them. A target that has its
    own ``tapped_features(input_ids, layer_ids)`` (``training.selfdistill.HeadstartTarget``: a
    headstart-loaded model) is asked for them instead."""
    L = target_model.config.num_hidden_layers
    if max(layer_ids) >= L - 1:
        # HF replaces hidden_states[-1] with the final-normed state; headstart taps pre-norm.
        raise ValueError(f"tapping the last target layer ({L - 1}) is not supported")
    own = getattr(target_model, "tapped_features", None)
    if own is not None:
        return own(input_ids, layer_ids)
    base = getattr(target_model, "model", target_model)
    out = base(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def _target_head(target_model) -> LMHead:
    """The target's output head with its weight detached: gradients flow to the drafter's
    hidden states, never into (or accumulate on) the frozen target."""
    head = target_model.get_output_embeddings()
    weight = head.weight.detach()
    bias = head.bias.detach() if getattr(head, "bias", None) is not None else None
    return lambda z: F.linear(z.to(weight.dtype), weight, bias)


def _lr_scale(progress: float, warmup: float) -> float:
    """Linear warmup over the first ``warmup`` of training, then cosine to zero."""
    if progress < warmup:
        return max(progress / warmup, 1e-3)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No decay on norm weights (1-D): decay would pull their scale towards zero."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    plain = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def _step_loss(
    drafter: TrainableDrafter,
    target_model,
    batch: TrainBatch,
    anchors: torch.Tensor,
    anchor_ok: torch.Tensor,
    *,
    head: LMHead,
    gamma: float,
    device: torch.device,
    chunk_rows: int,
) -> torch.Tensor:
    cfg, Bs = drafter.cfg, drafter.cfg.block_size
    tdev = next(target_model.parameters()).device
    ids = batch.input_ids.to(tdev)
    feats = tapped_features(target_model, ids, cfg.target_layer_ids).to(device)
    with torch.no_grad():
        embeds = target_model.get_input_embeddings()(
            block_inputs(ids, anchors.to(tdev), Bs, cfg.mask_token_id)
        ).to(device)
    targets, mask = block_targets(batch, anchors, anchor_ok, Bs)
    hidden = drafter(feats.float(), embeds.float(), anchors.to(device), batch.valid.to(device))
    return chunked_loss(hidden, head, targets.to(device), mask.to(device), gamma, chunk_rows)


def train_drafter(
    target_model,
    token_batches: Iterable,
    cfg: DrafterConfig,
    *,
    steps: int | None = None,
    time_budget_s: float = float("inf"),
    lr: float = 6e-4,
    anchors_per_seq: int = 32,
    gamma: float | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    log_every: int = 50,
    seed: int = 0,
    weight_decay: float = 0.01,
    warmup: float = 0.04,
    grad_clip: float = 1.0,
    chunk_rows: int = 4096,
    init: TrainableDrafter | None = None,
    history: list[float] | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainableDrafter:
    """Train a drafter for ``target_model`` (transformers ``Qwen3_5ForCausalLM``, or a
    headstart model wrapped in ``training.selfdistill.HeadstartTarget``; already on its
    device; used frozen in eval mode, its parameters are not modified).

    token_batches yields what :func:`as_batch` accepts; training stops after ``steps``, at the
    time budget, or when the iterable ends (pass an endless one to train by time). The warmup +
    cosine schedule runs over whichever limit is nearer: progress = max(step / steps, elapsed /
    budget). AdamW (betas 0.9/0.95), gradient clipping. Parameters are fp32; ``dtype``
    bf16/fp16 runs the forwards under autocast. Deterministic for a given ``seed`` when the time
    budget does not bind. Per-step losses are appended to ``history``; progress lines go to
    ``log`` (default: this module's logger at INFO) every ``log_every`` steps (0: never)."""
    if steps is None and not math.isfinite(time_budget_s):
        raise ValueError("give steps or a finite time_budget_s")
    device = torch.device(device)
    Bs = cfg.block_size
    gamma = default_gamma(Bs) if gamma is None else gamma
    torch.manual_seed(seed)  # dropout-free, but keeps any stray RNG use reproducible
    gen = torch.Generator().manual_seed(seed)
    drafter = (init if init is not None else TrainableDrafter(cfg, seed=seed)).to(device).train()
    was_training = target_model.training
    target_model.eval()
    head = _target_head(target_model)
    opt = torch.optim.AdamW(_param_groups(drafter, weight_decay), lr=lr, betas=(0.9, 0.95))
    amp = {"device_type": device.type, "dtype": dtype, "enabled": dtype != torch.float32}
    say = log or logger.info
    start, step, recent = time.perf_counter(), 0, []
    try:
        for item in token_batches:
            elapsed = time.perf_counter() - start
            if (steps is not None and step >= steps) or elapsed >= time_budget_s:
                break
            # A wall-clock schedule needs no step estimate and still ends its cosine on time.
            progress = elapsed / time_budget_s if math.isfinite(time_budget_s) else 0.0
            if steps:
                progress = max(progress, step / steps)
            for group in opt.param_groups:
                group["lr"] = lr * _lr_scale(progress, warmup)
            batch = as_batch(item)
            anchors, ok = sample_anchors(batch.loss_mask, batch.valid, anchors_per_seq, Bs, gen)
            if not ok.any():  # nothing trainable in this batch (all too short / unmasked)
                continue
            with torch.autocast(**amp):
                loss = _step_loss(
                    drafter,
                    target_model,
                    batch,
                    anchors,
                    ok,
                    head=head,
                    gamma=gamma,
                    device=device,
                    chunk_rows=chunk_rows,
                )
            optimizer_step(drafter.parameters(), opt, loss, grad_clip)
            step += 1
            value = float(loss.detach())
            recent.append(value)
            if history is not None:
                history.append(value)
            if log_every and (step % log_every == 0 or step == 1):
                say(
                    f"drafter step {step} loss {sum(recent) / len(recent):.4f} "
                    f"lr {opt.param_groups[0]['lr']:.2e} ({time.perf_counter() - start:.0f}s)"
                )
                recent = []
    finally:
        target_model.train(was_training)
    if log_every:
        say(f"drafter: {step} steps in {time.perf_counter() - start:.0f}s")
    return drafter.eval()


# ----------------------------------------------------------------------------------------------
# Checkpoint
# ----------------------------------------------------------------------------------------------


def _causality_fields(cfg: DrafterConfig, types: list[str]) -> dict:
    """Config fields that make headstart's resolver return ``cfg.causal`` exactly."""
    if list(cfg.causal) == [t == "sliding_attention" for t in types]:
        return {}  # the per-layer-type default already says it
    if len(set(cfg.causal)) == 1:
        return {"is_causal": cfg.causal[0]}
    raise ValueError(
        "per-layer causality that differs from the layer types' default cannot be "
        "expressed in a DFlash config"
    )


def drafter_config_json(
    cfg: DrafterConfig, *, num_target_layers: int | None = None, vocab_size: int | None = None
) -> dict:
    types = ["sliding_attention" if w else "full_attention" for w in cfg.sliding_window]
    windows = {w for w in cfg.sliding_window if w}
    if len(windows) > 1:
        raise ValueError(f"one sliding window size per checkpoint, got {sorted(windows)}")
    raw: dict = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "layer_types": types,
        "sliding_window": windows.pop() if windows else None,
        "tie_word_embeddings": False,
        "block_size": cfg.block_size,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            "block_size": cfg.block_size,
        },
    }
    if num_target_layers is not None:
        raw["num_target_layers"] = num_target_layers
    if vocab_size is not None:
        raw["vocab_size"] = vocab_size
    raw.update(_causality_fields(cfg, types))
    return raw


def save_drafter_checkpoint(
    drafter: TrainableDrafter,
    cfg: DrafterConfig,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    num_target_layers: int | None = None,
    vocab_size: int | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (tensors in ``dtype``) in the DFlash format
    that ``headstart.engine.spec.drafter.DFlashDrafter.load(out_dir, target)`` reads."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    state = drafter.state_dict()
    shapes = drafter_shapes(cfg)
    if set(state) != set(shapes):
        raise ValueError(
            f"drafter tensors do not match the config: {sorted(set(state) ^ set(shapes))}"
        )
    tensors = {k: state[k].detach().to("cpu", dtype).contiguous() for k in shapes}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = drafter_config_json(cfg, num_target_layers=num_target_layers, vocab_size=vocab_size)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


# ----------------------------------------------------------------------------------------------
# Acceptance, measured with headstart's engine
# ----------------------------------------------------------------------------------------------


def _run_engine(engine, prompts: list[list[int]], params) -> tuple[list[list[int]], float]:
    """One request at a time (batch-1 decode, where DFlash pays off): tokens and wall time."""
    import threading

    from headstart.engine.engine import EngineRequest, Failed, Finish, Piece

    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        tokens: list[int] = []
        done = threading.Event()
        failure: list[str | None] = []  # the final event: None (finished) or why it failed

        def sink(ev, tokens=tokens, done=done, failure=failure) -> None:
            if isinstance(ev, Piece):
                tokens.append(ev.token_id)
            elif isinstance(ev, (Finish, Failed)):
                failure.append(ev.message if isinstance(ev, Failed) else None)
                done.set()

        engine.submit(EngineRequest(f"eval-{i}", list(ids), params, params.max_tokens, sink))
        if not done.wait(600):
            raise TimeoutError(f"prompt {i} did not finish")
        if failure[0] is not None:
            raise RuntimeError(f"prompt {i} failed: {failure[0]}")
        outputs.append(tokens)
    return outputs, time.perf_counter() - t0


def evaluate_acceptance(
    target_dir: str | Path,
    drafter_dir: str | Path,
    prompts: list[list[int]],
    max_tokens: int,
    block: int | None = None,
    *,
    tokenizer=None,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    spec_mode: str = "chain",
    strict: bool = True,
    cpu_programs: bool = False,
    whole_rounds: bool = True,
    threads=None,
    pairs: int = 1,
) -> dict:
    """Greedy decode of ``prompts`` with and without the drafter through headstart's Engine.

    Returns ``mean_accepted_length`` (tokens per verify round = accepted drafts / rounds + 1),
    ``rounds``, ``drafted``, ``accepted``, wall times ``plain_s`` / ``spec_s``, ``speedup``
    (plain_s / spec_s), ``mismatches`` (prompts whose outputs differ). Greedy speculative
    decoding is exact, so with ``strict`` any mismatch raises AssertionError; in bf16 near-tie
    argmaxes may legitimately flip (dflash.md 2.4), hence the switch. Generation ignores EOS so
    both runs produce exactly ``max_tokens`` per prompt. ``cpu_programs``: both engines step
    from compiled CPU programs, as ``serve`` does on a CPU once they are cached.
    ``whole_rounds``: on a GPU, greedy rounds run whole on the device (engine/spec/round.py);
    False keeps them on the host (proposal, window and verdict apart). ``threads``: an
    ``engine.config.ThreadConfig`` for the engines' forwards on a CPU (``serve`` sets one:
    decode steps on every core but one); None leaves torch's setting as it is, which on the
    engine's own thread can make steps several times slower than served ones. ``pairs``: both
    engines are kept and the prompts run on each in turn this many times (plain, drafting,
    plain, ...); ``plain_s``, ``spec_s`` and ``speedup`` are then medians over the pairs
    (``pair_speedups``: each pair's), which a machine's drift between two single runs (on a
    2-core VM, about 10%) moves much less; the drafting counts are the first pass's."""
    from headstart.engine.config import EngineConfig, GraphConfig, SpecConfig
    from headstart.engine.engine import Engine
    from headstart.engine.spec.drafter import DFlashDrafter
    from headstart.models.qwen35.model import Qwen35Model
    from headstart.sampling import SamplingParams
    from headstart.tokenizer import Tokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = Qwen35Model.load(target_dir, dtype=dtype, device=device)
    drafter = DFlashDrafter.load(drafter_dir, target)
    block = block or drafter.cfg.block_size
    tok = tokenizer if tokenizer is not None else Tokenizer.from_dir(target_dir)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    context = max(len(p) for p in prompts) + max_tokens + block + 1

    def make(d: DFlashDrafter | None) -> Engine:
        spec = SpecConfig(draft_block=block, mode=spec_mode)  # used only with a drafter
        config = EngineConfig(
            1,
            context,
            spec=spec,
            cpu_programs=cpu_programs,
            graphs=GraphConfig(rounds=whole_rounds),
            threads=threads,
        )
        e = Engine(target, tok, (), config, drafter=d)
        e.start()
        return e

    plain_times, spec_times, mismatches = [], [], []
    plain_engine = make(None)
    try:
        spec_engine = make(drafter)
        try:
            for n in range(pairs):
                plain, plain_s = _run_engine(plain_engine, prompts, params)
                spec, spec_s = _run_engine(spec_engine, prompts, params)
                plain_times.append(plain_s)
                spec_times.append(spec_s)
                pairs_of = enumerate(zip(plain, spec, strict=True))
                mismatches += [i for i, (a, b) in pairs_of if a != b and i not in mismatches]
                if n == 0:
                    stats = spec_engine.stats()
        finally:
            spec_engine.stop()
    finally:
        plain_engine.stop()
    if strict and mismatches:
        i = mismatches[0]
        raise AssertionError(
            f"{len(mismatches)} prompt(s) decode differently with the drafter; "
            f"prompt {i}: plain {plain[i]} vs speculative {spec[i]}"
        )
    rounds = stats["spec_rounds"]
    plain_s, spec_s = statistics.median(plain_times), statistics.median(spec_times)
    ratios = [a / b for a, b in zip(plain_times, spec_times, strict=True)]
    return {
        "mean_accepted_length": stats["spec_accepted"] / rounds + 1 if rounds else 0.0,
        "rounds": rounds,
        "drafted": stats["spec_drafted"],
        "accepted": stats["spec_accepted"],
        "tokens": sum(len(t) for t in spec),
        "plain_s": plain_s,
        "spec_s": spec_s,
        "speedup": statistics.median(ratios) if pairs > 1 else ratios[0],
        "pair_speedups": ratios,
        "mismatches": len(mismatches),
        "block": block,
        "spec_mode": spec_mode,
    }
