"""``RayCoreClient``: ``data_parallel_size`` engine cores as Ray actors, one frontend here.

Per replica ``i`` (a ``ReplicaWorker`` actor with its own model):

- frontend -> replica: ``submit(seq, [message])`` calls made on the engine loop thread
  (the only sender), numbered per replica; the actor applies them in ``seq`` order, so
  ADD and ABORT of one key stay FIFO across the process boundary;
- replica -> frontend: one thread here (``nbengine-ray-pull-i``) long-polls
  ``get_outputs(timeout)``, which returns every batch accumulated since its previous
  call (many steps per round trip when steps are fast, no per-token calls), and hands
  each batch to the engine's ``emit`` in the order the core produced it.

Every key is routed by the ``Router`` when its ADD is sent; a batch from replica ``i``
only carries keys routed to ``i``. A replica that dies (its actor killed, its core
failed) fails only the requests it held, with ``EngineDeadError`` naming it; the
engine stays alive while any replica lives (``on_exit`` once none does).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nbengine.core.client import CoreClient, EmitFn, ExitFn, FailKeysFn, RoutedFn
from nbengine.core.messages import EngineCoreMessage, EngineCoreRequest, MessageType
from nbengine.distributed.ray_actor import ReplicaWorker, WireMessage
from nbengine.distributed.router import Router
from nbengine.request import EngineDeadError
from nbengine.validation import is_int

if TYPE_CHECKING:
    from nbengine.config import EngineConfig
    from nbengine.core.engine_core import EngineCore

__all__ = ["RayCoreClient"]

logger = logging.getLogger(__name__)

_POLL_S = 0.5  # how long one get_outputs call waits for a batch
_START_TIMEOUT_S = 300.0
_ACTOR_CONCURRENCY = 4  # get_outputs long-polls while submit/shutdown calls run


@dataclass(slots=True, eq=False)
class _Replica:
    """One replica actor and its frontend-side state (a restart makes a new one)."""

    index: int
    actor: Any
    seq: itertools.count = field(default_factory=itertools.count)
    alive: bool = True
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    thread: threading.Thread | None = None
    utilities: dict[int, Future[Any]] = field(default_factory=dict)
    batches: int = 0
    pulls: int = 0
    steps: int = 0
    started: float = field(default_factory=time.monotonic)


class RayCoreClient(CoreClient):
    """Engine cores as Ray actors (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        data_parallel_size: int = 1,
        ray_address: str | None = None,
        resources_per_replica: dict[str, Any] | None = None,
        routing: str = "prefix",
    ) -> None:
        if not is_int(data_parallel_size):
            raise TypeError(f"data_parallel_size must be an int, got {data_parallel_size!r}.")
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}.")
        if routing not in ("prefix", "least_loaded"):
            raise ValueError(f"routing must be 'prefix' or 'least_loaded', got {routing!r}.")
        resources = dict(resources_per_replica or {})
        unknown = set(resources) - {"num_cpus", "num_gpus", "memory", "resources"}
        if unknown:
            raise ValueError(
                f"resources_per_replica takes num_cpus, num_gpus, memory, resources; "
                f"got {sorted(unknown)}."
            )
        try:
            import ray
        except ImportError as exc:
            raise ImportError(
                "backend='ray' needs Ray: pip install 'nbengine[ray]' (ray>=2.40)."
            ) from exc
        self._ray = ray
        self._owns_ray = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
            if ray_address is None:
                kwargs["include_dashboard"] = False
            ray.init(address=ray_address, **kwargs)
            self._owns_ray = ray_address is None  # attached to a cluster: never shut it down
        self._config = config
        self._options = {
            "num_cpus": resources.get("num_cpus", 1),
            "num_gpus": resources.get("num_gpus", 0),
            "max_concurrency": _ACTOR_CONCURRENCY,
            "max_restarts": 0,
        }
        if "memory" in resources:
            self._options["memory"] = resources["memory"]
        if "resources" in resources:
            self._options["resources"] = resources["resources"]
        self._actor_cls = ray.remote(ReplicaWorker)
        self._lock = threading.Lock()  # guards replica lifecycle (lost / restart)
        self._uids = itertools.count()
        self._emit: EmitFn | None = None
        self._on_exit: ExitFn | None = None
        self._fail_keys: FailKeysFn | None = None
        self._on_routed: RoutedFn | None = None
        self._stopping = False
        self._exited = False
        self._closed = False
        self._replicas: list[_Replica] = []
        try:
            pending = [self._spawn(i) for i in range(data_parallel_size)]
            infos = ray.get([r.actor.info.remote() for r in pending], timeout=_START_TIMEOUT_S)
        except BaseException:
            for r in locals().get("pending", []):
                self._kill(r)
            if self._owns_ray:
                ray.shutdown()
            raise
        for r, info in zip(pending, infos):
            r.info = info
        self._replicas = pending
        first = infos[0]
        self.vocab_size = int(first["vocab_size"])
        self.max_model_len = int(first["max_model_len"])
        self.kv_pool = (
            min(int(info["num_kv_blocks"]) for info in infos),
            int(config.cache.block_size),
        )
        self.eos_token_ids = frozenset(first["eos_token_ids"])
        self.router = Router(
            data_parallel_size, config.cache.block_size, prefix_aware=routing == "prefix"
        )

    # ------------------------------------------------------------------ actors

    def _spawn(self, index: int) -> _Replica:
        actor = self._actor_cls.options(name=None, **self._options).remote(self._config, index)
        return _Replica(index=index, actor=actor)

    def _kill(self, rep: _Replica) -> None:
        try:
            self._ray.kill(rep.actor, no_restart=True)
        except Exception:
            logger.debug("killing replica %d failed", rep.index, exc_info=True)

    # ------------------------------------------------------------------ CoreClient

    def start(
        self,
        emit: EmitFn,
        on_exit: ExitFn,
        fail_keys: FailKeysFn,
        on_routed: RoutedFn | None = None,
    ) -> None:
        self._emit, self._on_exit, self._fail_keys = emit, on_exit, fail_keys
        self._on_routed = on_routed
        for rep in self._replicas:
            self._start_pull(rep)

    def _start_pull(self, rep: _Replica) -> None:
        rep.thread = threading.Thread(
            target=self._pull_loop,
            args=(rep,),
            name=f"nbengine-ray-pull-{rep.index}",
            daemon=True,
        )
        rep.thread.start()

    def send(self, msg: EngineCoreMessage) -> None:
        """Loop thread: route and submit one message (never waits for the replica)."""
        mtype = msg.type
        if mtype is MessageType.ADD:
            req: EngineCoreRequest = msg.payload
            try:
                i = self.router.route(req.request_id, req.prompt_token_ids)
            except RuntimeError:
                return  # no live replica: the engine is failing every request
            try:
                self._submit(self._replicas[i], [("add", req, None)])
            except Exception:
                logger.exception("sending %s to replica %d failed", req.request_id, i)
            if self._on_routed is not None:
                try:
                    self._on_routed(req.request_id, i)
                except Exception:
                    logger.exception("routing hook failed")
        elif mtype is MessageType.ABORT:
            keys = [msg.payload] if isinstance(msg.payload, str) else list(msg.payload or ())
            for i, ks in self.router.split(keys).items():
                try:
                    self._submit(self._replicas[i], [("abort", ks, None)])
                except Exception:
                    logger.exception("sending an abort to replica %d failed", i)
        elif mtype is MessageType.UTILITY:
            fut = msg.future if msg.future is not None else Future()
            self._utility(self._first_alive(), msg.payload, fut)
        elif mtype is MessageType.SHUTDOWN:
            self._stopping = True
            for rep in self._replicas:
                if rep.alive:
                    try:
                        self._submit(rep, [("shutdown", None, None)])
                    except Exception:
                        logger.debug("replica %d shutdown message failed", rep.index)
        else:
            raise ValueError(f"unknown engine core message {msg!r}")

    def _submit(self, rep: _Replica, messages: list[WireMessage]) -> None:
        """Submit with the replica's next sequence number; raise if it cannot be sent.

        A failed call (e.g. an unpicklable utility) still uses up its number with an
        empty submit, so the actor never waits for a gap that will not be filled.
        """
        if not rep.alive:
            return  # its requests are being failed
        seq = next(rep.seq)
        try:
            rep.actor.submit.remote(seq, messages)
        except Exception:
            try:
                rep.actor.submit.remote(seq, [])
            except Exception:
                logger.exception("replica %d: could not fill sequence gap %d", rep.index, seq)
            raise

    def _first_alive(self) -> _Replica | None:
        return next((r for r in self._replicas if r.alive), None)

    def _utility(self, rep: _Replica | None, fn: Callable[..., Any], fut: Future[Any]) -> None:
        if rep is None or not rep.alive:
            fut.set_exception(EngineDeadError("No live replica to run the call on."))
            return
        uid = next(self._uids)
        rep.utilities[uid] = fut
        try:
            self._submit(rep, [("utility", fn, uid)])
        except Exception as exc:  # e.g. fn does not pickle
            rep.utilities.pop(uid, None)
            fut.set_exception(exc)

    def run_utility(
        self, fn: Callable[[EngineCore], Any], replica: int | None = None
    ) -> Future[Any]:
        """Run ``fn(core)`` in a replica's actor between steps (``fn`` must pickle).

        ``replica`` None: the first live replica. Call it from any thread but the loop's
        only through the engine (the loop thread is the only sender).
        """
        fut: Future[Any] = Future()
        rep = self._first_alive() if replica is None else self._replicas[replica]
        self._utility(rep, fn, fut)
        return fut

    def is_alive(self) -> bool:
        return not self._exited and any(r.alive for r in self._replicas)

    def owns_thread(self, thread: threading.Thread) -> bool:
        return any(thread is r.thread for r in self._replicas)

    # ------------------------------------------------------------------ output threads

    def _pull_loop(self, rep: _Replica) -> None:
        ray = self._ray
        exceptions = ray.exceptions
        while rep.alive and not self._stopping:
            try:
                batches, results, exit_error = ray.get(
                    rep.actor.get_outputs.remote(_POLL_S), timeout=_POLL_S + 60.0
                )
            except exceptions.GetTimeoutError:
                continue  # a busy node; ask again
            except Exception as exc:  # RayActorError, ActorDiedError, ...
                if not self._stopping:
                    self._lost(rep, f"its actor died ({type(exc).__name__})")
                return
            rep.pulls += 1
            # Utility results first: a call that completed is not failed by a core
            # failure reported in the same reply.
            for uid, ok, value in results:
                fut = rep.utilities.pop(uid, None)
                if fut is None:
                    continue
                try:
                    fut.set_result(value) if ok else fut.set_exception(value)
                except InvalidStateError:
                    pass
            for batch in batches:
                if batch.engine_error is not None:
                    # That core is dead; the engine (other replicas) lives on.
                    self._lost(rep, f"its engine core failed: {batch.engine_error}")
                    return
                rep.batches += 1
                if batch.step is not None:
                    batch.step.replica = rep.index  # the actor's core numbers itself 0
                    rep.steps += 1
                    self.router.on_step(rep.index, batch.step)
                if batch.finished:
                    self.router.on_finished(rep.index, batch.finished)
                if self._emit is not None:
                    self._emit(batch)
            if exit_error is not None:
                if not self._stopping:
                    self._lost(rep, f"its core loop exited {exit_error or 'unexpectedly'}")
                return

    def _lost(self, rep: _Replica, why: str) -> None:
        """Replica ``rep`` can serve no more: fail its requests; maybe the engine's end."""
        with self._lock:
            if not rep.alive:
                return
            rep.alive = False
            message = f"Replica {rep.index} is lost: {why}."
            rep.error = message
            keys = self.router.mark_dead(rep.index) if rep in self._replicas else set()
            last = not any(r.alive for r in self._replicas)
            if last:
                self._exited = True
        logger.error("%s", message)
        for fut in list(rep.utilities.values()):
            try:
                fut.set_exception(EngineDeadError(message))
            except InvalidStateError:
                pass
        rep.utilities.clear()
        self._kill(rep)
        if self._fail_keys is not None and keys:
            self._fail_keys(keys, message)
        if last and self._on_exit is not None and not self._stopping:
            self._on_exit(f"every replica is lost; the last one: {message}")

    # ------------------------------------------------------------------ management

    def restart_replica(self, index: int) -> None:
        """Replace replica ``index`` by a fresh actor (a live one's requests fail first).

        Blocks until the new replica has loaded its model.
        """
        if not 0 <= index < len(self._replicas):
            raise IndexError(
                f"replica index {index} is out of range (0..{len(self._replicas) - 1})."
            )
        if self._exited or self._stopping:
            raise EngineDeadError("Every replica is lost or the engine is shutting down.")
        old = self._replicas[index]
        if old.alive:
            self._lost(old, "it was restarted")
        new = self._spawn(index)
        try:
            new.info = self._ray.get(new.actor.info.remote(), timeout=_START_TIMEOUT_S)
        except BaseException:
            self._kill(new)
            raise
        with self._lock:
            self._replicas[index] = new
            self.router.mark_alive(index)
        self._start_pull(new)

    def describe(self) -> list[dict[str, Any]]:
        loads = self.router.loads()
        out = []
        for rep, load in zip(self._replicas, loads):
            out.append(
                {
                    "replica": rep.index,
                    "backend": "ray",
                    "alive": rep.alive,
                    "host": rep.info.get("host"),
                    "pid": rep.info.get("pid"),
                    "unfinished": load["unfinished"] if rep.alive else 0,
                    "kv_usage": load["kv_usage"],
                    "routed_total": load["routed_total"],
                    "prefix_hits": load["prefix_hits"],
                    "steps": rep.steps,
                    "batches": rep.batches,
                    "pulls": rep.pulls,
                    "error": rep.error,
                }
            )
        return out

    def _wait_dead(self, reps: list[_Replica], timeout: float) -> None:
        """Return once every actor in ``reps`` is gone (``ray.kill`` is asynchronous)."""
        ray = self._ray
        deadline = time.monotonic() + timeout
        for rep in reps:
            while time.monotonic() < deadline:
                try:
                    ray.get(
                        rep.actor.num_unfinished.remote(),
                        timeout=max(0.1, deadline - time.monotonic()),
                    )
                except ray.exceptions.RayActorError:
                    break
                except Exception:
                    logger.debug("waiting for replica %d to exit", rep.index, exc_info=True)
                    break
                time.sleep(0.05)
            else:
                logger.warning("replica %d actor still answers after ray.kill", rep.index)

    def shutdown(self, timeout: float) -> str | None:
        """Stop every replica's loop, free its model, kill its actor; leave no actors."""
        with self._lock:
            if self._closed:
                return None
            self._closed = True
        self._stopping = True
        ray = self._ray
        live = [r for r in self._replicas if r.alive]
        refs = []
        for rep in live:
            try:
                refs.append(rep.actor.shutdown.remote(timeout))
            except Exception:
                pass
        if refs:
            try:
                ray.wait(refs, num_returns=len(refs), timeout=timeout)
            except Exception:
                logger.debug("replica shutdown wait failed", exc_info=True)
        for rep in self._replicas:
            rep.alive = False
            self._kill(rep)
        self._wait_dead(live, timeout)
        for rep in self._replicas:
            if rep.thread is not None and rep.thread is not threading.current_thread():
                rep.thread.join(timeout)
        if self._owns_ray and ray.is_initialized():
            try:
                ray.shutdown()
            except Exception:
                logger.exception("ray.shutdown failed")
        return None
