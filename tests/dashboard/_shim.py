"""Obsolete: the engine now wires its metrics and widgets itself.

Kept only so that notebooks written before the wiring (``import _shim;
_shim.install()``) still run; ``install()`` does nothing. Delete once none uses it.
"""

from __future__ import annotations


def install() -> None:
    """No-op (the engine is wired)."""
