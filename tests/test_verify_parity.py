"""benchmarks/verify_parity.py at its tiny shape on the CPU (float32): 16 streams' verify
windows in one forward, each window alone, and the one-shot prefill of each stream all give the
one-row decode steps' logits and argmax, row for row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import verify_parity as vp


def test_every_path_gives_the_decode_steps_logits(tmp_path, capsys):
    out = tmp_path / "parity.json"
    args = ["--shape", "tiny", "--format", "4bit", "--device", "cpu", "--streams", "1", "16"]
    vp.main([*args, "--windows", "2", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert {(r["streams"], r["path"], r["against"]) for r in rows} == {
        (s, p, a)
        for s in (1, 16)
        for p, a in [("windows", "steps"), ("alone", "steps"), ("oneshot", "steps")]
        + [("windows", "oneshot"), ("alone", "oneshot"), ("steps", "oneshot")]
    }
    for r in rows:
        assert r["rows"] == r["streams"] * 16
        assert r["argmax_differs"] == 0 and r["max_over_std"] < 1e-3, r
    assert "argmax differs" in capsys.readouterr().out
