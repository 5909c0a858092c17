"""Prefill attention on the GPU through PyTorch's fused kernels (flash / cuDNN / efficient), with
no materialized masks; the contracts (and the spec) are ``reference.attend`` per stream.

* :func:`attn_span`: one stream's new rows over its KV rows: causal from the top left for a new
  stream, from the bottom right (``causal_lower_right``) for a continued one.
* :func:`attn_fresh_spans`: several new streams packed: ``varlen_attn`` (flash, by
  ``cu_seqlens``) where this PyTorch has it, else a block-diagonal mask.
* :func:`attn_padded`: new streams padded to one length, as a batch (graph-capturable).

Why PyTorch's kernels and not our own: they are at the H200's flash-attention speed for these
head sizes (BENCHMARKS.md, "prefill attention"), so a Triton prefill kernel would only add code.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F


def attn_span(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int):
    """q [T, nh, hd] at positions ``start ..``; keys/values [nkv, start+T, hd]."""
    nh, nkv = q.shape[1], keys.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], keys[None], values[None]
    if start == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=nh != nkv)
    else:
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(q.shape[0], keys.shape[1])
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, enable_gqa=nh != nkv)
    return o[0].transpose(0, 1)


@functools.cache
def _varlen():
    """PyTorch's varlen flash attention and whether it takes ``enable_gqa`` (None: absent)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def attn_fresh_spans(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
) -> torch.Tensor:
    """q [F, nh, hd], k/v [F, nkv, hd]: spans by ``cu_seqlens``, each causal on its own rows."""
    nh, nkv = q.shape[1], k.shape[1]
    longest = int((cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]).max())
    found = _varlen()
    if found is not None:
        varlen_attn, takes_gqa = found
        if nh != nkv and not takes_gqa:
            k, v = (t.repeat_interleave(nh // nkv, 1) for t in (k, v))
        extra = {"enable_gqa": True} if takes_gqa and nh != nkv else {}
        cu = cu_seqlens.to(torch.int32)
        # window (-1, 0): causal, aligned at each span's start (queries and keys coincide).
        return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0), **extra)
    lengths = cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]
    seg = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths).to(q.device)
    row = torch.arange(q.shape[0], device=q.device)
    mask = (seg[:, None] == seg[None, :]) & (row[None, :] <= row[:, None])
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=nh != nkv)
    return o[0].transpose(0, 1)


def attn_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [N, L, nh, hd], k/v [N, L, nkv, hd]; causal within each stream."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return o.transpose(1, 2)
