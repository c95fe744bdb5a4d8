"""Draft policies for tests of speculative decoding (core/spec_decode.py, ``DraftPolicy``).

The shipped policy chooses each step's draft count from measured step times, so which
steps carry drafts depends on the host's load. Tests of what verification does (parity,
stops, counters) install ``AllDrafts`` so every step drafts all the room allows;
``RandomK`` picks the count at random, to show outputs never depend on the choice.
"""

from __future__ import annotations

import random

from nbengine.core.spec_decode import DraftPolicy


class AllDrafts(DraftPolicy):
    """Always as many drafts as the room allows."""

    def choose(self, request_id: str, rows: int, tokens: float, k_cap: int) -> int:
        return min(k_cap, self.k_max)


class RandomK(DraftPolicy):
    """A random draft count per step, 0 (a plain decode) included."""

    def __init__(self, k_max: int, seed: int) -> None:
        super().__init__(k_max)
        self.rng = random.Random(seed)
        self.chosen: list[int] = []

    def choose(self, request_id: str, rows: int, tokens: float, k_cap: int) -> int:
        k = self.rng.randint(0, min(k_cap, self.k_max))
        self.chosen.append(k)
        return k


def always_draft(engine: object) -> None:
    """Install ``AllDrafts`` in an in-process ``nb.Engine`` (before its first request)."""
    scheduler = engine._core.scheduler  # type: ignore[attr-defined]
    scheduler.spec_policy = AllDrafts(scheduler.spec_policy.k_max)
