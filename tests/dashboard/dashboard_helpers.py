"""Helpers shared by the widget tests."""

from __future__ import annotations

import time
from collections.abc import Callable

import nbengine as nb


def long_params(**kw: object) -> nb.SamplingParams:
    """A request that runs until aborted."""
    return nb.SamplingParams(max_tokens=3000, ignore_eos=True, **kw)  # type: ignore[arg-type]


def wait_until(cond: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    """Poll ``cond`` (generous timeout; the machine is shared and slow)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
