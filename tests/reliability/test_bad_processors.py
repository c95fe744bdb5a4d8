"""A per-request logits processor that misbehaves fails its own request, never the core.

Each case runs one request with a bad processor in the same batch as two others (one
greedy, one seeded sampling) on a fresh engine, on the host path and on the device
path (``NBENGINE_DEVICE_PATH=1``). Expected, as docs/errors.md ("Logits processors")
says: the bad request ends FINISHED_ERROR with ``finish_reason="error"`` and an error
naming the processor and the problem; the other two produce exactly the tokens they
produce without it; the engine serves a new request afterwards and holds nothing.
"""

from __future__ import annotations

import _thread
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import nbengine as nb
from nbengine.request import RequestStatus

from .sizes import ENGINE_KW
from support.engine_state import assert_quiescent
from support.requests import WAIT_S

SP = nb.SamplingParams
FAIL_AT = 3  # the bad processor misbehaves on its request's fourth step
OTHERS = [
    ("Once upon a time", SP(temperature=0, max_tokens=16, ignore_eos=True)),
    ("The cat sat", SP(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)),
]
Processor = Callable[[list[int], torch.Tensor], torch.Tensor]


class _Subclass(torch.Tensor):
    """A tensor subclass: its ``__torch_function__`` would run inside the batch's copy."""


def _raise(exc: BaseException) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(logits: torch.Tensor) -> torch.Tensor:
        raise exc

    return fn


def _freed_storage(logits: torch.Tensor) -> torch.Tensor:
    """Before the storage was checked, copying this into the batch segfaulted the kernel."""
    out = torch.zeros_like(logits)
    out.untyped_storage().resize_(0)  # right shape and dtype; reading it would segfault
    return out


def _no_token(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda logits: torch.full_like(logits, value)


class _CustomBase(BaseException):
    pass


# kind -> (what the processor does at FAIL_AT, a fragment the request's error must hold)
BAD: dict[str, tuple[Callable[[torch.Tensor], Any], str]] = {
    "system-exit": (_raise(SystemExit(3)), "SystemExit"),
    "keyboard-interrupt": (_raise(KeyboardInterrupt()), "KeyboardInterrupt"),
    "generator-exit": (_raise(GeneratorExit()), "GeneratorExit"),
    "custom-base-exception": (_raise(_CustomBase("odd")), "_CustomBase: odd"),
    "sparse": (lambda x: torch.zeros_like(x).to_sparse(), "layout torch.sparse_coo"),
    "meta": (lambda x: torch.empty(x.shape, device="meta"), "device meta"),
    "freed-storage": (_freed_storage, "storage"),
    "int-dtype": (lambda x: torch.zeros(x.shape, dtype=torch.int64), "dtype torch.int64"),
    "complex-dtype": (lambda x: torch.zeros(x.shape, dtype=torch.complex64), "complex64"),
    "subclass": (lambda x: torch.zeros_like(x).as_subclass(_Subclass), "_Subclass"),
    "resized-row": (lambda x: x.resize_(2 * x.shape[0]), "shape (800,)"),
    "all-nan": (_no_token(float("nan")), "no token"),
    "all-minus-inf": (_no_token(float("-inf")), "no token"),
    "not-a-tensor": (lambda x: x.tolist(), "list"),
}
DEVICE_PATH_KINDS = ["system-exit", "keyboard-interrupt", "sparse", "meta", "freed-storage"]


_baseline: dict[str, list[list[int]]] = {}


def _others_alone(make_engine: Callable[..., nb.Engine], path: str) -> list[list[int]]:
    """The other two requests' tokens without the bad request (once per path)."""
    if path not in _baseline:
        engine = make_engine(dtype="float32", **ENGINE_KW)
        handles = [engine.generate(p, params) for p, params in OTHERS]
        _baseline[path] = [h.result(timeout=WAIT_S).outputs[0].token_ids for h in handles]
        engine.shutdown()
    return _baseline[path]


def _gated(misbehave: Callable[[torch.Tensor], Any], released: threading.Event) -> Processor:
    """A processor that waits (on its first call) until the others are submitted, then
    forces token 5 until step FAIL_AT, where it does ``misbehave``."""

    def bad_processor(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if not output_ids:
            released.wait(WAIT_S)  # holds the first step: the others join the next one
        if len(output_ids) == FAIL_AT:
            return misbehave(logits)  # type: ignore[no-any-return]
        out = torch.full_like(logits, float("-inf"))
        out[5] = 0.0
        return out

    return bad_processor


def _run_beside_others(
    engine: nb.Engine, processor: Processor, released: threading.Event
) -> tuple[nb.RequestOutput, list[list[int]]]:
    bad = engine.generate("x", SP(logits_processors=[processor], max_tokens=12, ignore_eos=True))
    others = [engine.generate(p, params) for p, params in OTHERS]
    released.set()
    final = bad.result(timeout=WAIT_S)
    return final, [h.result(timeout=WAIT_S).outputs[0].token_ids for h in others]


def _check_fails_alone(make_engine: Callable[..., nb.Engine], path: str, kind: str) -> None:
    misbehave, fragment = BAD[kind]
    want = _others_alone(make_engine, path)
    engine = make_engine(dtype="float32", **ENGINE_KW)
    released = threading.Event()
    final, got = _run_beside_others(engine, _gated(misbehave, released), released)
    assert final.status is RequestStatus.FINISHED_ERROR, (final.status, final.error)
    assert final.outputs[0].finish_reason == "error"
    assert final.error is not None
    assert "logits processor" in final.error and "bad_processor" in final.error, final.error
    assert fragment in final.error, final.error
    assert final.outputs[0].token_ids[:FAIL_AT] == [5] * FAIL_AT
    assert got == want, "another request of the batch changed"
    assert engine.is_alive
    after = engine.generate("after", SP(max_tokens=4, ignore_eos=True)).result(timeout=WAIT_S)
    assert len(after.outputs[0].token_ids) == 4
    assert_quiescent(engine)


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_processor_fails_only_its_request(
    make_engine: Callable[..., nb.Engine], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NBENGINE_DEVICE_PATH", "0")
    _check_fails_alone(make_engine, "host", kind)


@pytest.mark.parametrize("kind", DEVICE_PATH_KINDS)
def test_a_bad_processor_fails_only_its_request_on_the_device_path(
    make_engine: Callable[..., nb.Engine], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NBENGINE_DEVICE_PATH", "1")
    _check_fails_alone(make_engine, "device", kind)


def _zero_the_storage(logits: torch.Tensor) -> torch.Tensor:
    """Writes zeros into all of the storage behind ``logits``: when ``logits`` is a view
    of the batch's logits, every other row too."""
    n = logits.untyped_storage().nbytes() // logits.element_size()
    logits.as_strided((n,), (1,), 0).zero_()
    return _forced(logits)


def _free_the_storage(logits: torch.Tensor) -> torch.Tensor:
    """Frees the storage behind ``logits`` and returns a fresh, valid row."""
    out = _forced(logits)
    logits.untyped_storage().resize_(0)
    return out


def _forced(logits: torch.Tensor) -> torch.Tensor:
    out = torch.full(logits.shape, float("-inf"), dtype=logits.dtype, device=logits.device)
    out[5] = 0.0
    return out


@pytest.mark.parametrize("tamper", [_zero_the_storage, _free_the_storage])
@pytest.mark.parametrize("where", ["host", "device"])
def test_a_processor_reaches_only_its_own_row(
    make_engine: Callable[..., nb.Engine],
    monkeypatch: pytest.MonkeyPatch,
    tamper: Callable[[torch.Tensor], torch.Tensor],
    where: str,
) -> None:
    """Whatever a processor does to the tensor it is given, in place, stays in that
    tensor: the other rows of the batch are untouched, and a valid result is used."""
    monkeypatch.setenv("NBENGINE_DEVICE_PATH", "1" if where == "device" else "0")
    want = _others_alone(make_engine, where)
    engine = make_engine(dtype="float32", **ENGINE_KW)
    released = threading.Event()
    final, got = _run_beside_others(engine, _gated(tamper, released), released)
    assert final.status is RequestStatus.FINISHED_LENGTH_CAPPED, (final.status, final.error)
    assert final.outputs[0].token_ids == [5] * 12
    assert got == want, "a processor changed another request's logits"
    assert_quiescent(engine)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_a_processor_may_return_another_float_dtype(
    make_engine: Callable[..., nb.Engine], dtype: torch.dtype
) -> None:
    """A real floating-point result is converted to the logits' dtype (float32)."""
    engine = make_engine(dtype="float32", **ENGINE_KW)

    def force_7(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        out = torch.full(logits.shape, float("-inf"), dtype=dtype)
        out[7] = 0.0
        return out

    params = SP(logits_processors=[force_7], max_tokens=4, ignore_eos=True)
    out = engine.generate("x", params).result(timeout=WAIT_S)
    assert out.status is RequestStatus.FINISHED_LENGTH_CAPPED, out.error
    assert out.outputs[0].token_ids == [7] * 4


def test_the_error_names_the_processor_when_str_of_the_exception_fails(
    make_engine: Callable[..., nb.Engine],
) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no str")

    def bad_processor(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        raise Unprintable()

    engine = make_engine(dtype="float32", **ENGINE_KW)
    out = engine.generate("x", SP(logits_processors=[bad_processor], max_tokens=4)).result(
        timeout=WAIT_S
    )
    assert out.status is RequestStatus.FINISHED_ERROR
    assert out.error is not None and "bad_processor" in out.error and "Unprintable" in out.error
    assert engine.generate("y", SP(max_tokens=2)).result(timeout=WAIT_S).finished


def test_a_ctrl_c_while_a_processor_runs_reaches_the_waiting_caller(
    make_engine: Callable[..., nb.Engine],
) -> None:
    """The kernel's interrupt goes to the main thread, where the caller waits: the
    request is aborted there and the KeyboardInterrupt propagates. The processor on the
    core thread is not what receives it, and the engine goes on."""
    engine = make_engine(dtype="float32", **ENGINE_KW)
    sent = threading.Event()

    def interrupts_the_caller(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_ids) == 2 and not sent.is_set():
            sent.set()
            _thread.interrupt_main()  # as SIGINT from the kernel does
        return logits

    params = SP(logits_processors=[interrupts_the_caller], max_tokens=100_000, ignore_eos=True)
    h = engine.generate("x", params)
    with pytest.raises(KeyboardInterrupt):
        h.result(timeout=WAIT_S)
    assert sent.is_set()
    assert h.status is RequestStatus.FINISHED_ABORTED
    assert engine.is_alive
    after = engine.generate("after", SP(max_tokens=4, ignore_eos=True)).result(timeout=WAIT_S)
    assert len(after.outputs[0].token_ids) == 4
    assert_quiescent(engine)
