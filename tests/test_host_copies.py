"""The host tier's copier thread on its own: copies come back in order, equal and apart from
their sources, and a failed copy comes back empty without stopping the ones after it."""

from __future__ import annotations

import torch

from headstart.engine.host_copies import HostCopies
from headstart.engine.prompt_cache import CacheEntry, Snapshot


def snapshot(seed: int, length: int = 5) -> Snapshot:
    g = torch.Generator().manual_seed(seed)
    state = {
        "recurrent": torch.randn(2, 3, 4, generator=g),
        "keys": torch.randn(2, length, 4, generator=g),
    }
    return Snapshot(length, state, torch.randn(7, generator=g))


class Broken(Snapshot):
    def to_host(self, non_blocking: bool = False, into: torch.Tensor | None = None) -> Snapshot:
        raise RuntimeError("no host memory")


def test_copies_come_back_in_order_equal_and_apart():
    copies = HostCopies(torch.device("cpu"))
    entries = [CacheEntry((i, i + 1), 0, snapshot(i)) for i in range(4)]
    broken = CacheEntry((9,), 0, Broken(1, {"recurrent": torch.zeros(1)}, None))
    for entry in (*entries[:2], broken, *entries[2:]):
        copies.submit(entry)
    assert copies.pending == 5
    done = copies.wait_all()
    assert copies.pending == 0 and copies.finished() == []
    assert [d.entry for d in done] == [*entries[:2], broken, *entries[2:]]
    assert done[2].host is None and done[2].nbytes == 0  # failed alone
    for d in (*done[:2], *done[3:]):
        src, host = d.entry.payload, d.host
        assert d.nbytes == src.nbytes() > 0 and d.seconds >= 0
        assert host.fingerprint() == src.fingerprint()
        assert all(
            host.state[k].data_ptr() != src.state[k].data_ptr() for k in src.state
        )  # a copy, not a view: the source's row may be reused once it is back
    copies.close()
