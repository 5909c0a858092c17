"""Per-stream decode state, preallocated once and indexed by slot, in the groups a model declares.

A stream (one request being generated) owns one slot. A model family declares its state as
:class:`StateGroup` values: a named tensor per layer and slot, either of fixed size (Qwen3.5's GDN
conv tails and recurrent states, a Mamba2 mixer's conv and SSM states) or with one row per token
of the stream (attention key and value rows). :class:`StatePool` allocates every group once,
``[layers, slots, *shape]``, and gives the engine what it needs without knowing the family:
a slot's state up to a length (snapshots), writing it back (restores), copying one slot into
another (graph scratch slots), and byte counts. Model code reads its own groups by name
(``pool.conv``, ``pool["keys"]``). Nothing here is allocated per request. A slot whose stream
starts at position 0 is treated as empty by the forward, so slots need no clearing between
requests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["StateGroup", "StatePool"]


@dataclass(frozen=True)
class StateGroup:
    """One named per-slot state tensor of a model family, for each of ``layers`` layers.

    ``shape`` is the tensor of one layer and slot without its token axis; a per-token group
    (``token_axis`` set) holds ``max_tokens`` rows along that axis of ``shape`` (KV rows:
    ``shape=(kv_heads, head_dim), token_axis=1`` is ``[kv_heads, max_tokens, head_dim]``). A
    fixed-size group has ``token_axis=None``: its whole tensor is the stream's state. ``dtype``
    None means the model's activation dtype.
    """

    name: str
    layers: int
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    token_axis: int | None = None

    @property
    def per_token(self) -> bool:
        return self.token_axis is not None

    def slot_shape(self, max_tokens: int) -> tuple[int, ...]:
        """One layer and slot, the token axis (if any) sized ``max_tokens``."""
        if self.token_axis is None:
            return self.shape
        return self.shape[: self.token_axis] + (max_tokens,) + self.shape[self.token_axis :]

    def dtype_for(self, activation: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None else activation

    def nbytes(self, num_slots: int, max_tokens: int, activation: torch.dtype) -> int:
        n = self.layers * num_slots
        for d in self.slot_shape(max_tokens):
            n *= d
        return n * torch.tensor([], dtype=self.dtype_for(activation)).element_size()


class StatePool:
    """Every state group of a model, ``[layers, slots, *slot_shape]`` each (see the module
    docstring). The group tensors are fixed for the pool's life: graphs capture them."""

    def __init__(
        self, groups: Sequence[StateGroup], tensors: Mapping[str, torch.Tensor], max_tokens: int
    ) -> None:
        if [g.name for g in groups] != list(tensors):
            raise ValueError("one tensor per state group, in the groups' order")
        self.groups = tuple(groups)
        self.tensors = dict(tensors)
        self._max_tokens = max_tokens

    @classmethod
    def allocate(
        cls,
        groups: Sequence[StateGroup],
        num_slots: int,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> StatePool:
        tensors = {
            g.name: torch.zeros(
                (g.layers, num_slots, *g.slot_shape(max_tokens)),
                dtype=g.dtype_for(dtype),
                device=device,
            )
            for g in groups
        }
        return cls(groups, tensors, max_tokens)

    @staticmethod
    def bytes_for(
        groups: Iterable[StateGroup],
        num_slots: int,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
    ) -> int:
        """What :meth:`allocate` would take, computed without allocating."""
        return sum(g.nbytes(num_slots, max_tokens, dtype) for g in groups)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __getattr__(self, name: str) -> torch.Tensor:
        # Model code reads its groups as attributes (pool.conv, pool.keys).
        tensors = self.__dict__.get("tensors")
        if tensors is not None and name in tensors:
            return tensors[name]
        raise AttributeError(name)

    @property
    def num_slots(self) -> int:
        return next(iter(self.tensors.values())).shape[1]

    @property
    def max_tokens(self) -> int:
        return self._max_tokens

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors.values())).device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def fixed_bytes(self) -> int:
        """Bytes of one slot's fixed-size groups (a snapshot's part that has no length)."""
        return sum(t[:, 0].numel() * t.element_size() for g, t in self._pairs() if not g.per_token)

    def token_bytes(self) -> int:
        """Bytes of one token's rows in one slot, over every per-token group."""
        return sum(
            t[:, 0].numel() // self._max_tokens * t.element_size()
            for g, t in self._pairs()
            if g.per_token
        )

    def _pairs(self) -> Iterable[tuple[StateGroup, torch.Tensor]]:
        return ((g, self.tensors[g.name]) for g in self.groups)

    def slot_state(self, slot: int, length: int) -> dict[str, torch.Tensor]:
        """Views of everything the slot's stream reads at positions < ``length``: each fixed
        group's ``[layers, *shape]`` and each per-token group's first ``length`` rows."""
        out = {}
        for g, t in self._pairs():
            view = t[:, slot]
            if g.per_token:
                view = view.narrow(1 + g.token_axis, 0, length)
            out[g.name] = view
        return out

    def load_slot(self, slot: int, state: Mapping[str, torch.Tensor], length: int) -> None:
        """Write ``state`` (as :meth:`slot_state` gives it, ``length`` rows) into ``slot``;
        raises ValueError, writing nothing, when it does not fit this pool."""
        if length > self._max_tokens or set(state) != set(self.tensors):
            raise ValueError("state does not fit this pool")
        views = self.slot_state(slot, length)
        if any(views[name].shape != state[name].shape for name in views):
            raise ValueError("state does not fit this pool")
        for name, view in views.items():
            view.copy_(state[name])

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Make ``dst`` hold what ``src`` holds for positions < ``length``."""
        self.load_slot(dst, self.slot_state(src, length), length)
