"""The threads engines start (docs/architecture.md, Threads)."""

from __future__ import annotations

import threading


def engine_threads() -> list[threading.Thread]:
    """Live threads an engine owns: its loop and core threads.

    The one-shot ``nbengine-preload`` thread (widget imports in a kernel) is no engine's.
    """
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith("nbengine") and t.name != "nbengine-preload"
    ]
