"""All of a model's weight tensors in one device allocation (an arena).

Allocated one by one, a large model's weights are hundreds of allocations; loaded through
intermediate forms (read, cast, stacked, repacked), they can briefly exist twice, which a 27B bf16
model (~54 GB) cannot afford. A :class:`WeightArena` is planned from the exact list of final
tensors (a :class:`Slot` each: key, shape, dtype), allocated once as one ``uint8`` buffer, and
hands out typed views into it. A loader copies each final tensor into its slot as soon as it
exists (:meth:`WeightArena.fill`) and drops the original, so it never holds more than the arena
plus the tensors in flight.

A weight *value* is a tensor, or a dataclass (e.g. a quantized weight) whose tensor-valued fields
are its tensors and whose other fields are kept as they are. :func:`leaves` takes a value apart,
:func:`rebuild` puts it back together over other tensors (views, meta stand-ins). The slot key of
a bare tensor is the weight's name; that of a dataclass field is ``name.field``.

:class:`ArenaPlan` records the slots while a loader runs on meta tensors (shapes and dtypes only,
see :func:`to_meta`); the real run must then produce exactly those slots, else
:class:`ArenaMismatch`. Nothing here knows about models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

ALIGN = 256  # bytes: every slot's address is a multiple (any dtype view, vector loads)

V = TypeVar("V")


class ArenaMismatch(RuntimeError):
    """The real load produced tensors other than those planned from the meta run."""


@dataclass(frozen=True)
class Slot:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _itemsize(self.dtype)

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} {tuple(self.shape)}"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def leaves(value: Any) -> list[tuple[str, torch.Tensor]]:
    """A weight's tensors as (field, tensor): ``("", value)`` for a bare tensor, else every
    tensor-valued field of the dataclass, in field order."""
    if isinstance(value, torch.Tensor):
        return [("", value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
        return [(name, t) for name, t in out if isinstance(t, torch.Tensor)]
    raise TypeError(f"a weight must be a tensor or a dataclass of tensors, not {type(value)}")


def rebuild(value: V, tensors: Mapping[str, torch.Tensor]) -> V:
    """``value`` with its tensors replaced by ``tensors`` (keyed as :func:`leaves` names them)."""
    if isinstance(value, torch.Tensor):
        return tensors[""]  # type: ignore[return-value]
    return dataclasses.replace(value, **tensors)  # type: ignore[type-var]


def to_meta(value: V) -> V:
    """A stand-in for ``value`` with the same shapes and dtypes on the meta device (no data)."""
    return rebuild(
        value, {f: torch.empty(t.shape, dtype=t.dtype, device="meta") for f, t in leaves(value)}
    )


def slot_key(name: str, field: str) -> str:
    return f"{name}.{field}" if field else name


def layout(slots: Sequence[Slot]) -> tuple[list[int], int]:
    """Byte offset of each slot (each aligned to :data:`ALIGN`) and the total size."""
    offsets, end = [], 0
    for s in slots:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + s.nbytes
    return offsets, -(-end // ALIGN) * ALIGN


class _Shared:
    """Tensors already given a slot, by identity: a value that reuses one (e.g. a tied head that
    is the embedding table itself) shares that slot instead of taking a second."""

    def __init__(self) -> None:
        self._by_id: dict[int, torch.Tensor] = {}  # holds the tensors, so ids are never reused

    def __contains__(self, t: torch.Tensor) -> bool:
        return self._by_id.get(id(t)) is t

    def add(self, t: torch.Tensor) -> None:
        self._by_id[id(t)] = t


class ArenaPlan:
    """Collects the slots of a loader's meta run: :meth:`add` every final weight, in any order,
    then :meth:`allocate`."""

    def __init__(self) -> None:
        self.slots: list[Slot] = []
        self._shared = _Shared()

    def add(self, name: str, value: V) -> V:
        """Record ``value``'s tensors as slots (those already recorded are shared); returns it."""
        for field, t in leaves(value):
            if t in self._shared:
                continue
            self.slots.append(Slot(slot_key(name, field), tuple(t.shape), t.dtype))
            self._shared.add(t)
        return value

    def allocate(self, device: torch.device | str) -> WeightArena:
        return WeightArena(self.slots, device)


class WeightArena:
    """One ``uint8`` buffer on ``device`` holding every slot; :meth:`fill` copies weights in."""

    def __init__(self, slots: Sequence[Slot], device: torch.device | str) -> None:
        offsets, total = layout(slots)
        self.slots: dict[str, tuple[Slot, int]] = {}
        for s, off in zip(slots, offsets, strict=True):
            if s.key in self.slots:
                raise ValueError(f"two arena slots named {s.key!r}")
            self.slots[s.key] = (s, off)
        # Slots are aligned in memory, not only within the buffer: the CPU allocator gives 64
        # bytes (CUDA's 512), so take one alignment more and start at the first boundary.
        raw = torch.empty(total + ALIGN, dtype=torch.uint8, device=device)
        start = -raw.data_ptr() % ALIGN
        self.buffer = raw[start : start + total]
        self._filled: set[str] = set()
        self._shared = _Shared()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def __len__(self) -> int:
        return len(self.slots)

    def data_ptr(self) -> int:
        """The address of the arena's storage (every view shares it)."""
        return self.buffer.untyped_storage().data_ptr()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view into this arena."""
        return t.device == self.buffer.device and t.untyped_storage().data_ptr() == self.data_ptr()

    def view(self, key: str) -> torch.Tensor:
        """The slot's tensor: its bytes viewed as its dtype and shape (contiguous)."""
        s, off = self.slots[key]
        return self.buffer[off : off + s.nbytes].view(s.dtype).view(s.shape)

    def fill(self, name: str, value: V) -> V:
        """Copy ``value``'s tensors into their slots and return it rebuilt over the views (the
        caller drops the original). Tensors that are already views handed out here stay shared.
        Raises :class:`ArenaMismatch` for a tensor that was not planned, differs from its plan,
        or was filled before."""
        views = {}
        for field, t in leaves(value):
            if t in self._shared:
                views[field] = t
                continue
            key = slot_key(name, field)
            if key not in self.slots:
                slot = Slot(key, tuple(t.shape), t.dtype).describe()
                raise ArenaMismatch(f"weight {key!r} ({slot}) was not in the arena's plan")
            s, _ = self.slots[key]
            if (tuple(t.shape), t.dtype) != (s.shape, s.dtype):
                raise ArenaMismatch(
                    f"weight {key!r} is {Slot(key, tuple(t.shape), t.dtype).describe()}, "
                    f"the arena planned {s.describe()}"
                )
            if key in self._filled:
                raise ArenaMismatch(f"weight {key!r} was placed in the arena twice")
            v = self.view(key)
            v.copy_(t)
            self._filled.add(key)
            self._shared.add(v)
            views[field] = v
        return rebuild(value, views)

    def check_complete(self) -> None:
        """Raise :class:`ArenaMismatch` if a planned slot was never filled."""
        missing = [k for k in self.slots if k not in self._filled]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ArenaMismatch(f"planned arena slots never loaded: {', '.join(missing[:5])}{more}")
