"""The progress bar of a model load (``tqdm.auto``: a widget in a notebook, text in a
terminal; docs/models.md, "Loading").

Shown only where someone watches: on the main thread of an interactive process (a
Jupyter kernel, or stderr a terminal), and only for a checkpoint big enough to make them
wait (``MIN_BYTES``: a small model loads in well under a second, and a bar that flashes
by is noise in a notebook's output). ``NBENGINE_PROGRESS=0`` asks it off,
``NBENGINE_PROGRESS=1`` on for any size. Never from another thread (an engine's threads,
a server's workers): their output would land in whichever notebook cell runs next.
"""

from __future__ import annotations

import os
import sys
import threading
from types import TracebackType
from typing import Any

__all__ = ["MIN_BYTES", "LoadProgress", "progress_enabled"]

# The checkpoint size from which a load shows its bar unasked (about a second's read).
MIN_BYTES = 256 * 1024 * 1024


def _in_kernel() -> bool:
    if "IPython" not in sys.modules:  # never import IPython just to ask
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def progress_enabled(nbytes: int) -> bool:
    """Whether a load of a ``nbytes`` checkpoint here shows its bar (module docstring)."""
    asked = os.environ.get("NBENGINE_PROGRESS", "")
    if asked == "0" or (asked != "1" and nbytes < MIN_BYTES):
        return False
    if threading.current_thread() is not threading.main_thread():
        return False
    return _in_kernel() or sys.stderr.isatty()


class LoadProgress:
    """A context manager counting the tensors of a load; a no-op when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="tensor", leave=False)

    @property
    def shown(self) -> bool:
        """True when a bar is on screen."""
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        """Count ``n`` more tensors done."""
        if self._bar is not None:
            self._bar.update(n)

    def set_description(self, desc: str) -> None:
        """Say what the load does now."""
        if self._bar is not None:
            self._bar.set_description(desc, refresh=False)

    def __enter__(self) -> LoadProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.close()
