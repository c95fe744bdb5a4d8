"""``RequestRegistry``: the loop thread's side of the frontend.

Everything here runs on the ``nbengine-loop`` thread only (docs/architecture.md,
"Threads"); ``Engine`` reaches it through the loop bridge. It registers requests (a new
incarnation, its ``n`` children from the fan-out, their ADD messages to the core, in the
order the registry changes: docs/lifecycle.md, "The invariant"), starts aborts, applies
the core's output batches through the ``OutputProcessor``, and fails requests when the
core or a replica is lost. ``dead`` says why the engine can no longer serve.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

from nbengine.core.client import CoreClient
from nbengine.core.messages import (
    EngineCoreMessage,
    EngineCoreOutputs,
    EngineCoreRequest,
    MessageType,
)
from nbengine.frontend.detokenizer import TokenizerLike
from nbengine.frontend.handles import HandleOwner, RequestHandle
from nbengine.frontend.observer import ObserverList
from nbengine.frontend.output_processor import LiveRequest, OutputProcessor
from nbengine.frontend.parallel_sampling import fan_out
from nbengine.outputs import RequestMetrics, RequestOutput
from nbengine.request import EngineDeadError, FinishReason, RequestIdInUseError

if TYPE_CHECKING:
    from nbengine.frontend.input_processor import PreparedRequest

__all__ = ["RequestRegistry"]

logger = logging.getLogger(__name__)


class RequestRegistry:
    """Live requests of one engine and every change to them (loop thread only)."""

    def __init__(
        self,
        tokenizer: TokenizerLike,
        client: CoreClient,
        observers: ObserverList,
        eos_token_ids: frozenset[int],
        stream_interval: int,
    ) -> None:
        self._tokenizer = tokenizer
        self._client = client
        self._observers = observers
        self._eos_token_ids = eos_token_ids
        self._stream_interval = stream_interval
        self.processor = OutputProcessor(tokenizer, send_abort=self.send_abort, observers=observers)
        self.dead: str | None = None  # why the engine can no longer serve
        self._incarnations = itertools.count(1)
        self._auto_ids = itertools.count()

    # ---------------------------------------------------------------- requests

    def register(self, prep: PreparedRequest, owner: HandleOwner) -> RequestHandle:
        """A new incarnation of ``prep``: its handle, children and ADD messages."""
        if prep.withdrawn:
            raise RuntimeError("the caller was interrupted before the request was registered")
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        requests = self.processor.requests
        request_id = prep.request_id
        if request_id is None:
            request_id = str(next(self._auto_ids))
            while request_id in requests:
                request_id = str(next(self._auto_ids))
        else:
            live = requests.get(request_id)
            if live is not None:
                raise RequestIdInUseError(request_id, live.status)
        incarnation = next(self._incarnations)
        params = prep.params
        handle = RequestHandle(
            owner, request_id, params, prep.prompt, prep.prompt_token_ids, prep.arrival
        )
        children = fan_out(request_id, incarnation, params, self._tokenizer, prep.prompt_token_ids)
        live = LiveRequest(
            request_id=request_id,
            incarnation=incarnation,
            handle=handle,
            params=params,
            prompt=prep.prompt,
            prompt_token_ids=prep.prompt_token_ids,
            children=children,
            metrics=RequestMetrics(arrival_time=prep.arrival),
            stream_interval=max(self._stream_interval, params.stream_interval),
        )
        self.processor.add(live)
        prep.handle = handle
        lora = prep.lora.request
        if lora is not None:  # the dashboard and request_stats() name the adapter
            handle.lora_request = lora
            for child in children:
                self._observers.on_adapter(child.key, request_id, lora.lora_name)
        if params.structured_outputs is not None:  # the dashboard marks constrained requests
            constraint = params.structured_outputs.describe()
            for child in children:
                self._observers.on_constraint(child.key, request_id, constraint)
        for i, child in enumerate(children):
            self._client.send(
                EngineCoreMessage(
                    MessageType.ADD,
                    EngineCoreRequest(
                        request_id=child.key,
                        prompt_token_ids=list(prep.prompt_token_ids),
                        sampling_params=child.params,
                        arrival_time=prep.arrival,
                        priority=prep.priority,
                        eos_token_ids=self._eos_token_ids,
                        grammar=prep.grammars[i] if prep.grammars else None,
                        cache_salt=prep.cache_salt,
                        lora_int_id=prep.lora.int_id,
                        lora_key=prep.lora.key,
                    ),
                )
            )
        return handle

    def withdraw(self, prep: PreparedRequest) -> Future[RequestOutput] | None:
        """Undo ``prep``'s registration (its caller was interrupted); idempotent."""
        prep.withdrawn = True
        handle = prep.handle
        if handle is None:
            return None
        return self.start_abort_handle(handle)

    # ------------------------------------------------------------------ aborts

    def send_abort(self, keys: list[str]) -> None:
        self._client.send(EngineCoreMessage(MessageType.ABORT, list(keys)))

    def start_aborts(self, request_ids: list[str]) -> list[Future[RequestOutput] | None]:
        """Start aborting each live id; its final output's future (None: not live)."""
        futures: list[Future[RequestOutput] | None] = []
        for rid in request_ids:
            live = self.processor.requests.get(rid)
            futures.append(None if live is None else self.processor.request_abort(live))
        return futures

    def start_abort_handle(self, handle: RequestHandle) -> Future[RequestOutput] | None:
        """Start aborting ``handle``'s incarnation (None if it is already final)."""
        live = handle._live
        if live is None or live.finalized:
            return None
        return self.processor.request_abort(live)

    def abort_where(self, request_id: str, key: str | None) -> None:
        """Abort ``request_id``'s live incarnation (only the one holding ``key``, if given)."""
        live = self.processor.requests.get(request_id)
        if live is None or live.finalized:
            return
        if key is not None and all(c.key != key for c in live.children):
            return
        self.processor.request_abort(live)

    def abort_all(self) -> None:
        """Abort every live request."""
        for live in list(self.processor.requests.values()):
            if not live.finalized:
                self.processor.request_abort(live)

    # ------------------------------------------------------------- core output

    def process(self, outputs: EngineCoreOutputs) -> None:
        """Apply one core batch; a failure of the processing kills the engine."""
        try:
            if outputs.engine_error is not None:
                self.dead = f"The engine core failed: {outputs.engine_error}"
            self.processor.process(outputs)
        except Exception as exc:
            logger.exception("output processing failed")
            self.die(f"Output processing failed: {type(exc).__name__}: {exc}")

    def die(self, message: str) -> None:
        """Fail every live request with ``message`` and stop the core."""
        if self.dead is None:
            self.dead = message
        try:
            self.processor.fail_all(self.dead)
        finally:  # the core must stop even if failing the requests went wrong
            self._client.send(EngineCoreMessage(MessageType.SHUTDOWN))

    def fail_keys(self, keys: set[str], message: str) -> None:
        """One replica is lost; fail only the requests it held."""
        try:
            self.processor.fail_requests(keys, message)
        except Exception as exc:
            logger.exception("failing the requests of a lost replica failed")
            self.die(f"Output processing failed: {type(exc).__name__}: {exc}")

    def shut_down(self, reason: str) -> None:
        """Shutdown: every live request ends FINISHED_ABORTED with ``reason``."""
        if self.dead is None:
            self.dead = reason
        self.processor.fail_all(reason, FinishReason.ABORT)
