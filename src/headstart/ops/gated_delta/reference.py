"""The gated delta rule (Gated DeltaNet's recurrence), in recurrent and chunked form.

Math (per value head, state ``S [Dk, Dv]`` in fp32, HF/FLA layout)::

    S <- exp(g_t) * S;  S <- S + k_t (beta_t * (v_t - S^T k_t))^T;  o_t = S^T q_t

``q`` and ``k`` arrive raw: both forms L2-normalise them (eps 1e-6 on the sum of squares) and scale
``q`` by ``Dk^-0.5`` in fp32, as every reference does inside its kernel. With more value heads than
key heads, value head ``h`` reads key head ``h // r``.
"""

from __future__ import annotations

import torch


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """[T, H*, D] inputs -> fp32 head-first [Hv, T, D], q/k normalised and grouped."""
    r = v.shape[1] // q.shape[1]
    q, k, v = (x.float().transpose(0, 1) for x in (q, k, v))
    if r > 1:
        q = q.repeat_interleave(r, dim=0)
        k = k.repeat_interleave(r, dim=0)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q, k, v, g.float().transpose(0, 1), beta.float().transpose(0, 1)


def recurrent_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, step by step: the executable spec.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv]; state: [Hv, Dk, Dv] fp32.
    Returns (o [T, Hv, Dv] fp32, final state [Hv, Dk, Dv] fp32).
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    S = state.float().clone()
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        S = S * g[:, t].exp()[:, None, None]
        kv_mem = torch.einsum("hkv,hk->hv", S, k[:, t])
        delta = (v[:, t] - kv_mem) * beta[:, t, None]
        S = S + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = torch.einsum("hkv,hk->hv", S, q[:, t])
    return out.transpose(0, 1), S


def chunked_gated_delta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`recurrent_gated_delta`, computed chunk-parallel (for prefill).

    Within a chunk with cumulative log decay ``c``, the delta-rule updates are solved at once
    through the unit lower-triangular system ``(I + A) U = diag(beta) V`` (WY form); chunks then
    run in sequence carrying the state. Equal to the recurrence up to rounding.
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    H, T, _Dk = k.shape
    # A span shorter than a chunk (a verify window, a rollback, a short prompt) is padded only
    # to the next multiple of 8: the chunk size changes nothing but rounding, and padding 8 rows
    # to 32 made an 8-row span cost 1.6x as much on the CPU (BENCHMARKS.md).
    chunk = min(chunk, max(8, -(-T // 8) * 8))
    pad = (-T) % chunk
    if pad:
        # Zero beta and zero log-decay make padded steps leave the state untouched.
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(H, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(H, n, chunk), beta.reshape(H, n, chunk)

    c = g.cumsum(-1)  # [H, n, C]
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # exp(c_i - c_j) for j <= i; masked to -inf first so the j > i entries cannot overflow.
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(future, float("-inf")).exp()
    kb = k * beta[..., None]
    A = ((kb @ k.transpose(-1, -2)) * decay).masked_fill(
        future | torch.eye(chunk, dtype=torch.bool, device=q.device), 0
    )
    eye = torch.eye(chunk, device=q.device)
    system = A + eye  # unit lower triangular
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, kb * c.exp()[..., None], upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay  # includes the diagonal
    q_decayed = q * c.exp()[..., None]
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]

    S = state.float().clone()
    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ S
        out[:, i] = q_decayed[:, i] @ S + attn[:, i] @ v_new
        S = S * c[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(H, n * chunk, -1)[:, :T]
    return out.transpose(0, 1), S


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for n independent streams at once (batched decode).

    q, k: [n, Hk, Dk]; v: [n, Hv, Dv]; g, beta: [n, Hv]; state: [n, Hv, Dk, Dv] fp32.
    Returns (o [n, Hv, Dv] fp32, new state [n, Hv, Dk, Dv] fp32). Same math as one step of
    :func:`recurrent_gated_delta` for each stream.
    """
    r = v.shape[1] // q.shape[1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if r > 1:
        q = q.repeat_interleave(r, dim=1)
        k = k.repeat_interleave(r, dim=1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    S = state.float() * g.exp()[..., None, None]
    kv_mem = torch.einsum("nhkv,nhk->nhv", S, k)
    delta = (v - kv_mem) * beta[..., None]
    S = S + k[..., :, None] * delta[..., None, :]
    return torch.einsum("nhkv,nhk->nhv", S, q), S
