"""Start-up progress: a bar on a terminal, nothing when stderr is a file or a pipe."""

from __future__ import annotations

import io

from headstart.loading import load
from headstart.progress import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_only(monkeypatch):
    tty, pipe = Terminal(), io.StringIO()
    for stream in (tty, pipe):
        monkeypatch.setattr("sys.stderr", stream)
        with progress("capturing", 3) as tick:
            for _ in range(3):
                tick()
    assert "capturing" in tty.getvalue() and "/3" in tty.getvalue()  # (redraws are throttled)
    assert pipe.getvalue() == ""


def test_loading_weights_shows_progress_on_a_terminal(monkeypatch):
    tty = Terminal()
    monkeypatch.setattr("sys.stderr", tty)
    model = load().model
    shown = tty.getvalue()
    assert "loading weights" in shown
    # The bar counts every weight the model ends with (fused ones once), the head included.
    total = shown.rsplit("loading weights", 1)[1].split("|")[2].split()[0].split("/")[1]
    assert int(total) == len(model.w) + 1
