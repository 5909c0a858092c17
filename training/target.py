"""Training the small Qwen3.5-architecture target: config, loop, held-out perplexity.

The network is transformers' ``Qwen3_5ForCausalLM`` (the reference implementation; it uses
flash-linear-attention's kernels on a GPU when installed); the data, loop and evaluation are ours.
The layer pattern is the real one (three Gated DeltaNet layers, then a gated attention layer).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch


def optimizer_step(
    params, opt: torch.optim.Optimizer, loss: torch.Tensor, clip: float = 1.0
) -> None:
    """One step of every training loop here: backward, gradients clipped to ``clip``, update."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()


def target_config(vocab_size: int, eos_ids: list[int], layers: int = 8, hidden: int = 256):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=32768,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ],
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True,
        eos_token_id=eos_ids[0],
        rms_norm_eps=1e-6,
    )


@torch.no_grad()
def perplexity(model, rows: torch.Tensor, batch: int, device: str, dtype: torch.dtype) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, rows.shape[0], batch):
        x = rows[i : i + batch].to(device)
        with torch.autocast(
            device_type=device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32
        ):
            logits = model(x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(loss)
        count += x[:, 1:].numel()
    model.train()
    return math.exp(total / max(count, 1))


def train_target(
    model,
    train: torch.Tensor,
    held_out: torch.Tensor,
    *,
    time_budget_s: float,
    steps: int | None = None,
    batch: int = 32,
    lr: float = 2e-3,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    val: torch.Tensor | None = None,
    eval_every: int = 100,
    patience: int = 4,
    log=print,
) -> dict:
    """AdamW with 4% warmup and cosine decay over ``steps`` (or until the time budget ends;
    the schedule then assumes the step count reached at 10% of the budget extrapolated).

    With ``val`` rows: early stopping. The corpus is small (a few million tokens) and a model
    that trains for minutes memorises it, so the validation perplexity is measured every
    ``eval_every`` steps, the best weights are kept and restored at the end, and training stops
    after ``patience`` evaluations without improvement. ``held_out`` is only reported on."""
    torch.manual_seed(seed)
    model.to(device).train()
    with _torch_gated_delta():
        return _train(
            model,
            train,
            held_out,
            time_budget_s,
            steps,
            batch,
            lr,
            device,
            dtype,
            seed,
            log,
            val,
            eval_every,
            patience,
        )


@contextmanager
def _torch_gated_delta():
    """Train through transformers' own PyTorch chunked delta rule, not flash-linear-attention's:
    FLA 0.6 refuses its backward on Hopper with Triton < 3.7.1 (wrong gradients, FLA #640), the
    Triton the GPU machine has. Forward-only uses (drafter training, generation) keep FLA."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    fast = m.torch_chunk_gated_delta_rule
    m.torch_chunk_gated_delta_rule = inspect.unwrap(fast)
    try:
        yield
    finally:
        m.torch_chunk_gated_delta_rule = fast


def _train(
    model,
    train,
    held_out,
    time_budget_s,
    steps,
    batch,
    lr,
    device,
    dtype,
    seed,
    log,
    val,
    eval_every,
    patience,
):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    planned = steps
    step, history, val_history = 0, [], []
    best: tuple[float, int, dict] | None = None
    while True:
        elapsed = time.perf_counter() - start
        if (steps is not None and step >= steps) or elapsed >= time_budget_s:
            break
        if planned is None and elapsed > 0.1 * time_budget_s and step > 0:
            planned = int(step * time_budget_s / elapsed)
        total = planned or 10**9
        warm = max(1, int(0.04 * total))
        done = min(1.0, (step - warm) / max(1, total - warm))
        scale = step / warm if step < warm else 0.5 * (1 + math.cos(math.pi * done))
        for group in opt.param_groups:
            group["lr"] = lr * max(scale, 0.02)
        idx = torch.randint(0, train.shape[0], (batch,), generator=gen)
        x = train[idx].to(device)
        with torch.autocast(
            device_type=device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32
        ):
            logits = model(x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
        )
        optimizer_step(model.parameters(), opt, loss)
        step += 1
        history.append((step, loss.item()))
        if step % 50 == 0 or step == 1:
            log(f"target step {step} loss {loss.item():.3f} ({time.perf_counter() - start:.0f}s)")
        if val is not None and step % eval_every == 0:
            v = perplexity(model, val, batch, device, dtype)
            val_history.append((step, v))
            log(f"target step {step} validation perplexity {v:.2f}")
            if best is None or v < best[0]:
                best = (v, step, {k: t.detach().clone() for k, t in model.state_dict().items()})
            elif len(val_history) - 1 - [s for s, _ in val_history].index(best[1]) >= patience:
                log(f"target: stopping, no improvement since step {best[1]}")
                break
    if best is not None:
        model.load_state_dict(best[2])
    ppl = perplexity(model, held_out, batch, device, dtype)
    log(f"target: {step} steps, held-out perplexity {ppl:.2f}")
    return {
        "steps": step,
        "seconds": time.perf_counter() - start,
        "held_out_ppl": ppl,
        "best_step": best[1] if best else step,
        "val_history": val_history,
        "loss_history": history,
    }
