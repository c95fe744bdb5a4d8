"""Requests that run until aborted, and waits bounded for a shared, noisy machine."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import nbengine as nb

WAIT_S = 60.0  # every wait is bounded by this: generous, the machine is shared and slow


def long_params(max_tokens: int = 100_000, **kw: Any) -> nb.SamplingParams:
    """Parameters of a request that runs until it is aborted (or reaches max_model_len)."""
    return nb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def wait_until(cond: Callable[[], bool], timeout: float = WAIT_S, what: str = "condition") -> None:
    """Poll ``cond`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def wait_first_token(h: nb.RequestHandle, timeout: float = WAIT_S) -> None:
    """Wait, without consuming the stream, until the request has produced a token.

    Fails at once if the request finishes without one.
    """
    deadline = time.monotonic() + timeout
    while not h.token_ids:
        assert not h.done(), f"{h.request_id} finished before its first token"
        assert time.monotonic() < deadline, f"no token from {h.request_id} in {timeout} s"
        time.sleep(0.002)
