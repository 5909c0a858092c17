"""The Qwen3.5 hybrid text model, as one forward over packed rows from many streams.

``Qwen35Model.forward_ex(batch, pool)`` embeds the batch's rows, runs every decoder layer (Gated
DeltaNet or gated full attention: ``gdn.py``, ``attention.py``; then a SwiGLU MLP), reads and
updates each stream's state in its slot of the :class:`~headstart.state.StatePool` (the groups
of :meth:`Qwen35Model.state_groups`), and returns logits only for the rows the chunks asked for.
Projections, norms and MLPs run once over all rows; the sequence-mixing cores per batch shape.
The kernels behind them are chosen once (:mod:`headstart.kernels`): the pure-PyTorch reference
(CPU, float32 by default) is the spec the GPU kernels are tested against. The math follows HF
transformers' ``modeling_qwen3_5``, including where it rounds. Weight loading is
``pipeline.py``; speculative-decoding surgery is ``speculative.py``.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path

import torch

from headstart.arena import ArenaPlan, WeightArena, leaves, rebuild
from headstart.batch import ForwardBatch
from headstart.kernels import Kernels, select_kernels
from headstart.models.contract import ForwardOutput
from headstart.models.qwen35 import speculative
from headstart.models.qwen35.attention import GatedAttention
from headstart.models.qwen35.config import FULL, ModelConfig, load_config
from headstart.models.qwen35.decode_step import decode_step
from headstart.models.qwen35.gdn import GatedDeltaNet
from headstart.models.qwen35.pipeline import (
    UNPACK_BYTES,
    consume,
    dense_budget,
    layer_bytes,
    layer_of,
    layers_within,
    unpack_fits,
)
from headstart.models.qwen35.speculative import GDNRecord, WindowRecords
from headstart.models.qwen35.weights import Weight, load_weights, stand_ins
from headstart.ops.linear import linear
from headstart.ops.pointwise.reference import Rotary, rms_norm
from headstart.ops.quant_matmul import cpu as cpu_quant
from headstart.ops.quant_matmul import cpu_f32
from headstart.progress import progress
from headstart.quant import QuantizedTensor
from headstart.state import StateGroup, StatePool

__all__ = ["Qwen35Model"]

log = logging.getLogger("headstart.model")


class Qwen35Model:
    """Weights plus the forward. Build with :meth:`load` or from a weight dict."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: MutableMapping[str, Weight],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels: Kernels | str = "auto",
        unpack_bytes: int = UNPACK_BYTES,
        arena: bool = True,
        dense_bytes: int | None = None,
    ) -> None:
        """``weights`` (a dict, or a :class:`~headstart.weights.LazyWeights` that reads each
        tensor when it is taken) is consumed: its entries move into the model (fused, prepared)
        one at a time and the mapping is left empty.

        ``unpack_bytes``: with the reference kernels, quantized linear weights are unpacked to
        ``dtype`` once at load when all of them together take at most this many bytes unpacked
        (else they stay packed and are unpacked per call; the GPU kernels read them packed).
        ``dense_bytes``: with other kernels, quantized layer weights also keep a copy unpacked
        to ``dtype`` for prefill-sized matmuls when all copies fit this many bytes (None: the
        device's default, :func:`~headstart.models.qwen35.pipeline.dense_budget`; 0: never;
        :meth:`keep_dense_copies` adds those of the first layers later).

        ``arena``: every final weight tensor (the head, the embedding table and the norms
        included) is a view into one allocation on ``device``, :attr:`arena`
        (:class:`~headstart.arena.WeightArena`; None when off). It is planned by running the
        loading pipeline once on meta stand-ins (shapes only), then each weight is copied into
        its slot as soon as it is made and the original dropped: from a ``LazyWeights`` (as
        :meth:`load` does), loading holds the arena plus one layer's weights in flight, never
        two copies of the model (a dict's caller holds its own copy until it is consumed)."""
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.kernels = kernels if isinstance(kernels, Kernels) else select_kernels(device, kernels)
        self.unpack_bytes = unpack_bytes
        self.dense_bytes = dense_budget(self.device) if dense_bytes is None else dense_bytes
        self.arena: WeightArena | None = None
        self._take(weights, arena)
        self.rotary = Rotary.create(cfg.rotary_dim, cfg.rope_theta, self.device)
        # Layer index -> index within its kind, i.e. its row in the StatePool tensors.
        self.state_index = {i: n for n, i in enumerate(cfg.linear_layers)}
        self.state_index.update({i: n for n, i in enumerate(cfg.attention_layers)})
        self.attention = GatedAttention(self)
        self.gated_deltanet = GatedDeltaNet(self)

    def _take(self, weights: MutableMapping[str, Weight], arena: bool) -> None:
        """Run the loading pipeline over ``weights`` into :attr:`w` and :attr:`head` (through
        an arena planned from meta stand-ins when ``arena``), with progress on a terminal."""
        cfg, dtype, unpack_bytes = self.cfg, self.dtype, self.unpack_bytes
        shapes = stand_ins(weights)  # meta: nothing is read or copied
        fused = self.kernels.fused_matmul
        unpack = not fused and unpack_fits(shapes, dtype, unpack_bytes)
        layers = cfg.num_hidden_layers
        # All or none at load: the state pool is sized after the load (keep_dense_copies).
        dense = layers if fused and unpack_fits(shapes, dtype, self.dense_bytes) else 0
        # Too big to unpack, in bf16 on the CPU: torch's int4 kernel reads the codes as they are.
        cpu_int4 = not unpack and cpu_quant.takes(dtype, self.device)
        # Small fp32 models on the CPU: decode reads the 4-bit codes, prefill the unpacked copy.
        packed_f32 = unpack and cpu_f32.takes(dtype, self.device)
        if dense:
            log.info("4-bit layer weights keep a dense %s copy for prefill", dtype)

        def place(_: str, t: Weight) -> Weight:
            return t

        final = len(shapes)  # weights the model ends with (fused ones count once), for progress
        if arena:
            plan, planned = ArenaPlan(), []

            def add(name: str, t: Weight) -> Weight:
                planned.append(name)
                return plan.add(name, t)

            consume(
                shapes,
                cfg,
                self.kernels,
                dtype,
                unpack,
                unpack_bytes,
                add,
                dense,
                cpu_int4,
                packed_f32,
            )
            self.arena = plan.allocate(self.device)
            place, final = self.arena.fill, len(planned)
        with progress("loading weights", final) as tick:

            def placed(name: str, t: Weight) -> Weight:
                tick()
                return place(name, t)

            self.w, self.head = consume(
                weights,
                cfg,
                self.kernels,
                dtype,
                unpack,
                unpack_bytes,
                placed,
                dense,
                cpu_int4,
                packed_f32,
            )
        if self.arena is not None:
            self.arena.check_complete()

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels: Kernels | str = "auto",
        unpack_bytes: int = UNPACK_BYTES,
        arena: bool = True,
        dummy: bool = False,
        dense_bytes: int | None = None,
    ) -> Qwen35Model:
        """Load a checkpoint folder; tensors are read one at a time as the model takes them.
        ``dummy``: random weights at the config's shapes instead (only config.json is read)."""
        cfg = load_config(model_dir)
        if dummy:
            from headstart.models.qwen35.dummy import random_weights

            weights = random_weights(cfg, device, dtype)
        else:
            weights = load_weights(model_dir, cfg, dtype, device, lazy=True)
        return cls(
            cfg,
            weights,
            dtype,
            device,
            kernels,
            unpack_bytes,
            arena,
            dense_bytes,
        )

    def keep_dense_copies(self, budget: int) -> int:
        """Give the prepared 4-bit weights of as many layers as fit ``budget`` bytes, from the
        first, a dense copy in the model's dtype for prefill-sized matmuls (cuBLAS on it
        instead of unpacking the weight on every call); layers that have copies count as kept.
        Returns the layers that have copies now. For ``serve`` once the state pool's size is
        known: the copies that all-or-none at load could not afford, in what is left."""
        if not self.kernels.fused_matmul:
            return 0
        from headstart.ops.quant_matmul.triton import PreparedQuant, dequantize_prepared

        layers = self.cfg.num_hidden_layers

        def missing(t: object) -> bool:
            return isinstance(t, PreparedQuant) and t.dense is None

        per_layer = layer_bytes(self.w, self.dtype, layers, missing)
        if not any(per_layer):  # every copy there already, or no 4-bit weight at all
            return layers if any(isinstance(t, PreparedQuant) for t in self.w.values()) else 0
        kept = layers_within(per_layer, budget)
        for name, t in self.w.items():
            i = layer_of(name)
            if missing(t) and i is not None and i < kept:
                t.dense = dequantize_prepared(t, self.dtype)
        return kept

    def num_parameters(self) -> int:
        """Weights a token's forward multiplies by (the embedding table only as the head):
        what sizes a step's compute."""
        total = 0
        for name, t in (*self.w.items(), ("head", self.head)):
            if name != "embed_tokens.weight":
                shape = t.shape
                total += math.prod(shape)
        return total

    def state_groups(self) -> tuple[StateGroup, ...]:
        """Per GDN layer a conv tail (last K-1 pre-conv rows) and a recurrent state (fp32,
        HF/FLA layout); per attention layer post-norm, post-RoPE key and value rows."""
        cfg = self.cfg
        n_lin, n_att = len(cfg.linear_layers), len(cfg.attention_layers)
        kv = (cfg.num_key_value_heads, cfg.head_dim)
        return (
            StateGroup("conv", n_lin, (cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)),
            StateGroup(
                "recurrent",
                n_lin,
                (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
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
        """Run the batch, updating its slots in ``pool``; logits ``[R, vocab]`` of the asked
        rows."""
        return self.forward_ex(batch, pool).logits

    @torch.no_grad()
    def forward_ex(
        self, batch: ForwardBatch, pool: StatePool, taps: Sequence[int] = ()
    ) -> ForwardOutput:
        """:meth:`forward`, plus the residual stream after each layer in ``taps`` for every row
        (the drafter's context features), and a :class:`GDNRecord` per span marked ``record``
        (to roll its GDN state back to any of its rows, see :meth:`rollback`)."""
        cfg, w = self.cfg, self.w
        records: dict[int, GDNRecord] = {
            s.slot: GDNRecord() for s in batch.spans if s.record or s.parents is not None
        }
        if batch.windows is not None and not batch.windows.span:  # keyed by stream index
            records.update({j: GDNRecord() for j in range(batch.windows.rows.shape[0])})
        tapped: list[torch.Tensor] = []
        for span in batch.spans:
            if span.start + span.length > pool.max_tokens:
                raise ValueError(
                    f"slot {span.slot}: {span.start + span.length} tokens exceed the pool's "
                    f"{pool.max_tokens}"
                )
        x = self.embed(batch.input_ids)
        # Rows that are all decode rows get RoPE inside the attention-input kernel.
        cos, sin = (
            (None, None)
            if batch.all_decode is not None
            else self.rotary.cos_sin(batch.positions, self.dtype)
        )
        # Their attention lengths (the new row included), once for all layers.
        lengths = batch.all_decode.positions + 1 if batch.all_decode is not None else None
        add_norm, eps = self.kernels.add_rms_norm, cfg.rms_norm_eps
        pending: torch.Tensor | None = None  # the last MLP's output, added with the next norm
        for i, kind in enumerate(cfg.layer_types):
            p = f"layers.{i}."
            x, h = add_norm(x, pending, w[p + "input_layernorm.weight"], eps)
            if i - 1 in taps:
                tapped.append(x)
            if kind == FULL:
                h = self.attention(i, h, cos, sin, batch, pool, lengths)
            else:
                h = self.gated_deltanet(i, h, batch, pool, records)
            x, h = add_norm(x, h, w[p + "post_attention_layernorm.weight"], eps)
            pending = self.mlp(p + "mlp.", h)
        x = x + pending
        if cfg.num_hidden_layers - 1 in taps:
            tapped.append(x)
        if taps:
            assert len(tapped) == len(taps), "tap ids must be distinct layer indices"
        h = rms_norm(x[batch.logit_index], w["norm.weight"], eps)
        return ForwardOutput(self.lm_head(h), torch.cat(tapped, dim=-1) if taps else None, records)

    def decode_program(
        self, width: int = 1, taps: tuple[int, ...] = (), every_row: bool = False
    ) -> tuple[Callable[..., tuple[torch.Tensor, ...]], list[torch.Tensor]]:
        """The decode step as a pure function of its tensors, to trace (``decode_step.py``):
        ``(step, weights)`` where ``step(ids, positions, slots, fresh, lengths, *groups,
        *weights)`` runs ``width`` rows per stream (one: a decode row; more: a window of a
        stream's next tokens, the first ``lengths[i]`` of stream i real) over the pool's group
        tensors (``groups``, in :meth:`state_groups` order), writes the rows' keys and values,
        and returns (each stream's last logits, the new rows of each fixed-size group in
        order: conv tails and recurrent states, ``[layers, streams, ...]``, and with ``taps``
        every row's tapped residual stream as :meth:`forward_ex` gives it) for the caller to
        write back. The weights are arguments, not constants of the trace, so a compiled step
        depends only on shapes (a compiler's cache then serves a restart). ``every_row``: a
        speculative verify window, every row's logits and the state after each row
        (``decode_step.py``)."""
        weights: list[torch.Tensor] = []
        index: dict[int, int] = {}  # each tensor once: a compiler given one tensor twice errs

        def arg(t: torch.Tensor) -> int:
            if id(t) not in index:
                index[id(t)] = len(weights)
                weights.append(t)
            return index[id(t)]

        named = [*self.w.items(), ("head", self.head)]
        layout = [(name, value, {f: arg(t) for f, t in leaves(value)}) for name, value in named]
        rotary = arg(self.rotary.inv_freq)
        groups = len(self.state_groups())

        def step(ids, positions, slots, fresh, lengths, *rest):
            pool, flat = rest[:groups], rest[groups:]
            model = copy.copy(self)  # the same model reading the arguments as its weights
            w = {name: rebuild(v, {f: flat[i] for f, i in at.items()}) for name, v, at in layout}
            model.head = w.pop("head")
            model.w, model.rotary = w, Rotary(flat[rotary])
            return decode_step(
                model, ids, positions, slots, fresh, lengths, *pool,
                width=width, taps=taps, every_row=every_row,
            )  # fmt: skip

        return step, weights

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        return linear(h, self.head)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.w["embed_tokens.weight"]
        if isinstance(table, QuantizedTensor):
            return table.dequantize(self.dtype, rows=ids)
        return table[ids]

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        return linear(
            self.kernels.silu_mul(linear(x, w[p + "gate_up_proj.weight"])),
            w[p + "down_proj.weight"],
        )

    # -- speculative decoding (see speculative.py) --------------------------------------------
    def new_window_records(
        self, streams: int, width: int, row_states: bool | None = None
    ) -> WindowRecords:
        """Shared buffers for graphed verify windows of up to ``streams`` x ``width`` rows."""
        return WindowRecords.allocate(self.cfg, streams, width, self.dtype, self.device, row_states)

    def rollback(self, pool: StatePool, slot: int, record: GDNRecord, keep: int) -> None:
        """Set the slot's state to what it was after the first ``keep`` recorded rows."""
        speculative.rollback(self, pool, slot, record, keep)

    def rollback_window(
        self,
        pool: StatePool,
        slot: torch.Tensor,
        records: WindowRecords,
        window: torch.Tensor,
        keep: int,
    ) -> None:
        """:meth:`rollback` of a graphed window, without host work (capturable)."""
        speculative.rollback_window(self, pool, slot, records, window, keep)

    def rollback_windows(
        self,
        pool: StatePool,
        slots: torch.Tensor,
        records: WindowRecords,
        keep: torch.Tensor,
        width: int,
    ) -> None:
        """Every window of a graphed batch rolled back to ``keep`` (a device tensor) rows."""
        speculative.rollback_windows(self, pool, slots, records, keep, width)

    def commit_tree(
        self, pool: StatePool, slot: int, start: int, record: GDNRecord, path: Sequence[int]
    ) -> None:
        """After a tree window: keep the state and KV rows of the accepted ``path``."""
        speculative.commit_tree(self, pool, slot, start, record, path)
