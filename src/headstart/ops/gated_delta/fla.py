"""Gated DeltaNet over multi-row spans on the GPU: flash-linear-attention's chunked kernel.

:func:`gdn_prefill_varlen`: several multi-row sequences packed into one ``[T, ...]`` batch with
``cu_seqlens``, with the contract of :func:`headstart.ops.gated_delta.reference.chunked_gated_delta`
per sequence (raw q/k, L2-normalised inside; log decay ``g``; ``beta`` post-sigmoid; fp32 state
``[Hv, Dk, Dv]``, the HF/FLA layout, same as our pool). Initial states are gathered from the pool
by slot (zeros for fresh streams, whatever the slot held, NaN included) and the final states
scattered back. That gather/scatter is one state read + write per stream per layer, small next to
a prefill chunk's work. One sequence takes FLA's plain batched form: no host work, so it can be
captured in a CUDA graph.

flash-linear-attention is an optional (GPU-only) dependency, imported on first call;
:func:`headstart.kernels.select_kernels` checks that it imports before choosing the GPU set.
Non-goals: autograd.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger("headstart.kernels")

# FLA's autotuning results for the GPUs and model shapes measured here (one folder per GPU, named
# as FLA names it; written by benchmarks/fla_configs.py from a start-up's log). FLA tunes each
# kernel once per model shape, over up to a few dozen configs, each compiled: most of what a
# first start on a fresh machine spends warming up. vLLM ships its tuned MoE configs the same way.
# The H100's folder holds its own tunings of 27B's plain chunk and, for every other key, the
# H200's (the same sm90 architecture and SM count; `fla_configs.py --fill`): a key missing from
# the folder is tuned at start-up, which made one compile-ahead process of a fresh H100 29 s
# slower than the others at 27B (BENCHMARKS.md, session 35).
SHIPPED_CONFIGS = Path(__file__).with_name("fla_configs")


def use_shipped_configs(device: torch.device) -> Path | None:
    """Before flash-linear-attention is imported: point it at the configs shipped for this GPU
    (``FLA_CONFIG_DIR``, ``FLA_CACHE_MODE=strict``: exact keys only, anything else still tuned)
    and return the folder; None when there are none for it, when FLA is already imported, or
    when the user set either variable."""
    if "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ or "fla" in sys.modules:
        return None
    gpu = re.sub(r"[^0-9A-Za-z]+", "_", torch.cuda.get_device_name(device)).strip("_")
    folder = SHIPPED_CONFIGS / gpu
    if not folder.is_dir():
        return None
    os.environ["FLA_CONFIG_DIR"] = str(folder)
    os.environ["FLA_CACHE_MODE"] = "strict"
    log.info("flash-linear-attention: tuned configs from %s", folder)
    return folder


# FLA's kernel modules: importing them runs FLA's ``fla.ops`` and ``fla.modules`` package inits
# (every op family it has) and imports torch's dynamo and inductor, seconds of one core.
KERNEL_MODULES = ("fla.ops.gated_delta_rule",)


def import_in_background(modules: tuple[str, ...] = KERNEL_MODULES) -> threading.Thread:
    """Start importing ``modules`` in a daemon thread and return it. Why: the first prefill
    imports them otherwise, inside the warm-up, after the weights' load, which a compile-ahead
    process and the server both wait through; started at kernel selection, the import runs
    while the weights load. A caller that imports one of them meanwhile waits for this import
    (Python's per-module import locks); an import that fails here fails again, with its error,
    where the kernels first use it."""

    def run() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception as e:  # raised again where the kernels first import it
                log.debug("background import of %s failed: %s", name, e)
                return

    thread = threading.Thread(target=run, name="fla-import", daemon=True)
    thread.start()
    return thread


def _fla_chunk():
    # Imported lazily: flash-linear-attention is an optional (GPU-only) dependency.
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def _chunk(q, k, v, g, beta, initial_state, **varlen):
    """FLA's chunked gated delta rule as every caller here runs it: batched ``[B, T, ...]``
    inputs, L2-normalised q/k inside, scale ``Dk^-0.5``, the final states returned."""
    return _fla_chunk()(
        q,
        k,
        v,
        g,
        beta,
        scale=q.shape[-1] ** -0.5,
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        **varlen,
    )


def gdn_prefill_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
    state_pool: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> torch.Tensor:
    """Chunked GDN over packed sequences; updates ``state_pool[slots]`` in place.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g (log decay), beta: [T, Hv]; cu_seqlens: [N+1] (int,
    starts at 0, on q's device); slots: [N] int64; fresh: [N] bool (start from a zero state);
    state_pool: [slots, Hv, Dk, Dv] fp32. ``cu_seqlens_cpu`` (optional) spares FLA a host sync
    when it builds its chunk index. Returns o: [T, Hv, Dv] in v's dtype.
    """
    slots = slots.to(torch.long)
    init = state_pool.index_select(0, slots)
    # where(), not multiply: a fresh slot may hold NaN from an earlier, aborted stream.
    init = torch.where(fresh.view(-1, 1, 1, 1), 0.0, init)
    # One sequence (the common prefill) takes FLA's plain batched form: it needs no chunk index
    # built from cu_seqlens, so it has no host work at all and can be captured in a CUDA graph.
    varlen = (
        {}
        if slots.shape[0] == 1
        else {"cu_seqlens": cu_seqlens.to(torch.long), "cu_seqlens_cpu": cu_seqlens_cpu}
    )
    o, final = _chunk(*(t.unsqueeze(0) for t in (q, k, v, g, beta)), init, **varlen)
    state_pool.index_copy_(0, slots, final.to(state_pool.dtype))
    return o[0].to(v.dtype)


def gdn_fresh_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    state_pool: torch.Tensor,
) -> torch.Tensor:
    """:func:`gdn_padded`'s contract for new prompts of one chunk (at most
    ``FRESH_PADDED_MAX_ROWS`` padded rows) from a zero state: FLA's L2 norms, cumulative decay
    and intra-chunk WY solve (its own functions, as its chunked forward calls them), then
    :func:`headstart.ops.gated_delta.triton.fresh_outputs` for the outputs and the final
    states, written to the slots. o [N, L, Hv, Dv] in v's dtype."""
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from headstart.ops.gated_delta.triton import fresh_outputs

    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    q, _ = l2norm_fwd(q)
    k, _ = l2norm_fwd(k)
    g = chunk_local_cumsum(g, chunk_size=64, scale=RCP_LN2)
    _, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=64)
    return fresh_outputs(q, k, u, g, slots, state_pool, q.shape[-1] ** -0.5)


def gdn_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    state_pool: torch.Tensor,
    initial: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Streams padded to one length, as FLA's plain batched form (no host work: capturable).

    q, k: [N, L, Hk, Dk]; v: [N, L, Hv, Dv]; g, beta: [N, L, Hv] with zero decay and zero beta
    on padding rows (so they leave a state untouched); slots: [N]. Every stream starts from a
    zero state (new prompts) or from ``initial`` [N, Hv, Dk, Dv] fp32; its final state goes to
    ``state_pool[slots]``. Returns o [N, L, Hv, Dv]. ``chunk_size``: FLA's (16, 32 or 64)."""
    o, final = _chunk(q, k, v, g, beta, initial, chunk_size=chunk_size)
    state_pool.index_copy_(0, slots.to(torch.long), final.to(state_pool.dtype))
    return o
