"""Nemotron-H's Mamba2 mixer core in PyTorch: the spec future kernels are tested against.

The mixer, for one sequence of hidden rows ``u [T, hidden]`` (projections outside these ops)::

    z, xBC, dt_raw = split_projection(in_proj(u))       # [T, H*P], [T, H*P + 2*G*N], [T, H]
    xBC, tail      = causal_conv_bias(xBC, tail, w, b)  # depthwise causal conv + bias, then SiLU
    x, B, C        = split_xbc(xBC)                     # [T, H, P], [T, G, N], [T, G, N]
    dt             = mamba_dt(dt_raw, dt_bias, limit)   # softplus(dt_raw + dt_bias), clamped
    y, state       = ssd_chunked(x, dt, -exp(A_log), B, C, D, state)
    out            = out_proj(gated_group_rms_norm(y.reshape(T, H*P), z, norm_w, eps, G))

The SSD recurrence, per head ``h`` (state ``S [P, N]`` in fp32), with head ``h`` reading B/C
group ``h // (H // G)``::

    S_t = exp(dt_t * A) * S_{t-1} + (dt_t * x_t) ⊗ B_t;   y_t = S_t C_t + D * x_t

Layouts (Hugging Face's and mamba_ssm's): the in-projection's output is ``[z | xBC | dt]``;
``xBC`` is ``[x | B | C]``, x head-major (``x[h*P + p]``), B and C group-major (``B[g*N + n]``).
The gated norm's groups are contiguous slices of ``H*P`` of ``H*P/G`` channels, so norm group
``g`` covers exactly the heads that read B/C group ``g``.

Precision: every form computes in fp32 and keeps states in fp32; the conv returns rows in its
input's dtype (its tail holds exact copies of pre-conv rows), the rest return fp32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

NO_LIMIT: tuple[float, float] = (0.0, math.inf)


def split_projection(
    proj: torch.Tensor, heads: int, head_dim: int, groups: int, state_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the in-projection's output ``[..., 2*H*P + 2*G*N + H]`` into
    (z [..., H*P], xBC [..., H*P + 2*G*N], dt_raw [..., H]), views of ``proj``."""
    inner = heads * head_dim
    conv_dim = inner + 2 * groups * state_size
    if proj.shape[-1] != inner + conv_dim + heads:
        raise ValueError(f"projection width {proj.shape[-1]} != {inner + conv_dim + heads}")
    z, xbc, dt = proj.split([inner, conv_dim, heads], dim=-1)
    return z, xbc, dt


def split_xbc(
    xbc: torch.Tensor, heads: int, head_dim: int, groups: int, state_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the conv's output ``[..., H*P + 2*G*N]`` into (x [..., H, P], B [..., G, N],
    C [..., G, N])."""
    lead = xbc.shape[:-1]
    gn = groups * state_size
    x, B, C = xbc.split([heads * head_dim, gn, gn], dim=-1)
    return (
        x.reshape(*lead, heads, head_dim),
        B.reshape(*lead, groups, state_size),
        C.reshape(*lead, groups, state_size),
    )


def mamba_dt(
    dt_raw: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float] = NO_LIMIT
) -> torch.Tensor:
    """``clamp(softplus(dt_raw + dt_bias), *limit)`` in fp32. dt_raw: [..., H]; dt_bias: [H].

    ``F.softplus``'s default threshold (identity above 20) is mamba_ssm's too. The default limit
    ``(0, inf)`` is a no-op (softplus is positive), which is what mamba_ssm's kernels and NVIDIA's
    own modeling code do with the checkpoints' ``time_step_limit``. Note: transformers 5.17's
    NemotronHMamba2Mixer ignores ``config.time_step_limit`` and clamps its chunked (prefill)
    path with ``(config.time_step_min, inf)`` (0.001 by default), while its one-token decode
    path does not clamp at all; pass ``(time_step_min, inf)`` to reproduce its prefill.
    """
    dt = F.softplus(dt_raw.float() + dt_bias.float())
    return dt.clamp(min=limit[0], max=limit[1])


def causal_conv_bias(
    x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: depthwise causal conv with bias, then SiLU, continuing from ``tail``.

    x: [T, C]; tail: [C, K-1], the last K-1 *pre-conv* rows of earlier calls (zeros for a fresh
    stream); weight: [C, K] (``weight[:, K-1]`` hits the current row); bias: [C].
    Returns (silu(conv + bias) [T, C] in x's dtype, new tail [C, K-1] in x's dtype).

    Like :func:`headstart.ops.conv.reference.causal_conv` but with the bias, which must go in
    before the SiLU (so that op cannot be reused by composition); the math runs in fp32, as
    causal_conv1d's kernels do.
    """
    channels = x.shape[1]
    k1 = weight.shape[1] - 1
    window = torch.cat([tail.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K-1+T]
    y = F.conv1d(
        window.float().unsqueeze(0), weight.float().unsqueeze(1), bias.float(), groups=channels
    )[0]  # [C, T]: each output sees K rows ending at its own
    # Slice by start, not by -k1: a kernel of width 1 (k1 = 0) must give an empty tail.
    new_tail = window[:, window.shape[1] - k1 :]
    return F.silu(y).transpose(0, 1).to(x.dtype), new_tail


def causal_conv_bias_step(
    x: torch.Tensor, tails: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new row for n streams at once. x: [n, C]; tails: [n, C, K-1]; weight: [C, K];
    bias: [C]. Returns (silu(conv + bias) [n, C] in x's dtype, new tails [n, C, K-1]); row for
    row what :func:`causal_conv_bias` gives each stream for T = 1."""
    window = torch.cat([tails.to(x.dtype), x[:, :, None]], dim=2)  # [n, C, K]
    y = (window.float() * weight.float()).sum(-1) + bias.float()
    return F.silu(y).to(x.dtype), window[:, :, 1:]


def _group_to_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N] fp32: head h gets group h // (H // G) (heads of one group are
    adjacent, as in mamba_ssm's and HF's repeat_interleave)."""
    groups = t.shape[-2]
    if heads % groups:
        raise ValueError(f"{heads} heads do not split into {groups} groups")
    return t.float().repeat_interleave(heads // groups, dim=-2)


def ssd_recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, step by step: the executable spec of the SSD scan.

    x: [T, H, P]; dt: [T, H] (after :func:`mamba_dt`); A: [H] (negative, ``-exp(A_log)``);
    B, C: [T, G, N] with G dividing H; D: [H]; state: [H, P, N] fp32 (zeros for a fresh stream).
    Returns (y [T, H, P] fp32, final state [H, P, N] fp32).
    """
    H = x.shape[1]
    x, dt, A, D = x.float(), dt.float(), A.float(), D.float()
    B, C = _group_to_heads(B, H), _group_to_heads(C, H)
    S = state.float().clone()
    y = torch.empty_like(x)
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * A)  # [H]
        S = S * decay[:, None, None] + (dt[t, :, None] * x[t])[:, :, None] * B[t][:, None, :]
        y[t] = torch.einsum("hpn,hn->hp", S, C[t]) + D[:, None] * x[t]
    return y, S


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L] with ``out[i, j] = a[j+1] + ... + a[i]`` for j <= i (0 on the
    diagonal) and -inf above it.

    Summed directly rather than as ``cumsum[i] - cumsum[j]``: the difference of two large
    cumulative log decays loses the small one's digits, the direct sum does not."""
    L = a.shape[-1]
    rows = a[..., :, None].expand(*a.shape, L)  # rows[k, j] = a[k]
    below = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)  # k > j
    seg = rows.masked_fill(~below, 0).cumsum(-2)  # seg[i, j] = sum of a[k] for j < k <= i
    causal = torch.ones(L, L, dtype=torch.bool, device=a.device).tril()
    return seg.masked_fill(~causal, float("-inf"))


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`ssd_recurrent`, computed chunk-parallel (for prefill).

    The SSD block decomposition: with log decays ``a_t = dt_t * A`` and, within a chunk, their
    cumulative sum ``c``, chunk rows i >= j interact through the masked quadratic form
    ``exp(c_i - c_j) (C_i . B_j) dt_j x_j``; the state entering the chunk reaches row i decayed
    by ``exp(c_i)``; the chunk hands on
    ``exp(c_last) S + sum_j exp(c_last - c_j) (dt_j x_j) ⊗ B_j``.
    Chunks run in sequence carrying the state. Rows padded onto the last chunk have dt = 0: no
    decay and no input, so they leave the state untouched. 128 is Nemotron-H's chunk_size; the
    result does not depend on it beyond rounding.
    """
    T, H, _P = x.shape
    x, dt = x.float().transpose(0, 1), dt.float().transpose(0, 1)  # [H, T, P], [H, T]
    B = _group_to_heads(B, H).transpose(0, 1)  # [H, T, N]
    C = _group_to_heads(C, H).transpose(0, 1)
    skip = D.float()[:, None, None] * x  # [H, T, P]
    pad = (-T) % chunk
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, pad))
    n = (T + pad) // chunk
    x, B, C = (t.reshape(H, n, chunk, -1) for t in (x, B, C))
    dt = dt.reshape(H, n, chunk)

    a = dt * A.float()[:, None, None]  # [H, n, L] log decay of each row
    c = a.cumsum(-1)
    decay = _segment_sum(a).exp()  # [H, n, L, L]: exp(c_i - c_j), 0 above the diagonal
    xdt = x * dt[..., None]  # [H, n, L, P]
    y_intra = ((C @ B.transpose(-1, -2)) * decay) @ xdt  # [H, n, L, P]
    c_decayed = C * c.exp()[..., None]  # [H, n, L, N]: reads the entering state
    b_to_end = B * decay[..., -1, :, None]  # [H, n, L, N]: exp(c_last - c_j) B_j
    chunk_decay = c[..., -1].exp()  # [H, n]

    S = state.float().clone()
    y = torch.empty_like(xdt)
    for i in range(n):
        y[:, i] = y_intra[:, i] + c_decayed[:, i] @ S.transpose(-1, -2)
        S = S * chunk_decay[:, i, None, None] + xdt[:, i].transpose(-1, -2) @ b_to_end[:, i]
    y = y.reshape(H, n * chunk, -1)[:, :T] + skip
    return y.transpose(0, 1), S


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new row for n independent streams at once (batched decode).

    x: [n, H, P]; dt: [n, H]; A: [H]; B, C: [n, G, N]; D: [H]; states: [n, H, P, N] fp32.
    Returns (y [n, H, P] fp32, new states [n, H, P, N] fp32): one step of
    :func:`ssd_recurrent` for each stream.
    """
    H = x.shape[1]
    x, dt, A, D = x.float(), dt.float(), A.float(), D.float()
    B, C = _group_to_heads(B, H), _group_to_heads(C, H)
    decay = torch.exp(dt * A)  # [n, H]
    S = states.float() * decay[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None]
    y = torch.einsum("ihpn,ihn->ihp", S, C) + D[:, None] * x
    return y, S


def gated_group_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, groups: int
) -> torch.Tensor:
    """The mixer's gated RMSNorm: gate first, then an RMSNorm over each group, then the weight.

    y, z: [..., H*P] (the scan's output flattened head-major, and the gate); weight: [H*P].
    Returns ``weight * rmsnorm_g(y * silu(z))`` fp32 [..., H*P], the mean of squares taken over
    each of ``groups`` contiguous slices of ``H*P / groups`` channels (mamba_ssm's
    ``norm_before_gate=False``; the gate multiplies *before* the norm).
    """
    *lead, width = y.shape
    if width % groups:
        raise ValueError(f"width {width} does not split into {groups} groups")
    g = (y.float() * F.silu(z.float())).reshape(*lead, groups, width // groups)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return g.reshape(*lead, width) * weight.float()
