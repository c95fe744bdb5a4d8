"""``ReplicaWorker``: one engine core inside a Ray actor.

The actor builds an ``EngineCore`` (which loads the model from its directory) and runs
``run_busy_loop`` on a ``nbengine-core`` thread inside the actor process, exactly as
the in-process backend does. The frontend talks to it with two kinds of calls:

- ``submit(seq, messages)``: ADD / ABORT / UTILITY / SHUTDOWN, in wire form. The actor
  is threaded (``max_concurrency`` > 1, so a long-polling ``get_outputs`` cannot block
  a ``submit``), and Ray does not promise submission order across threads, so every
  call carries a sequence number: calls are put on the core's FIFO queue strictly in
  ``seq`` order (an early arrival waits in a reorder buffer). ADD then ABORT of one key
  therefore reach the core in the order the frontend sent them.
- ``get_outputs(timeout)``: every ``EngineCoreOutputs`` batch (and utility result)
  accumulated since the previous call, waiting up to ``timeout`` for the first one.
  One call carries many steps when the frontend lags, and none when nothing ran.

This module does not import Ray: the client wraps the class with ``ray.remote``.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any

from nbengine.config import EngineConfig
from nbengine.core.messages import EngineCoreMessage, EngineCoreOutputs, MessageType

__all__ = ["ReplicaWorker", "WireMessage", "PullResult"]

logger = logging.getLogger(__name__)

# (type name, payload, utility id or None)
WireMessage = tuple[str, Any, int | None]
# (batches, utility results [(id, ok, value)], core loop exited: error or "" / None while running)
PullResult = tuple[list[EngineCoreOutputs], list[tuple[int, bool, Any]], str | None]


class ReplicaWorker:
    """The body of one replica actor (see the module docstring)."""

    def __init__(self, config: EngineConfig, replica: int) -> None:
        from nbengine.core.engine_core import EngineCore
        from nbengine.model.runner import ModelRunner

        self.replica = replica
        self._core = EngineCore(config, ModelRunner)
        self._queue: queue.Queue[EngineCoreMessage] = queue.Queue()
        self._cond = threading.Condition()
        self._batches: list[EngineCoreOutputs] = []
        self._results: list[tuple[int, bool, Any]] = []
        self._exit: str | None = None  # set when the core loop returned ("" = cleanly)
        self._seq_lock = threading.Lock()
        self._next_seq = 0
        self._early: dict[int, list[WireMessage]] = {}
        self._thread = threading.Thread(target=self._run, name="nbengine-core", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- core thread

    def _emit(self, outputs: EngineCoreOutputs) -> None:
        with self._cond:
            self._batches.append(outputs)
            self._cond.notify_all()

    def _run(self) -> None:
        error = ""
        try:
            self._core.run_busy_loop(self._queue, self._emit)
        except BaseException as exc:  # run_busy_loop reports step failures itself
            logger.exception("replica %d core loop crashed", self.replica)
            error = f"{type(exc).__name__}: {exc}"
        with self._cond:
            self._exit = error
            self._cond.notify_all()

    # ---------------------------------------------------------------- actor calls

    def info(self) -> dict[str, Any]:
        """Model facts the frontend validates with, and where this replica runs."""
        r = self._core.runner
        return {
            "vocab_size": int(r.vocab_size),
            "max_model_len": int(self._core.max_model_len),
            "eos_token_ids": frozenset(r.eos_token_ids),
            "num_kv_blocks": int(r.num_kv_blocks),
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }

    def submit(self, seq: int, messages: list[WireMessage]) -> None:
        """Queue ``messages`` for the core, strictly in ``seq`` order."""
        with self._seq_lock:
            self._early[seq] = messages
            while self._next_seq in self._early:
                for msg in self._early.pop(self._next_seq):
                    self._queue.put(self._decode(msg))
                self._next_seq += 1

    def _decode(self, msg: WireMessage) -> EngineCoreMessage:
        kind, payload, uid = msg
        mtype = MessageType(kind)
        if mtype is not MessageType.UTILITY:
            return EngineCoreMessage(mtype, payload)
        fut: Future[Any] = Future()

        def done(f: Future[Any], uid: int | None = uid) -> None:
            exc = f.exception()
            item = (uid, False, exc) if exc is not None else (uid, True, f.result())
            with self._cond:
                self._results.append(item)  # type: ignore[arg-type]
                self._cond.notify_all()

        fut.add_done_callback(done)
        return EngineCoreMessage(MessageType.UTILITY, payload, fut)

    def get_outputs(self, timeout: float) -> PullResult:
        """Every batch and utility result since the last call (waits up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._batches and not self._results and self._exit is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batches, self._batches = self._batches, []
            results, self._results = self._results, []
            return batches, results, self._exit

    def num_unfinished(self) -> int:
        return self._core.num_unfinished_requests()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop the core loop and free the model; True if the loop stopped."""
        self._queue.put(EngineCoreMessage(MessageType.SHUTDOWN))
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        self._core.shutdown()
        return True
