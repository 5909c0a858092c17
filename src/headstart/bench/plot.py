"""A PNG of TTFT per arm and stream count (box plots, one box per arm in each cell).

Optional: matplotlib is an extra (``pip install 'headstart[bench]'``); without it the plot
is skipped with a warning and the receipt is complete without it. Uses the Agg backend so
it runs on headless machines.

Non-goals: any other figure; interactive display.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from headstart.bench.rows import Row
from headstart.bench.summary import PHASES


def plot_ttft(rows: list[Row], arms: list[str], path: Path) -> bool:
    """Write the plot to ``path``; False (and a warning on stderr) if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "headstart bench: warning: matplotlib is not installed; skipping the TTFT plot "
            "(pip install 'headstart[bench]')",
            file=sys.stderr,
        )
        return False
    cells = sorted(
        {(r["phase"], r["streams"]) for r in rows}, key=lambda c: (PHASES.index(c[0]), c[1])
    )
    width = 0.8 / max(len(arms), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(cells) * max(1, len(arms) / 2)), 4.5))
    for i, arm in enumerate(arms):
        data = [
            [
                r["ttft_s"] * 1e3
                for r in rows
                if r["arm"] == arm
                and r["ttft_s"] is not None
                and (r["phase"], r["streams"]) == cell
            ]
            for cell in cells
        ]
        positions = [c - 0.4 + width * (i + 0.5) for c in range(len(cells))]
        keep = [(p, d) for p, d in zip(positions, data, strict=False) if d]
        if not keep:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # matplotlib renames box-plot keywords across versions
            box = ax.boxplot(
                [d for _, d in keep],
                positions=[p for p, _ in keep],
                widths=width * 0.9,
                patch_artist=True,
                showfliers=True,
                medianprops={"color": "black"},
            )
        color = f"C{i % 10}"
        for patch in box["boxes"]:
            patch.set_facecolor(color)
            patch.set_alpha(0.6)
        ax.plot([], [], color=color, linewidth=8, alpha=0.6, label=arm)
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels(
        [f"{phase}\n{streams} stream{'s' if streams > 1 else ''}" for phase, streams in cells]
    )
    ax.set_xlim(-0.6, len(cells) - 0.4)
    ax.set_ylabel("TTFT (ms, client clock)")
    ax.set_title("Time to first token per arm and stream count")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
