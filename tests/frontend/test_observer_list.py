"""ObserverList: each hook reaches every observer directly, with no relay between.

The output processor calls ``observers.on_tokens(...)`` for every token of every stream
(docs/architecture.md, "The output path"); the list calls each observer's bound hook
itself, resolved when the observer was added, not through a by-name dispatcher per call.
"""

from __future__ import annotations

import inspect
import logging

import pytest

from nbengine.frontend.observer import EngineObserver, ObserverList


class _Recorder(EngineObserver):
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.callers: list[str] = []

    def on_tokens(
        self, key: str, num_output_tokens: int, now: float, num_cached_tokens: int | None
    ) -> None:
        self.calls.append((key, num_output_tokens))
        self.callers.append(inspect.stack(0)[2].function)


def _notify_tokens(observers: ObserverList) -> None:
    observers.on_tokens("k", 3, 0.0, None)


def test_hook_is_called_by_the_list_hook_itself_no_relay() -> None:
    observers = ObserverList()
    rec = _Recorder()
    observers.add(rec)
    _notify_tokens(observers)
    assert rec.calls == [("k", 3)]
    # frame 1 is ObserverList.on_tokens, frame 2 its caller: nothing in between.
    assert rec.callers == ["_notify_tokens"]


def test_raising_hook_is_logged_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(EngineObserver):
        def on_tokens(self, *args: object) -> None:  # type: ignore[override]
            raise RuntimeError("boom")

    observers = ObserverList()
    rec = _Recorder()
    observers.add(Broken())
    observers.add(rec)
    observers.add(object())  # type: ignore[arg-type]  # no hooks at all: skipped
    with caplog.at_level(logging.ERROR):
        _notify_tokens(observers)
    assert rec.calls == [("k", 3)]
    assert "on_tokens hook" in caplog.text and "boom" in caplog.text


def test_removed_observer_gets_nothing_and_adding_twice_is_once() -> None:
    observers = ObserverList()
    rec = _Recorder()
    observers.add(rec)
    observers.add(rec)
    _notify_tokens(observers)
    observers.remove(rec)
    _notify_tokens(observers)
    assert rec.calls == [("k", 3)]
    with pytest.raises(ValueError, match="not registered"):
        observers.remove(rec)
