"""Type checks shared by every validator of user input (config, params, prompts).

``bool`` is a subclass of ``int`` in Python, so ``isinstance(True, int)`` holds; an
argument such as ``max_tokens=True`` must still be rejected with a TypeError naming the
field. These predicates say "an int (or number) that is not a bool" once.
"""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["is_int", "is_number"]


def is_int(value: object) -> TypeGuard[int]:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """True for an ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
