"""Nemotron-H as one forward over packed rows from many streams (the reference path).

``NemotronHModel.forward_ex(batch, pool)`` embeds the rows and runs every layer: one mixer per
layer, each pre-normed (RMSNorm) and added to the residual stream: a Mamba2 mixer (in-projection
into gate, conv input and time steps; causal depthwise conv with bias from the slot's conv tail;
the SSD recurrence from the slot's SSM state; gated grouped RMSNorm; out-projection), attention
without positional encoding (GQA over the slot's KV rows), or a squared-ReLU MLP. The math is
transformers' ``modeling_nemotron_h`` (the spec the parity tests hold it to); the per-stream cores
are :mod:`headstart.ops.ssd.reference` and :mod:`headstart.ops.attention.reference`.

Weights are plain tensors or, from an MLX checkpoint, :class:`~headstart.quant.QuantizedTensor`:
every projection goes through :func:`~headstart.ops.linear.linear`, and the embedding lookup
unpacks only the rows it looks up. As for Qwen3.5, a model whose quantized linear weights unpack
to at most ``UNPACK_BYTES`` is unpacked once at load (per-call unpacking would dominate a small
model's step); a larger one keeps its memory saving: in bf16 on the CPU through torch's int4
kernel (``ops/quant_matmul/cpu.py``), else unpacked per call.

Batch shapes: decode rows (one batched step) and multi-row spans (prefill chunks, one by one).
On CUDA (with Triton) the decode rows' attention is the flash-decoding kernel reading the pool
up to lengths held on the device, so the decode step does no host work and is captured in CUDA
graphs (``kernels.graph_shapes``: decode only; prompts, continued chunks and verify windows run
eagerly, and no drafter targets this family). Elsewhere every op is the reference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from headstart.batch import ForwardBatch
from headstart.kernels import REFERENCE as SHARED_REFERENCE
from headstart.models.contract import ForwardOutput
from headstart.models.nemotron_h.config import ATTENTION, MAMBA, ModelConfig, load_config
from headstart.models.qwen35.pipeline import unpack_fits
from headstart.models.qwen35.weights import Weight
from headstart.ops.attention.reference import attend
from headstart.ops.linear import linear
from headstart.ops.quant_matmul import cpu as cpu_quant
from headstart.ops.quant_matmul.cpu import UNPACK_BYTES
from headstart.ops.ssd import reference as ssd
from headstart.quant import QuantizedTensor
from headstart.state import StateGroup, StatePool

__all__ = ["NemotronHModel"]

#: The kernels this family runs: ``attn_decode`` as Qwen3.5's (:class:`headstart.kernels.Kernels`:
#: the reference reads up to the longest stream, a host sync, so it is never captured);
#: ``graph_shapes``: the batch shapes the runner may capture (see the module docstring).
REFERENCE = SimpleNamespace(
    name="reference",
    graphs=False,
    graph_shapes=frozenset(),
    attn_decode=SHARED_REFERENCE.attn_decode,
)


def select_kernels(device: torch.device, want: str) -> SimpleNamespace:
    """``want`` "auto" or "gpu": the GPU decode attention on CUDA when Triton imports ("gpu"
    raises otherwise); "reference" or "cpu": the reference everywhere."""
    if want not in ("auto", "gpu", "reference", "cpu"):
        raise ValueError(f"kernels must be auto, gpu, cpu or reference, not {want!r}")
    if want in ("reference", "cpu") or (want == "auto" and device.type != "cuda"):
        return REFERENCE
    try:
        from headstart.ops.attention.triton import decode_attention
        from headstart.ops.triton_support import HAVE_TRITON
    except ImportError:
        HAVE_TRITON = False
    if device.type != "cuda" or not HAVE_TRITON:
        if want == "gpu":
            raise ValueError("nemotron_h: --kernels gpu needs CUDA and Triton")
        return REFERENCE
    return SimpleNamespace(
        name="gpu", graphs=True, graph_shapes=frozenset({"decode"}), attn_decode=decode_attention
    )


# Mixer parameters kept in fp32 whatever the model's dtype (the scan runs in fp32).
_FP32 = ("A_log", "D", "dt_bias")
EMBED = "embeddings.weight"
HEAD = "lm_head.weight"


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' NemotronHRMSNorm: normalised in fp32, rounded, then scaled."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class NemotronHModel:
    """Weights plus the forward. Build with :meth:`load` or from a weight dict (canonical
    names: transformers' without the ``backbone.`` prefix)."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, Weight],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        unpack_bytes: int = UNPACK_BYTES,
        kernels: str = "auto",
    ) -> None:
        """``weights``: plain tensors (cast to ``dtype``, the SSM's fp32 parameters kept fp32)
        and/or packed :class:`QuantizedTensor` weights. Quantized linear weights are unpacked
        to ``dtype`` here when all of them together take at most ``unpack_bytes`` unpacked
        (the embedding table never is: lookups unpack only their rows; a head tied to it gets
        its own unpacked copy under the same rule)."""
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.kernels = select_kernels(self.device, kernels)
        self.arena = None
        layers = {k: t for k, t in weights.items() if k != EMBED}
        unpack = unpack_fits(layers, dtype, unpack_bytes)
        cpu_int4 = not unpack and cpu_quant.takes(dtype, self.device)
        self.w: dict[str, Weight] = {}
        for name in list(weights):
            t = weights[name]
            if isinstance(t, QuantizedTensor):
                t = t.to(self.device)
                if name != EMBED and unpack:
                    t = t.dequantize(dtype)
                elif name != EMBED and cpu_int4 and cpu_quant.fits(t):
                    t = cpu_quant.prepare(t)
                self.w[name] = t
                continue
            keep = torch.float32 if name.rsplit(".", 1)[-1] in _FP32 else dtype
            self.w[name] = t.to(device=self.device, dtype=keep)
        # transformers never ties this family's head: a stored lm_head wins even when the
        # config says tied; the embedding table serves only a checkpoint that has none.
        self.head = self.w.get(HEAD, self.w[EMBED])
        if isinstance(self.head, QuantizedTensor) and unpack_fits(
            {"head": self.head}, dtype, unpack_bytes
        ):
            self.head = self.head.dequantize(dtype)
        elif isinstance(self.head, QuantizedTensor) and cpu_int4 and cpu_quant.fits(self.head):
            self.head = cpu_quant.prepare(self.head)
        self.state_index = {i: n for n, i in enumerate(cfg.mamba_layers)}
        self.state_index.update({i: n for n, i in enumerate(cfg.attention_layers)})

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels: str = "auto",
        dummy: bool = False,
    ) -> NemotronHModel:
        """Load a checkpoint folder (``dummy``: random weights at its config's shapes)."""
        from headstart.models.nemotron_h.weights import expected_shapes, load_weights

        cfg = load_config(model_dir)
        if dummy:  # made on the device, in the model's dtype: a 9B shape fits no host copy
            dev = torch.device(device)
            gen = torch.Generator(dev).manual_seed(0)

            def make(n: str, s: tuple[int, ...]) -> torch.Tensor:
                keep = torch.float32 if n.rsplit(".", 1)[-1] in _FP32 else dtype
                if n.endswith("norm.weight") or n.endswith("norm_f.weight"):
                    return torch.ones(s, dtype=keep, device=dev)
                t = torch.randn(s, generator=gen, device=dev)
                return t.div_(s[-1] ** 0.5 if len(s) > 1 else 1).to(keep)

            weights = {n: make(n, s) for n, s in expected_shapes(cfg).items()}
        else:
            weights = dict(load_weights(model_dir, cfg, dtype, "cpu"))
        return cls(cfg, weights, dtype, device, kernels=kernels)

    # -- the contract ----------------------------------------------------------------------------
    def num_parameters(self) -> int:
        """Weights a token's forward multiplies by (the embedding table only as the head),
        counted unpacked for quantized ones."""
        head = 0 if HEAD in self.w else math.prod(self.head.shape)
        return sum(math.prod(t.shape) for n, t in self.w.items() if n != EMBED) + head

    def state_groups(self) -> tuple[StateGroup, ...]:
        """Per Mamba2 layer a conv tail (the last K-1 pre-conv rows of the conv input) and an
        SSM state per head (fp32); per attention layer key and value rows."""
        cfg = self.cfg
        n_mamba, n_att = len(cfg.mamba_layers), len(cfg.attention_layers)
        kv = (cfg.num_key_value_heads, cfg.head_dim)
        return (
            StateGroup("conv", n_mamba, (cfg.mamba_conv_dim, cfg.conv_kernel - 1)),
            StateGroup(
                "ssm",
                n_mamba,
                (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size),
                torch.float32,
            ),
            StateGroup("keys", n_att, kv, token_axis=1),
            StateGroup("values", n_att, kv, token_axis=1),
        )

    def new_state_pool(self, num_slots: int, max_tokens: int) -> StatePool:
        return StatePool.allocate(
            self.state_groups(), num_slots, max_tokens, self.dtype, self.device
        )

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, pool: StatePool) -> torch.Tensor:
        return self.forward_ex(batch, pool).logits

    @torch.no_grad()
    def forward_ex(
        self, batch: ForwardBatch, pool: StatePool, taps: Sequence[int] = ()
    ) -> ForwardOutput:
        """Run the batch, updating its slots; logits of the asked rows, the residual stream
        after each layer in ``taps``."""
        if batch.windows is not None or batch.padded is not None or batch.trees:
            raise NotImplementedError("nemotron_h: graph-captured shapes and trees")
        for span in batch.spans:
            if span.start + span.length > pool.max_tokens:
                raise ValueError(
                    f"slot {span.slot}: {span.start + span.length} tokens exceed the pool's "
                    f"{pool.max_tokens}"
                )
        cfg, w = self.cfg, self.w
        x = self.embed(batch.input_ids)
        tapped = []
        for i, kind in enumerate(cfg.layer_types):
            h = _rms_norm(x, w[f"layers.{i}.norm.weight"], cfg.layer_norm_epsilon)
            if kind == MAMBA:
                h = self._mamba(i, h, batch, pool)
            elif kind == ATTENTION:
                h = self._attention(i, h, batch, pool)
            else:
                h = self._mlp(i, h)
            x = x + h
            if i in taps:
                tapped.append(x)
        h = _rms_norm(x[batch.logit_index], w["norm_f.weight"], cfg.layer_norm_epsilon)
        logits = linear(h, self.head).float()
        return ForwardOutput(logits, torch.cat(tapped, dim=-1) if taps else None, {})

    # -- layers ----------------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``ids`` (of a quantized table, only those rows unpacked)."""
        table = self.w[EMBED]
        if isinstance(table, QuantizedTensor):
            return table.dequantize(self.dtype, rows=ids)
        return table[ids]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w, b = self.w[name + ".weight"], self.w.get(name + ".bias")
        if isinstance(w, torch.Tensor):  # one fused op, as transformers' nn.Linear runs it
            return F.linear(x, w, b)
        y = linear(x, w)
        return y if b is None else y + b

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        up = self._linear(x, f"layers.{i}.mixer.up_proj")
        return self._linear(torch.relu(up).square(), f"layers.{i}.mixer.down_proj")

    def _attention(self, i: int, x: torch.Tensor, batch: ForwardBatch, pool: StatePool):
        cfg, p = self.cfg, f"layers.{i}.mixer."
        T, hd = x.shape[0], cfg.head_dim
        q = self._linear(x, p + "q_proj").view(T, cfg.num_attention_heads, hd)
        k = self._linear(x, p + "k_proj").view(T, cfg.num_key_value_heads, hd)
        v = self._linear(x, p + "v_proj").view(T, cfg.num_key_value_heads, hd)
        layer = self.state_index[i]
        keys, values = pool.keys[layer], pool.values[layer]
        out = torch.empty_like(q)
        d = batch.decode
        if d is not None:
            keys[d.slots, :, d.positions] = k[d.rows]
            values[d.slots, :, d.positions] = v[d.rows]
            out[d.rows] = self.kernels.attn_decode(
                q[d.rows], keys, values, d.slots, d.positions + 1
            )
        for s in batch.multi_row:
            end = s.start + s.length
            keys[s.slot, :, s.start : end] = k[s.begin : s.end].transpose(0, 1)
            values[s.slot, :, s.start : end] = v[s.begin : s.end].transpose(0, 1)
            out[s.begin : s.end] = attend(
                q[s.begin : s.end], keys[s.slot, :, :end], values[s.slot, :, :end], s.start
            )
        return self._linear(out.reshape(T, -1), p + "o_proj")

    def _mamba(self, i: int, x: torch.Tensor, batch: ForwardBatch, pool: StatePool):
        cfg, w, p = self.cfg, self.w, f"layers.{i}.mixer."
        H, P, G, N = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
        z, xbc, dt_raw = ssd.split_projection(self._linear(x, p + "in_proj"), H, P, G, N)
        conv_w = w[p + "conv1d.weight"].reshape(cfg.mamba_conv_dim, cfg.conv_kernel)
        conv_b = w.get(p + "conv1d.bias")
        if conv_b is None:
            conv_b = torch.zeros(cfg.mamba_conv_dim, dtype=x.dtype, device=x.device)
        A, D = -torch.exp(w[p + "A_log"]), w[p + "D"]
        # transformers' prefill clamps the time steps below at time_step_min, its one-token
        # decode does not; we clamp both (the same where softplus(dt) >= time_step_min).
        limit = (cfg.time_step_min, float("inf"))
        layer = self.state_index[i]
        tails, states = pool.conv[layer], pool.ssm[layer]
        y = torch.empty(x.shape[0], H * P, dtype=torch.float32, device=x.device)
        d = batch.decode
        if d is not None:  # one row per stream, batched; a new stream starts from zeros
            fresh = d.fresh.view(-1, 1, 1)
            tail = torch.where(fresh, 0.0, tails[d.slots])
            conv, tails[d.slots] = ssd.causal_conv_bias_step(xbc[d.rows], tail, conv_w, conv_b)
            xs, B, C = ssd.split_xbc(conv, H, P, G, N)
            dt = ssd.mamba_dt(dt_raw[d.rows], w[p + "dt_bias"], limit)
            state = torch.where(fresh.view(-1, 1, 1, 1), 0.0, states[d.slots])
            out, states[d.slots] = ssd.ssd_step(xs, dt, A, B, C, D, state)
            y[d.rows] = out.reshape(out.shape[0], -1)
        for s in batch.multi_row:
            rows = slice(s.begin, s.end)
            fresh = s.start == 0
            tail = torch.zeros_like(tails[s.slot]) if fresh else tails[s.slot]
            conv, tails[s.slot] = ssd.causal_conv_bias(xbc[rows], tail, conv_w, conv_b)
            xs, B, C = ssd.split_xbc(conv, H, P, G, N)
            dt = ssd.mamba_dt(dt_raw[rows], w[p + "dt_bias"], limit)
            state = torch.zeros_like(states[s.slot]) if fresh else states[s.slot]
            out, states[s.slot] = ssd.ssd_chunked(xs, dt, A, B, C, D, state, chunk=cfg.chunk_size)
            y[rows] = out.reshape(s.length, -1)
        normed = ssd.gated_group_rms_norm(y, z, w[p + "norm.weight"], cfg.layer_norm_epsilon, G)
        return self._linear(normed.to(x.dtype), p + "out_proj")
