"""The engine's LoRA adapters, on the caller's side (docs/lora.md).

``LoRAManager`` loads an adapter the first time a request (or ``add_lora``) names it:
the files are read and checked on the caller's thread (``nbengine.lora.adapter``), then
mapped onto the model on the core thread between two steps (a UTILITY call), so a bad
adapter is an exception at the call that named it and leaves nothing loaded. Removal
also runs on the core thread, where it sees every request that holds the adapter: one
still held (waiting, running, preempted) makes it a ``LoRAInUseError``.

Each load gets a key unique to that load (``"<id>:<n>"``): the prefix cache keys blocks
by it, so a block computed under an adapter is never reused for another adapter, the
base model, or a later adapter loaded under the same id.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from nbengine.config import LoRAConfig
from nbengine.lora.adapter import read_adapter
from nbengine.lora.request import LoRARequest

if TYPE_CHECKING:
    from nbengine.core.engine_core import EngineCore

__all__ = ["LoRAInUseError", "LoRAManager", "ResolvedLoRA"]

T = TypeVar("T")


class LoRAInUseError(ValueError):
    """``remove_lora`` of an adapter that waiting or running requests still use."""


@dataclass(frozen=True, slots=True)
class ResolvedLoRA:
    """A request's adapter as the core sees it (id 0 / key None: the base model)."""

    int_id: int = 0
    key: str | None = None
    request: LoRARequest | None = None


BASE = ResolvedLoRA()


class LoRAManager:
    """The adapters loaded into one engine, by ``lora_int_id``. Thread-safe."""

    def __init__(
        self,
        config: LoRAConfig,
        run_on_core: Callable[[Callable[[EngineCore], Any]], Future[Any]],
        wait: Callable[[Future[Any], str], Any],
    ) -> None:
        self.config = config
        self._run_on_core = run_on_core
        self._wait = wait
        self._lock = threading.Lock()  # held across a load: one load at a time
        self._loaded: dict[int, ResolvedLoRA] = {}
        self._loads = itertools.count(1)

    def resolve(self, lora_request: object) -> ResolvedLoRA:
        """The adapter a request runs under, loading it on first use (None: the base)."""
        if lora_request is None:
            return BASE
        return self._ensure(self._check(lora_request))

    def add(self, lora_request: object) -> bool:
        """Load the adapter now; False if it was loaded already (vLLM's ``add_lora``)."""
        req = self._check(lora_request)
        with self._lock:
            if req.lora_int_id in self._loaded:
                self._same(req, self._loaded[req.lora_int_id])
                return False
        self._ensure(req)
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Unload adapter ``lora_int_id``; False if it is not loaded.

        Raises ``LoRAInUseError`` while requests under it are waiting or running.
        """
        self._enabled()
        with self._lock:
            if lora_int_id not in self._loaded:
                return False

            def remove_on_core(core: EngineCore) -> list[str]:
                users = core.lora_users(lora_int_id)
                if not users:
                    core.lora_layers().remove(lora_int_id)
                return users

            users = self._wait(self._run_on_core(remove_on_core), "LoRA adapter removal")
            if users:
                name = self._loaded[lora_int_id].request
                raise LoRAInUseError(
                    f"LoRA adapter {lora_int_id} ({name.lora_name if name else '?'}) is used by "
                    f"{len(users)} waiting or running request(s); abort them or wait for them "
                    "to finish, then remove it."
                )
            del self._loaded[lora_int_id]
            return True

    def list_ids(self) -> set[int]:
        """The ids of the loaded adapters (vLLM's ``list_loras``)."""
        with self._lock:
            return set(self._loaded)

    def requests(self) -> list[LoRARequest]:
        """The loaded adapters' requests, by id."""
        with self._lock:
            return [r.request for _, r in sorted(self._loaded.items()) if r.request is not None]

    def by_name(self, name: str) -> LoRARequest | None:
        """The loaded adapter called ``name``, if any."""
        return next((r for r in self.requests() if r.lora_name == name), None)

    # ------------------------------------------------------------------ internals
    def _enabled(self) -> None:
        if not self.config.enable_lora:
            raise ValueError(
                "lora_request: this engine has no LoRA support; create it with "
                "nb.Engine(model, enable_lora=True) (docs/lora.md)."
            )

    def _check(self, lora_request: object) -> LoRARequest:
        self._enabled()
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(
                f"lora_request must be an nb.LoRARequest, got {type(lora_request).__name__}."
            )
        return lora_request

    @staticmethod
    def _same(req: LoRARequest, loaded: ResolvedLoRA) -> None:
        """Refuse a different adapter under an id already loaded."""
        old = loaded.request
        assert old is not None
        same = old is req or (
            not req.in_memory
            and not old.in_memory
            and old.lora_name == req.lora_name
            and str(old.lora_path) == str(req.lora_path)
        )
        if not same:
            raise ValueError(
                f"lora_int_id {req.lora_int_id} is already adapter {old.lora_name!r} "
                f"({old.describe()}); remove_lora({req.lora_int_id}) first, or use another id."
            )

    def _ensure(self, req: LoRARequest) -> ResolvedLoRA:
        with self._lock:
            loaded = self._loaded.get(req.lora_int_id)
            if loaded is not None:
                self._same(req, loaded)
                return loaded
            for other in self._loaded.values():
                if other.request is not None and other.request.lora_name == req.lora_name:
                    raise ValueError(
                        f"lora_name {req.lora_name!r} is already adapter "
                        f"{other.int_id}; names must be unique."
                    )
            directory = None if req.in_memory else _adapter_directory(req.lora_path)
            weights = read_adapter(req, directory, self.config.max_lora_rank)

            def add_on_core(core: EngineCore) -> None:
                core.lora_layers().add(weights)

            self._wait(self._run_on_core(add_on_core), "LoRA adapter load")
            resolved = ResolvedLoRA(req.lora_int_id, f"{req.lora_int_id}:{next(self._loads)}", req)
            self._loaded[req.lora_int_id] = resolved
            return resolved


def _adapter_directory(path: str | Path | None) -> Path:
    """A local adapter directory, or the Hub snapshot of a Hub id (model/hub.py)."""
    from nbengine.model.hub import is_hub_repo_id, resolve_hub_adapter

    assert path is not None
    local = Path(path).expanduser()
    if local.exists() or not is_hub_repo_id(str(path)):
        return local
    return resolve_hub_adapter(str(path))
