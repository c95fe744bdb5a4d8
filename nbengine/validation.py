"""Checks shared by every validator of user input (config, params, prompts, chats).

``bool`` is a subclass of ``int`` in Python, so ``isinstance(True, int)`` holds; an
argument such as ``max_tokens=True`` must still be rejected with a TypeError naming the
field. These predicates say "an int (or number) that is not a bool" once.
"""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["check_encodable", "is_int", "is_number"]


def is_int(value: object) -> TypeGuard[int]:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """True for an ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_encodable(what: str, text: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate cannot be UTF-8 encoded,
    and the tokenizers library would fail with an obscure TypeError); ``what`` names it."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} is not valid Unicode: it has a lone surrogate {text[exc.start]!r} at "
            f"character {exc.start}."
        ) from None
