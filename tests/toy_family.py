"""A second model family of a few lines, registered through the model contract only.

"Toy mixer": embeddings, one leaky running sum per stream (a fixed-size state group of its own
shape) and the previous token's embedding (a per-token state group), a linear head. It knows
nothing of Qwen3.5, and nothing outside ``headstart.models`` knows it: the engine, the prompt
cache and the server serve it through the contract. Importing this module registers it (a
server finds it through ``HEADSTART_MODEL_FAMILIES=toy_family``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from headstart.batch import ForwardBatch
from headstart.models import ForwardOutput, ModelFamily, register
from headstart.state import StateGroup, StatePool

ARCH = "ToyMixerForCausalLM"
DECAY, LOOK_BACK = 0.9, 0.5


@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    generation_defaults: tuple[tuple[str, float], ...] = ()


class ToyMixer:
    def __init__(
        self,
        cfg: ToyConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.kernels = SimpleNamespace(name="reference", graphs=False)
        self.arena = None
        self.embed = weights["embed.weight"].to(self.device, dtype)
        self.head = weights["head.weight"].to(self.device, dtype)

    def state_groups(self) -> tuple[StateGroup, ...]:
        h = self.cfg.hidden_size
        return (
            StateGroup("acc", 1, (h,), torch.float32),
            StateGroup("trail", 1, (h,), token_axis=0),
        )

    def new_state_pool(self, num_slots: int, max_tokens: int) -> StatePool:
        return StatePool.allocate(
            self.state_groups(), num_slots, max_tokens, self.dtype, self.device
        )

    @torch.no_grad()
    def forward_ex(self, batch: ForwardBatch, pool: StatePool, taps=()) -> ForwardOutput:
        assert not taps and not batch.trees and batch.windows is None, "no drafting here"
        x = self.embed[batch.input_ids].float()
        acc, trail = pool["acc"][0], pool["trail"][0]
        out = torch.empty_like(x)
        zero = torch.zeros(self.cfg.hidden_size, device=self.device)
        for s in batch.spans:
            a = zero if s.start == 0 else acc[s.slot].clone()
            for r in range(s.begin, s.end):
                pos = s.start + r - s.begin
                prev = trail[s.slot, pos - 1].float() if pos > 0 else zero
                a = DECAY * a + x[r]
                trail[s.slot, pos] = x[r].to(trail.dtype)
                out[r] = a + LOOK_BACK * prev
            acc[s.slot] = a
        logits = out[batch.logit_index].to(self.dtype) @ self.head.T
        return ForwardOutput(logits.float(), None, {})

    def forward(self, batch: ForwardBatch, pool: StatePool) -> torch.Tensor:
        return self.forward_ex(batch, pool).logits


def _load(model_dir: Path, dtype: torch.dtype, device, kernels: str) -> ToyMixer:
    raw = json.loads((model_dir / "config.json").read_text())
    cfg = ToyConfig(
        raw["vocab_size"],
        raw["hidden_size"],
        raw["max_position_embeddings"],
        tuple(raw.get("eos_token_ids", ())),
    )
    return ToyMixer(cfg, load_file(model_dir / "model.safetensors"), dtype, device)


FAMILY = register(
    ModelFamily(name="toy_mixer", architectures=(ARCH,), model_types=("toy_mixer",), load=_load)
)


def write_checkpoint(
    out: Path, tokenizer_dir: Path, vocab_size: int, hidden: int = 24, seed: int = 0
) -> Path:
    """A random toy checkpoint in ``out`` with the tokenizer files of ``tokenizer_dir``."""
    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            (out / f.name).write_bytes(f.read_bytes())
    gen = torch.Generator().manual_seed(seed)
    save_file(
        {
            "embed.weight": torch.randn(vocab_size, hidden, generator=gen),
            "head.weight": torch.randn(vocab_size, hidden, generator=gen) / hidden**0.5,
        },
        out / "model.safetensors",
    )
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": [ARCH],
                "model_type": "toy_mixer",
                "vocab_size": vocab_size,
                "hidden_size": hidden,
                "max_position_embeddings": 2048,
            }
        )
    )
    return out
