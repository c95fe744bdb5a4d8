"""``Router``: which replica serves each request.

A new request goes to the live replica with the fewest unfinished requests (ties:
the lower KV-cache usage from its latest ``StepStats``, then the lower index). With
prefix-aware routing, a request whose first block of prompt tokens was already seen
on a replica goes there while that replica is not overloaded (its load at most
``prefix_slack`` above the least-loaded live replica), so the replica's prefix cache
can serve it. The ``n`` children of one request (keys ``id#inc.0``, ``id#inc.1``, ...)
always go to the same replica.

Thread-safety: ``route`` runs on the engine loop thread, ``on_finished``/``on_step``
on the replicas' output threads; everything is under one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from nbengine.core.messages import StepStats

__all__ = ["Router", "parent_key"]

_MAX_PREFIXES = 10_000


def parent_key(key: str) -> str:
    """The request incarnation of an internal key: ``id#3.1`` -> ``id#3``; ``id#3`` -> itself."""
    hash_at = key.rfind("#")
    dot = key.find(".", hash_at + 1)
    return key if hash_at < 0 or dot < 0 else key[:dot]


@dataclass(slots=True)
class _ReplicaLoad:
    alive: bool = True
    keys: set[str] = field(default_factory=set)  # keys routed here, not yet finished
    kv_usage: float = 0.0
    routed_total: int = 0
    prefix_hits: int = 0


class Router:
    """Least-loaded (and optionally prefix-aware) routing over ``num_replicas`` replicas."""

    def __init__(
        self, num_replicas: int, block_size: int, prefix_aware: bool = True, prefix_slack: int = 4
    ) -> None:
        self._lock = threading.Lock()
        self._replicas = [_ReplicaLoad() for _ in range(num_replicas)]
        self._where: dict[str, int] = {}  # live key -> replica
        self._groups: dict[str, int] = {}  # parent key -> replica, while any child lives
        self._prefixes: OrderedDict[tuple[int, ...], int] = OrderedDict()  # LRU
        self.block_size = block_size
        self.prefix_aware = prefix_aware
        self.prefix_slack = prefix_slack

    # ------------------------------------------------------------------ routing

    def route(self, key: str, prompt_token_ids: Sequence[int]) -> int:
        """Pick the replica for ``key`` and record it. RuntimeError if none is alive."""
        with self._lock:
            group = parent_key(key)
            replica = self._groups.get(group)
            if replica is None or not self._replicas[replica].alive:
                replica = self._choose(prompt_token_ids)
            self._groups[group] = replica
            self._where[key] = replica
            load = self._replicas[replica]
            load.keys.add(key)
            load.routed_total += 1
            return replica

    def _choose(self, prompt: Sequence[int]) -> int:
        live = [i for i, r in enumerate(self._replicas) if r.alive]
        if not live:
            raise RuntimeError("No live replica to route to.")
        best = min(live, key=lambda i: (len(self._replicas[i].keys), self._replicas[i].kv_usage, i))
        if not self.prefix_aware or len(prompt) < self.block_size:
            return best
        prefix = tuple(prompt[: self.block_size])
        seen = self._prefixes.get(prefix)
        least = len(self._replicas[best].keys)
        if (
            seen is not None
            and self._replicas[seen].alive
            and len(self._replicas[seen].keys) <= least + self.prefix_slack
        ):
            self._prefixes.move_to_end(prefix)
            self._replicas[seen].prefix_hits += 1
            return seen
        self._prefixes[prefix] = best
        self._prefixes.move_to_end(prefix)
        if len(self._prefixes) > _MAX_PREFIXES:
            self._prefixes.popitem(last=False)
        return best

    def replica_of(self, key: str) -> int | None:
        """The replica holding live ``key`` (None once it finished or was never routed)."""
        with self._lock:
            return self._where.get(key)

    def split(self, keys: Iterable[str]) -> dict[int, list[str]]:
        """Group live keys by replica (unknown keys are dropped: nothing holds them)."""
        out: dict[int, list[str]] = {}
        with self._lock:
            for key in keys:
                r = self._where.get(key)
                if r is not None:
                    out.setdefault(r, []).append(key)
        return out

    # ------------------------------------------------------------------ feedback

    def on_finished(self, replica: int, keys: Iterable[str]) -> None:
        """Replica ``replica`` released ``keys``."""
        with self._lock:
            load = self._replicas[replica]
            for key in keys:
                if self._where.get(key) == replica:
                    del self._where[key]
                    load.keys.discard(key)
                    group = parent_key(key)
                    if group != key and any(k.startswith(group + ".") for k in load.keys):
                        continue
                    self._groups.pop(group, None)

    def on_step(self, replica: int, stats: StepStats) -> None:
        with self._lock:
            total = stats.kv_blocks_total
            self._replicas[replica].kv_usage = stats.kv_blocks_used / total if total else 0.0

    def mark_dead(self, replica: int) -> set[str]:
        """Stop routing to ``replica``; return (and forget) the keys it held."""
        with self._lock:
            load = self._replicas[replica]
            load.alive = False
            keys = set(load.keys)
            load.keys.clear()
            for key in keys:
                self._where.pop(key, None)
                self._groups.pop(parent_key(key), None)
            for prefix in [p for p, r in self._prefixes.items() if r == replica]:
                del self._prefixes[prefix]
            return keys

    def mark_alive(self, replica: int) -> None:
        with self._lock:
            load = self._replicas[replica]
            load.alive = True
            load.kv_usage = 0.0

    # ------------------------------------------------------------------ readers

    def loads(self) -> list[dict[str, object]]:
        """Per replica: alive, unfinished, kv_usage, routed_total, prefix_hits."""
        with self._lock:
            return [
                {
                    "alive": r.alive,
                    "unfinished": len(r.keys),
                    "kv_usage": r.kv_usage,
                    "routed_total": r.routed_total,
                    "prefix_hits": r.prefix_hits,
                }
                for r in self._replicas
            ]
