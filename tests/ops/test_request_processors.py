"""Per-request logits processors in the sampler: whose KeyboardInterrupt is whose.

A KeyboardInterrupt raised by a processor on any thread but the main one (the engine
core's thread) cannot be a user's Ctrl-C: Python delivers SIGINT to the main thread
only. It fails the processor's request. On the main thread (a caller driving the
sampler itself) it may be a Ctrl-C and propagates (docs/errors.md, "Logits
processors").
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import pytest
import torch

from nbengine.core.request import Request
from nbengine.ops.sampling import Sampler
from nbengine.sampling_params import SamplingParams

V = 16


def _req(key: str, processor: Callable[[list[int], torch.Tensor], torch.Tensor] | None) -> Request:
    params = SamplingParams(temperature=0, logits_processors=[processor] if processor else None)
    return Request(key, [1, 2], params, frozenset({V - 1}), 0.0)


def _interrupting(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    raise KeyboardInterrupt


def _sample_on_another_thread(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
    box: dict[str, object] = {}

    def body() -> None:
        try:
            box["tokens"] = Sampler(0)(logits.clone(), reqs)[0]
        except BaseException as exc:  # reported on the test's thread
            box["error"] = exc

    t = threading.Thread(target=body, name="nbengine-core-like")
    t.start()
    t.join(60)
    assert not t.is_alive()
    assert "error" not in box, repr(box.get("error"))
    return box["tokens"]  # type: ignore[return-value]


def test_a_processors_keyboard_interrupt_off_the_main_thread_fails_its_request() -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    reqs = [_req("bad", _interrupting), _req("good", None)]
    tokens = _sample_on_another_thread(logits, reqs)
    assert reqs[0].error is not None
    assert "_interrupting" in reqs[0].error and "KeyboardInterrupt" in reqs[0].error
    assert "not a kernel interrupt" in reqs[0].error
    assert reqs[1].error is None and tokens[1] == int(logits[1].argmax())


def test_a_keyboard_interrupt_on_the_main_thread_is_never_swallowed() -> None:
    """A real SIGINT (Ctrl-C) that lands while a processor runs on the main thread."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def ctrl_c(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        signal.raise_signal(signal.SIGINT)
        return logits

    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    reqs = [_req("bad", ctrl_c), _req("good", None)]
    with pytest.raises(KeyboardInterrupt):
        Sampler(0)(logits, reqs)
    assert reqs[0].error is None


def test_an_exception_whose_str_raises_base_exception_still_fails_only_its_request() -> None:
    class Odd(Exception):
        def __str__(self) -> str:
            raise SystemExit("from __str__")

    def odd(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        raise Odd()

    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    reqs = [_req("bad", odd), _req("good", None)]
    tokens = _sample_on_another_thread(logits, reqs)
    assert reqs[0].error is not None and "Odd" in reqs[0].error
    assert tokens[1] == int(logits[1].argmax())
