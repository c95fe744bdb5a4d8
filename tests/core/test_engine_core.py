"""EngineCore.run_busy_loop on its own thread, fed through a FIFO queue."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import pytest

from nbengine.core.messages import EngineCoreMessage, EngineCoreOutputs, MessageType
from nbengine.request import FinishReason, RequestStatus

from .fake_runner import Collected, expected_tokens, make_core, make_request

TIMEOUT = 60.0


class Loop:
    """Runs a core's busy loop on a thread; batches arrive on ``self.out``."""

    def __init__(self, core) -> None:
        self.core = core
        self.q: queue.Queue[EngineCoreMessage] = queue.Queue()
        self.out: queue.Queue[EngineCoreOutputs] = queue.Queue()
        self.thread = threading.Thread(
            target=core.run_busy_loop,
            args=(self.q, self.out.put),
            name="nbengine-core",
            daemon=True,
        )
        self.collected = Collected()

    def __enter__(self) -> Loop:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.q.put(EngineCoreMessage(MessageType.SHUTDOWN))
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive()

    def add(self, request) -> None:
        self.q.put(EngineCoreMessage(MessageType.ADD, request))

    def abort(self, *keys: str) -> None:
        self.q.put(EngineCoreMessage(MessageType.ABORT, list(keys)))

    def until_finished(self, *keys: str) -> Collected:
        """Collect batches until every key has been reported finished."""
        while not all(k in self.collected.finished_count for k in keys):
            self.collected.add(self.out.get(timeout=TIMEOUT))
        return self.collected


def test_generates_and_reports_each_finish_once():
    core = make_core()
    with Loop(core) as loop:
        loop.add(make_request("a", [1, 2, 3], max_tokens=5))
        loop.add(make_request("b", [10], max_tokens=3))
        c = loop.until_finished("a", "b")
    assert c.tokens == {"a": [4, 5, 6, 7, 8], "b": [11, 12, 13]}
    assert c.finished_count == {"a": 1, "b": 1}
    assert not core.has_unfinished_requests()


def test_add_then_abort_same_key_fifo_reports_once():
    core = make_core()
    loop = Loop(core)
    # Both queued before the loop starts: processed in one FIFO drain.
    loop.add(make_request("x", [1, 2, 3], max_tokens=50))
    loop.abort("x")
    with loop:
        c = loop.until_finished("x")
        # Emitted straight after the inputs were processed, before any step ran.
        assert c.batches[0].finished == {"x"} and c.batches[0].step is None
        assert core.runner.batches == []
        # A later, valid reuse of the key runs to completion.
        loop.add(make_request("x", [5], max_tokens=2))
        loop.collected.finished_count.pop("x")
        c = loop.until_finished("x")
    assert c.tokens["x"] == [6, 7]
    assert c.finish["x"] == FinishReason.LENGTH
    aborted = [o for b in c.batches for o in b.outputs if o.finish_reason == FinishReason.ABORT]
    assert len(aborted) == 1 and aborted[0].status == RequestStatus.FINISHED_ABORTED
    assert sum("x" in b.finished for b in c.batches) == 2  # once per incarnation


def test_abort_while_running_is_confirmed():
    core = make_core()
    # From its second step on the runner waits until the abort was sent: on a loaded
    # machine the fake runner could otherwise reach max_model_len first (LENGTH).
    sent = threading.Event()
    execute, calls = core.runner.execute, [0]

    def gated(batch):
        calls[0] += 1
        if calls[0] > 1 and not sent.wait(TIMEOUT):
            raise AssertionError("the abort was never sent")
        return execute(batch)

    core.runner.execute = gated
    with Loop(core) as loop:
        loop.add(make_request("long", [1], max_tokens=None, ignore_eos=True))
        # Wait for the first token, then abort.
        while not loop.collected.tokens.get("long"):
            loop.collected.add(loop.out.get(timeout=TIMEOUT))
        loop.abort("long")
        sent.set()
        c = loop.until_finished("long")
    assert c.finish["long"] == FinishReason.ABORT
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks


def test_abort_during_final_step_wins_in_the_loop():
    core = make_core()
    loop = Loop(core)
    # The abort arrives while the model computes the request's only token.
    core.runner.on_execute = lambda batch: loop.abort("r")
    with loop:
        loop.add(make_request("r", [1, 2], max_tokens=1))
        c = loop.until_finished("r")
    assert c.finish["r"] == FinishReason.ABORT and c.tokens.get("r", []) == []
    assert c.status["r"] == RequestStatus.FINISHED_ABORTED


def test_abort_while_idle_is_emitted_at_once():
    core = make_core()
    with Loop(core) as loop:
        loop.abort("unknown")
        loop.add(make_request("w", list(range(10)), max_tokens=1))
        c = loop.until_finished("w")
        assert "unknown" not in c.finished_count
        # A request that can never fit is reported without any step running.
        loop.add(make_request("big", [1] * 1000))
        c = loop.until_finished("big")
    assert c.status["big"] == RequestStatus.FINISHED_IGNORED
    assert [b.step for b in c.batches if "big" in b.finished] == [None]


def test_invalid_add_reports_error_and_loop_survives():
    core = make_core()
    with Loop(core) as loop:
        loop.add(make_request(12, [1]))  # type: ignore[arg-type]
        loop.add(make_request("bad", [1000]))
        loop.add(make_request("ok", [1], max_tokens=2))
        c = loop.until_finished("12", "bad", "ok")
    assert c.status["12"] == RequestStatus.FINISHED_ERROR
    assert c.finish["bad"] == FinishReason.ERROR
    assert c.tokens["ok"] == [2, 3]


def test_utility_runs_on_core_thread_and_returns_result():
    core = make_core()
    with Loop(core) as loop:
        fut: Future = Future()
        loop.q.put(
            EngineCoreMessage(
                MessageType.UTILITY,
                lambda c: (threading.current_thread().name, c.num_unfinished_requests()),
                fut,
            )
        )
        assert fut.result(TIMEOUT) == ("nbengine-core", 0)
        bad: Future = Future()
        loop.q.put(EngineCoreMessage(MessageType.UTILITY, lambda c: 1 / 0, bad))
        with pytest.raises(ZeroDivisionError):
            bad.result(TIMEOUT)
        loop.add(make_request("after", [1], max_tokens=2))
        c = loop.until_finished("after")
    assert c.tokens["after"] == expected_tokens([1], 2)


def test_runner_exception_reports_engine_error_and_ends_loop():
    core = make_core()

    def boom(batch):
        if any(ch.request.num_output_tokens >= 2 for ch in batch.chunks):
            raise RuntimeError("device on fire")

    core.runner.on_execute = boom
    loop = Loop(core)
    loop.thread.start()
    loop.add(make_request("a", [1], max_tokens=50))
    loop.add(make_request("b", list(range(20)), max_tokens=50))
    batches = []
    while True:
        batch = loop.out.get(timeout=TIMEOUT)
        batches.append(batch)
        if batch.engine_error is not None:
            break
    loop.thread.join(TIMEOUT)
    assert not loop.thread.is_alive()
    final = batches[-1]
    assert "device on fire" in final.engine_error
    assert final.finished == {"a", "b"}
    assert all(o.finish_reason == FinishReason.ERROR for o in final.outputs)
    assert {o.request_id for o in final.outputs} == {"a", "b"}
    assert not core.has_unfinished_requests()


def test_shutdown_while_idle_returns_and_shutdown_releases_runner():
    core = make_core()
    with Loop(core):
        pass
    core.shutdown()
    core.shutdown()
    assert core.runner.shut_down
