"""``TraitWriter``: set a widget trait only when its value changed.

Every view refreshes about ten times a second (nbengine/dashboard/updater.py); writing
an unchanged trait would still send a message to the browser. A view writes through one
``TraitWriter``, which remembers what it last wrote per (widget, trait) and counts the
writes that went out (the coalescing tests read the count).
"""

from __future__ import annotations

from typing import Any

__all__ = ["TraitWriter"]

_UNSET: Any = object()


class TraitWriter:
    """The traits one view wrote, and how many writes actually went out."""

    def __init__(self) -> None:
        self._shown: dict[tuple[int, str], Any] = {}
        self.writes = 0

    def set(self, widget: Any, name: str, value: Any) -> None:
        """``widget.<name> = value`` unless that is the value last written there."""
        key = (id(widget), name)
        if self._shown.get(key, _UNSET) == value:
            return
        self._shown[key] = value
        setattr(widget, name, value)
        self.writes += 1
