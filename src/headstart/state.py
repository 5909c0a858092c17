"""Per-stream decode state, preallocated once and indexed by slot.

A stream (one request being generated) owns one slot. For every Gated DeltaNet layer the slot holds
the conv tail (last ``K-1`` pre-conv rows, activation dtype) and the recurrent state
(``[Hv, Dk, Dv]``, fp32, HF/FLA layout); for every full-attention layer it holds up to
``max_tokens`` post-norm, post-RoPE key rows and value rows. Nothing here is allocated per request.
A slot whose stream starts at position 0 is treated as empty by the forward, so slots need no
clearing between requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headstart.config import ModelConfig


@dataclass
class StatePool:
    conv: torch.Tensor  # [linear layers, slots, conv_dim, K-1]
    recurrent: torch.Tensor  # [linear layers, slots, Hv, Dk, Dv] fp32
    keys: torch.Tensor  # [attention layers, slots, nkv, max_tokens, hd]
    values: torch.Tensor  # [attention layers, slots, nkv, max_tokens, hd]

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_slots: int, max_tokens: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
                 ) -> StatePool:
        n_lin, n_att = len(cfg.linear_layers), len(cfg.attention_layers)
        kv_shape = (n_att, num_slots, cfg.num_key_value_heads, max_tokens, cfg.head_dim)
        return cls(
            conv=torch.zeros(n_lin, num_slots, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1,
                             dtype=dtype, device=device),
            recurrent=torch.zeros(n_lin, num_slots, cfg.linear_num_value_heads,
                                  cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                  dtype=torch.float32, device=device),
            keys=torch.zeros(kv_shape, dtype=dtype, device=device),
            values=torch.zeros(kv_shape, dtype=dtype, device=device),
        )

    @staticmethod
    def bytes_for(cfg: ModelConfig, num_slots: int, max_tokens: int,
                  dtype: torch.dtype = torch.float32) -> int:
        """What :meth:`allocate` would take, computed without allocating."""
        act = torch.tensor([], dtype=dtype).element_size()
        n_lin, n_att = len(cfg.linear_layers), len(cfg.attention_layers)
        conv = n_lin * num_slots * cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * act
        rec = n_lin * num_slots * cfg.linear_num_value_heads * cfg.linear_key_head_dim \
            * cfg.linear_value_head_dim * 4
        kv = 2 * n_att * num_slots * cfg.num_key_value_heads * max_tokens * cfg.head_dim * act
        return conv + rec + kv

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    @property
    def max_tokens(self) -> int:
        return self.keys.shape[3]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.conv, self.recurrent, self.keys, self.values))


@dataclass
class WindowRecords:
    """Where graphed verify windows leave what a rollback replays (see ``Qwen35Model.rollback``):
    per GDN layer and window (stream index), the conv tail and recurrent state before the window
    and the window's pre-conv rows, log decays and betas. Allocated once and shared by every
    window graph: per-graph outputs of this size would multiply the state pool's memory by the
    number of graphs."""

    tail: torch.Tensor  # [linear layers, n, conv_dim, K-1]
    state: torch.Tensor  # [linear layers, n, Hv, Dk, Dv] fp32
    mixed: torch.Tensor  # [linear layers, n, W, conv_dim]
    g: torch.Tensor  # [linear layers, n, W, Hv] fp32
    beta: torch.Tensor  # [linear layers, n, W, Hv]

    @classmethod
    def allocate(cls, cfg: ModelConfig, streams: int, width: int, dtype: torch.dtype,
                 device: torch.device | str) -> WindowRecords:
        L, Hv = len(cfg.linear_layers), cfg.linear_num_value_heads
        return cls(
            tail=torch.zeros(L, streams, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1,
                             dtype=dtype, device=device),
            state=torch.zeros(L, streams, Hv, cfg.linear_key_head_dim,
                              cfg.linear_value_head_dim, dtype=torch.float32, device=device),
            mixed=torch.zeros(L, streams, width, cfg.conv_dim, dtype=dtype, device=device),
            g=torch.zeros(L, streams, width, Hv, dtype=torch.float32, device=device),
            beta=torch.zeros(L, streams, width, Hv, dtype=dtype, device=device))
