"""What a speculative round's pieces cost on a CPU, one stream: the compiled decode step, a
chain verify window eager (recorded) with its rollback against the compiled verify program
with its commit, and the drafter's proposal reading the whole ring against its filled rows.

    PYTHONPATH=. python benchmarks/cpu_verify.py [--model DIR] [--threads 1] [--history 100]

The default model and its drafter, fp32; a stream with ``--history`` tokens in its slot; the
median of 100 calls after two, in milliseconds. Compiles its programs first (from inductor's
cache after the first run).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def median_ms(fn, n: int = 100) -> float:
    fn()
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(ROOT / "src/headstart/default_model"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--history", type=int, default=100)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from headstart.batch import ForwardBatch, SeqChunk
    from headstart.engine.cpu_programs import DecodePrograms, verify_widths
    from headstart.engine.spec.drafter import DFlashDrafter
    from headstart.models.qwen35.model import Qwen35Model

    target = Qwen35Model.load(a.model, dtype=torch.float32, device="cpu")
    drafter = DFlashDrafter.load(Path(a.model) / "drafter", target)
    taps, block = drafter.cfg.target_layer_ids, drafter.cfg.block_size
    at = a.history
    pool = target.new_state_pool(2, at + 2 * block + 8)
    widths = verify_widths(block)
    progs = DecodePrograms(target, pool, 1, 1, widths=(), taps=taps, verify=widths)
    prompt = tuple(range(5, 5 + at))
    out = target.forward_ex(ForwardBatch.build([SeqChunk(0, 0, prompt, 1)]), pool, taps)
    rows = []
    rows.append(("compiled decode step", median_ms(lambda: progs.run([5], [at], [0]))))
    for w in widths:
        tokens = (5,) * w

        def eager(tokens=tokens, w=w) -> None:
            batch = ForwardBatch.build([SeqChunk(0, at, tokens, w, record=True)])
            ran = target.forward_ex(batch, pool, taps)
            target.rollback(pool, 0, ran.records[0], 1)

        def compiled(tokens=tokens) -> None:
            progs.run_verify(tokens, at, 0)
            progs.commit(0, 1)

        rows.append((f"verify window, {w} rows, eager + rollback", median_ms(eager)))
        rows.append((f"verify window, {w} rows, compiled + commit", median_ms(compiled)))
    ring = drafter.new_pool(2, 4096)
    drafter.add_context(ring, 0, out.taps, 0)
    args = (ring, torch.tensor([0]), torch.tensor([5]), torch.tensor([at]), block)
    rows.append(
        ("drafter proposal, whole ring (4096)", median_ms(lambda: drafter.propose_from(*args)))
    )
    rows.append(
        (
            "drafter proposal, filled rows",
            median_ms(lambda: drafter.propose_logits(ring, [0], [5], [at], block)),
        )
    )
    print(f"| {a.threads} thread(s), history {at} | ms |\n|---|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} |")


if __name__ == "__main__":
    main()
