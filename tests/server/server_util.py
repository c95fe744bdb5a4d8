"""Helpers shared by the server tests."""

from __future__ import annotations

import time
from collections.abc import Callable

import nbengine as nb


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``cond`` until true; fail naming ``what`` after ``timeout`` (a hang guard,
    not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.02)


def final_status(engine: nb.Engine, request_id: str) -> str | None:
    """The finish reason of the latest incarnation of ``request_id`` (None while live)."""
    stats = engine.request_stats()
    rows = stats[stats["request_id"] == request_id]
    if rows.empty:
        return None
    reason = rows.iloc[-1]["finish_reason"]
    return reason if isinstance(reason, str) else None  # NaN while it runs
