"""The per-row pieces of a layer around its matmuls and mixers: norms, gates, the conv step, RoPE
and the decode rows' attention inputs. Pure PyTorch: the executable spec.

Each function rounds where HF transformers' ``modeling_qwen3_5`` rounds (bf16 activations), and
:mod:`headstart.ops.pointwise.triton` implements the same signatures as single Triton kernels (a
decode step is otherwise a few thousand tiny elementwise launches, ~30% of its time on an H200).
Every size and constant comes in as an argument (no model config is read here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from headstart.ops.conv.reference import causal_conv_step


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm; ``scale`` is the multiplier ``1 + w`` in fp32. Rounds once at the
    end."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale
    return y.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + residual`` (rounded to x's dtype; ``residual`` None: x itself) and its RMSNorm."""
    if residual is not None:
        x = x + residual
    return x, rms_norm(x, scale, eps)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gate_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """GDN output norm per head (plain weight, no +1), then ``* silu(gate)``; rounds twice, as HF
    does. x, gate: [T, H, D] (gate may be a strided view); returns [T, H * D]. ``gate_rows``
    [T] (int): row i takes its gate from ``gate[gate_rows[i]]`` (gate then has any row count)."""
    if gate_rows is not None:
        gate = gate.index_select(0, gate_rows)
    x32 = x.float()
    n = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight.to(x.dtype) * n
    return (y * F.silu(gate.float())).to(x.dtype).reshape(x.shape[0], -1)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's middle: ``[T, 2I]`` (gate | up) -> ``silu(gate) * up`` ``[T, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` (attention's output gate); x [T, F], gate [T, F] or [T, H, F / H]
    (a per-head view of the projection; any strides)."""
    return x * torch.sigmoid(gate).reshape(x.shape)


def gdn_gates(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN's log decay ``g`` (fp32) and write strength ``beta`` (a's dtype) from the raw
    projections a, b [T, Hv]. ``valid`` [T] bool: rows where it is False get ``g = beta = 0``
    (padding rows that leave a state as it was)."""
    g, beta = -A_log.exp() * F.softplus(a.float() + dt_bias), torch.sigmoid(b)
    if valid is None:
        return g, beta
    keep = valid[:, None]
    return torch.where(keep, g, 0.0), torch.where(keep, beta, 0.0)


def conv_step_rows(
    mixed: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    tails: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    width: int = 1,
    row_tails: torch.Tensor | None = None,
) -> torch.Tensor:
    """The GDN conv for one new row of each of n streams: row ``rows[i]`` of ``mixed [T, C]``
    continues the tail ``tails[slots[i]]`` (``[slots, C, K-1]``, updated in place; zeros when
    ``fresh[i]``, whatever the slot held). Returns ``silu(conv)`` [n, C].

    ``width`` > 1: ``width`` rows per stream, stream after stream (``rows`` [n * width]: stream
    ``i``'s rows are ``rows[i * width ..]``, in order; a verify window), computed as that many
    one-row steps; returns [n * width, C] in the same order, the tail after the last row in
    the pool, and with ``row_tails`` [n, width, C, K-1] the tail after each row there."""
    if width > 1 or row_tails is not None:
        n = slots.shape[0]
        kept = torch.zeros(n, dtype=torch.bool, device=fresh.device)
        ys = []
        for t in range(width):
            at = rows.view(n, width)[:, t]
            ys.append(conv_step_rows(mixed, at, weight, tails, slots, fresh if t == 0 else kept))
            if row_tails is not None:
                row_tails[:, t] = tails[slots]
        return torch.stack(ys, 1).flatten(0, 1)
    tail = torch.where(fresh[:, None, None], 0.0, tails[slots])
    y, tails[slots] = causal_conv_step(mixed[rows], tail, weight)
    return y


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class Rotary:
    """Partial rotate-half RoPE on the first ``rotary_dim`` dims of each head."""

    inv_freq: torch.Tensor  # [rotary_dim / 2] fp32

    @classmethod
    def create(cls, rotary_dim: int, theta: float, device: torch.device | str) -> Rotary:
        """``rotary_dim``: the rotated dims of a head (even; ``ModelConfig.rotary_dim``, i.e.
        ``int(head_dim * partial_rotary_factor)``); ``theta``: the RoPE base (``rope_theta``)."""
        rd = rotary_dim
        exponent = torch.arange(0, rd, 2, dtype=torch.int64, device=device).float() / rd
        return cls(1.0 / (theta**exponent))

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rd]
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = cos.shape[-1]
        x_rot, x_pass = x[..., :rd], x[..., rd:]
        return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def attn_decode_inputs(
    qkv: torch.Tensor,
    rows: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Attention inputs of one decode row per stream, from the fused projection ``qkv [T, 2*nh*hd
    + 2*nkv*hd]`` (per query head ``[query | gate]``, then keys, then values): q and k get their
    RMSNorm and RoPE at ``positions``; k and v are written into the pools ``keys``/``values``
    (``[slots, nkv, max_tokens, hd]``) at ``(slots[i], positions[i])``. Returns q
    ``[n, nh, hd]``."""
    q, k, v = decode_qkv(
        qkv[rows], num_heads, num_kv_heads, keys.shape[-1], q_scale, k_scale, eps, inv_freq,
        positions,
    )  # fmt: skip
    keys[slots, :, positions] = k
    values[slots, :, positions] = v
    return q


def decode_qkv(
    x: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`attn_decode_inputs` without the writes: from ``x [n, 2*nh*hd + 2*nkv*hd]`` (the
    rows' fused projection), q [n, nh, hd] and k [n, nkv, hd] normed and rotated at
    ``positions``, and v [n, nkv, hd]."""
    n, hd = x.shape[0], head_dim
    qg, k, v = torch.split(x, [2 * num_heads * hd, num_kv_heads * hd, num_kv_heads * hd], dim=-1)
    q = qg.reshape(n, num_heads, 2 * hd)[..., :hd]
    cos, sin = Rotary(inv_freq).cos_sin(positions, x.dtype)
    q = Rotary.apply(rms_norm(q, q_scale, eps), cos, sin)
    k = Rotary.apply(rms_norm(k.reshape(n, num_kv_heads, hd), k_scale, eps), cos, sin)
    return q, k, v.reshape(n, num_kv_heads, hd)


def signed_rotation(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-head rotate-half RoPE's cos and *signed* sin at ``positions`` ``[...]``, as
    ``[..., head_dim]`` in ``dtype``: the sin's first half is negated, so that
    :func:`rotate_signed` needs no negation (a drafter's RoPE, computed once per forward)."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[..., : freqs.shape[-1]] *= -1
    return emb.cos().to(dtype), sin.to(dtype)


def rotate_signed(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x cos + rotate_half(x) sin`` over whole heads of ``x`` ``[..., head_dim]`` with
    :func:`signed_rotation`'s tables (broadcast over ``x``): rotate_half's halves swapped by a
    flip, its sign in the sin (three kernels, not five: a drafter's forward is launch-bound)."""
    halves = x.unflatten(-1, (2, x.shape[-1] // 2))
    swapped = halves.flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, signed_sin)


def qk_norm_rope(
    qkv: torch.Tensor,
    num_q: int,
    num_k: int,
    weight: torch.Tensor,
    inv_freq: torch.Tensor,
    starts: torch.Tensor,
    block: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafted block's queries and keys from its rows' fused projection ``qkv`` ``[n*block,
    (num_q + 2*num_k) * hd]`` (q heads, k heads, then v heads; row ``b`` of stream ``j`` at
    position ``starts[j] + b``): every q and k head RMSNormed with its row of ``weight``
    ``[num_q + num_k, hd]`` (fp32, plain: no +1), rounded, then rotated over the whole head
    (:func:`rotate_signed`). Returns q ``[T, num_q, hd]`` and k ``[T, num_k, hd]``."""
    T, hd = qkv.shape[0], weight.shape[-1]
    heads = qkv.view(T, -1, hd)[:, : num_q + num_k]
    normed = (F.rms_norm(heads.float(), (hd,), eps=eps) * weight).to(qkv.dtype)
    positions = (starts[:, None] + torch.arange(block, device=starts.device)).reshape(T)
    cos, sin = signed_rotation(positions, inv_freq, qkv.dtype)
    out = rotate_signed(normed, cos[:, None], sin[:, None])
    return out[:, :num_q], out[:, num_q:]
