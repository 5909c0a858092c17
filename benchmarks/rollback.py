"""GDN rollback after partial acceptance: per-row state snapshots vs replaying the kept rows.

For one GDN layer at the 2B shape (16 key/value heads, Dk = Dv = 128) and a verify window of B
rows, measures (a) the verify forward plus the commit for each strategy, and (b) the extra memory
each keeps per stream. Snapshots: the window runs step by step keeping every row's state, the
commit copies state[a]. Replay: the window runs chunked keeping only the initial state, the commit
recomputes rows 0..a from it. Prints a table; the last line is JSON.

    python benchmarks/rollback.py [--device cpu] [--block 16]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from headstart.ops.gated_delta.reference import chunked_gated_delta, gated_delta_step


def timed(fn, reps: int, device: str) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dev, B, H, D = args.device, args.block, 16, 128
    g = torch.Generator(device=dev).manual_seed(0)
    q, k = (torch.randn(B, H, D, device=dev, generator=g) for _ in range(2))
    v = torch.randn(B, H, D, device=dev, generator=g)
    decay = -torch.rand(B, H, device=dev, generator=g)
    beta = torch.rand(B, H, device=dev, generator=g)
    state = torch.randn(H, D, D, device=dev, generator=g)

    def snapshots(a: int):
        states, s = [], state[None]
        for t in range(B):
            _, s = gated_delta_step(
                q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1], beta[t : t + 1], s
            )
            states.append(s)
        return states[a].clone()

    def replay(a: int):
        initial = state.clone()
        chunked_gated_delta(q, k, v, decay, beta, state)  # the verify itself
        if a + 1 < B:
            return chunked_gated_delta(
                q[: a + 1], k[: a + 1], v[: a + 1], decay[: a + 1], beta[: a + 1], initial
            )[1]
        return None

    rows = []
    for a in (0, B // 4, B - 1):
        rows.append(
            {
                "accepted": a,
                "snapshots_ms": timed(lambda: snapshots(a), args.reps, dev) * 1e3,
                "replay_ms": timed(lambda: replay(a), args.reps, dev) * 1e3,
            }
        )
    state_bytes = H * D * D * 4
    mem = {
        "snapshots_extra_bytes": B * state_bytes,
        "replay_extra_bytes": state_bytes + B * (3 * H * D + 2 * H) * 4,
    }
    print(f"# {dev}, one GDN layer (16 heads, 128x128 fp32 state), window {B}")
    print(f"{'accepted':>8} {'snapshots ms':>13} {'replay ms':>10}")
    for r in rows:
        print(f"{r['accepted']:>8} {r['snapshots_ms']:>13.2f} {r['replay_ms']:>10.2f}")
    print(
        f"extra memory per stream per layer: snapshots {mem['snapshots_extra_bytes'] / 2**20:.1f} "
        f"MiB, replay {mem['replay_extra_bytes'] / 2**20:.2f} MiB"
    )
    print(json.dumps({"rows": rows, **mem}))


if __name__ == "__main__":
    main()
