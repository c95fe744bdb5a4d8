"""``CoreClient``: how the frontend talks to its engine core(s) (the backend contract).

It lives on the core side: backends (the in-process thread here, Ray actors in
``nbengine.distributed``) implement it without depending on the frontend.

The ``Engine`` (frontend) owns the request registry and sends ADD / ABORT / UTILITY
messages, keyed by internal request key, through ``send``; the client delivers every
``EngineCoreOutputs`` batch back through the ``emit`` callback given to ``start``.

Contract every client keeps (docs/lifecycle.md and docs/scale-out.md; across any process boundary):

- ``send`` is called on the engine's loop thread only, never blocks on the model, and
  messages for one core are applied by that core in the order they were sent;
- every key a core removes is reported in exactly one emitted batch's ``finished``
  set, and no output for that key follows;
- ``on_exit(error)`` is called once when the client can no longer serve at all (for
  the in-process client: the core thread ended); ``fail_keys(keys, message)`` fails
  just those keys' requests while the engine lives on (a lost replica).

Two implementations: ``InprocCoreClient`` here (one ``nbengine-core`` thread and its
FIFO queue, the default), and ``nbengine.distributed.RayCoreClient`` (engine cores as
Ray actors). The frontend picks one from ``config.parallel`` (frontend/engine_setup.py),
so the core side never imports a backend.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from nbengine.core.messages import EngineCoreMessage, EngineCoreOutputs, MessageType
from nbengine.ops.openmp import release_thread_pool

if TYPE_CHECKING:
    from nbengine.config import EngineConfig
    from nbengine.core.engine_core import EngineCore, RunnerClass, RunnerLike

__all__ = ["CoreClient", "InprocCoreClient"]

logger = logging.getLogger(__name__)

EmitFn = Callable[[EngineCoreOutputs], None]
ExitFn = Callable[[str | None], None]
FailKeysFn = Callable[[set[str], str], None]
RoutedFn = Callable[[str, int], None]


class CoreClient(ABC):
    """The frontend's view of its engine core(s). See the module docstring."""

    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    # (blocks, tokens per block) of the smallest KV pool among the cores: a prompt longer
    # than their product can never be scheduled (generate() refuses it). None: unknown.
    kv_pool: tuple[int, int] | None = None

    @abstractmethod
    def start(
        self,
        emit: EmitFn,
        on_exit: ExitFn,
        fail_keys: FailKeysFn,
        on_routed: RoutedFn | None = None,
    ) -> None:
        """Start serving; batches go to ``emit`` (called from client threads).

        ``on_routed(key, replica)`` is called on the loop thread when a multi-replica
        client places a request key (for the metrics' ``replica`` column).
        """

    @abstractmethod
    def send(self, msg: EngineCoreMessage) -> None:
        """Queue ADD / ABORT / UTILITY (or SHUTDOWN: stop serving) without blocking."""

    @abstractmethod
    def is_alive(self) -> bool:
        """True while at least one core can serve requests."""

    @abstractmethod
    def owns_thread(self, thread: threading.Thread) -> bool:
        """True for the client's own threads (they must never block on the engine)."""

    @abstractmethod
    def shutdown(self, timeout: float) -> str | None:
        """Stop every core and free its model. Idempotent.

        Returns None when everything stopped within ``timeout``, else a sentence saying
        what is still running (and when it will be freed).
        """

    @abstractmethod
    def describe(self) -> list[dict[str, Any]]:
        """Health of each core (replica): one dict per replica."""

    def run_utility(
        self, fn: Callable[[EngineCore], Any], replica: int | None = None
    ) -> Future[Any]:
        """Run ``fn(core)`` on a core between steps; its result on the returned future."""
        fut: Future[Any] = Future()
        self.send(EngineCoreMessage(MessageType.UTILITY, fn, fut))
        return fut

    def restart_replica(self, index: int) -> None:
        """Replace replica ``index`` by a fresh one (multi-replica backends only)."""
        raise NotImplementedError(
            f"{type(self).__name__} has a single in-process core; restart_replica needs "
            "backend='ray'."
        )


class InprocCoreClient(CoreClient):
    """One ``EngineCore`` on the ``nbengine-core`` thread of this process, fed by a FIFO queue."""

    def __init__(self, config: EngineConfig, runner: RunnerLike | RunnerClass) -> None:
        from nbengine.core.engine_core import EngineCore

        self.core: EngineCore = EngineCore(config, runner)
        # The model was loaded on this (the caller's) thread and computes on the core
        # thread: ending this thread's OpenMP pool leaves the core thread's the only one,
        # so its idle workers spin between a step's parallel regions (ops/openmp.py).
        release_thread_pool()
        r = self.core.runner
        self.vocab_size = int(r.vocab_size)
        self.max_model_len = int(getattr(self.core, "max_model_len", r.max_model_len))
        self.eos_token_ids = frozenset(r.eos_token_ids)
        self.kv_pool = (int(r.num_kv_blocks), int(r.block_size))
        self.queue: queue.Queue[EngineCoreMessage] = queue.Queue()
        self.thread: threading.Thread | None = None
        self._started_at = time.monotonic()
        # A core thread stuck in a step when shutdown() gave up frees the model itself
        # when the step ends (the lock orders that hand-over against its exit).
        self._exit_lock = threading.Lock()
        self._exited = False
        self._free_on_exit = False

    def start(
        self,
        emit: EmitFn,
        on_exit: ExitFn,
        fail_keys: FailKeysFn,
        on_routed: RoutedFn | None = None,
    ) -> None:
        self.thread = threading.Thread(
            target=_core_thread_main,
            args=(self.core, self.queue, emit, on_exit, self._on_thread_exit),
            name="nbengine-core",
            daemon=True,
        )
        self.thread.start()

    def _on_thread_exit(self) -> None:
        """Last act of the core thread: free the model if shutdown() handed that over."""
        with self._exit_lock:
            self._exited = True
            free = self._free_on_exit
        if free:
            self._free_core()

    def _free_core(self) -> None:
        try:
            self.core.shutdown()
        except Exception:
            logger.exception("engine core shutdown failed")

    def send(self, msg: EngineCoreMessage) -> None:
        self.queue.put(msg)

    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def owns_thread(self, thread: threading.Thread) -> bool:
        return thread is self.thread

    def shutdown(self, timeout: float) -> str | None:
        self.queue.put(EngineCoreMessage(MessageType.SHUTDOWN))
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)
            with self._exit_lock:
                stuck = not self._exited and self.thread.is_alive()
                self._free_on_exit = stuck
            if stuck:
                message = (
                    f"the engine core thread is still inside a model step after {timeout:g} s; "
                    "it stops, and frees the model and KV cache, when that step returns"
                )
                logger.warning(message)
                return message
        self._free_core()
        return None

    def describe(self) -> list[dict[str, Any]]:
        core = self.core
        return [
            {
                "replica": 0,
                "backend": "inproc",
                "alive": self.is_alive(),
                "unfinished": core.num_unfinished_requests() if self.is_alive() else 0,
                "steps": core.step_count,
                "error": None,
            }
        ]


def _core_thread_main(
    core: EngineCore,
    input_queue: queue.Queue[EngineCoreMessage],
    emit: EmitFn,
    on_exit: ExitFn,
    on_thread_exit: Callable[[], None],
) -> None:
    """Body of the ``nbengine-core`` thread (``emit``/``on_exit`` hold the engine weakly)."""
    error: str | None = None
    try:
        core.run_busy_loop(input_queue, emit)
    except BaseException as exc:  # run_busy_loop reports step failures itself
        logger.exception("engine core loop crashed")
        error = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            on_exit(error)
        finally:
            on_thread_exit()
