"""Causal depthwise convolution over the GDN projection, continuing from a per-stream tail.

The tail holds the last ``K - 1`` *pre-convolution* rows of earlier calls (zeros for a fresh
stream), so a prompt can be fed in any number of pieces with identical results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. x: [T, C]; tail: [C, K-1]; weight: [C, K] (``weight[:, K-1]`` hits the
    current row). Returns (silu(conv) [T, C], new tail [C, K-1])."""
    T = x.shape[0]
    window = torch.cat([tail.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, K-1+T]
    y = F.conv1d(window.unsqueeze(0), weight.to(x.dtype).unsqueeze(1), groups=x.shape[1])[0]
    new_tail = window[:, -tail.shape[1]:]
    return F.silu(y[:, -T:]).transpose(0, 1), new_tail


def causal_conv_step(x: torch.Tensor, tails: torch.Tensor, weight: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One new row for n streams at once. x: [n, C]; tails: [n, C, K-1]; weight: [C, K].
    Returns (silu(conv) [n, C], new tails [n, C, K-1])."""
    window = torch.cat([tails.to(x.dtype), x[:, :, None]], dim=2)  # [n, C, K]
    y = (window * weight.to(x.dtype)).sum(-1)
    return F.silu(y), window[:, :, 1:]
