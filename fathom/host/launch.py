"""A launch: one kernel launch (or torch op) with every argument bound, enqueued on the stream it is given.

A decode step, a warm-up, a token's appends and a CUDA graph capture are all lists of launches, run by the one
:func:`run_launches`.
"""

from __future__ import annotations

from typing import Callable, Iterable

Launch = Callable[[object], None]  # fn(stream)


def run_launches(launches: Iterable[Launch], stream) -> None:
    """Enqueue ``launches`` in order on ``stream``."""
    for launch in launches:
        launch(stream)
