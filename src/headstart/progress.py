"""Progress of the long start-up phases (loading weights, capturing graphs) on a terminal.

A phase shows a bar (tqdm, on stderr) only when stderr is a terminal; redirected to a file or a
pipe it shows nothing, and the phase's log line (``serve`` and ``engine/runner.py`` log the time
of each) is what a log reader gets. The bar is cleared when the phase ends.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress(label: str, total: int) -> Iterator[Callable[[], None]]:
    """A ``tick()`` to call once per done item of ``total``; a bar on a terminal only."""
    stream = sys.stderr
    if total <= 0 or not getattr(stream, "isatty", lambda: False)():
        yield lambda: None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=label, file=stream, leave=False, dynamic_ncols=True) as bar:
        yield bar.update
