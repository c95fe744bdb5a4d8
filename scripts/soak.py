#!/usr/bin/env python
"""Soak run: thousands of requests with random aborts and id reuse on a tiny model.

Client threads share one ``nb.Engine``. Each owns a small set of request ids and
reuses them constantly: an id is reused as soon as its previous incarnation has
delivered its final output or ``abort()``/``cancel()`` has returned. Each request
randomly ends by running to completion, by ``engine.abort(id)``, by
``handle.cancel()``, or by closing a partially consumed iterator. The KV pool is
small enough that requests get preempted.

At the end (submission stops after ``--requests`` or ``--time-limit``) every
handle is drained with a bounded wait, and one JSON line is printed:

- ``requests``: handles created; ``lost``: handles that never delivered a final output;
- ``leaked_blocks``: KV blocks still held once nothing is live; ``core_held`` /
  ``registry_left``: requests still held by the core / the frontend;
- ``abort_latency_ms``: p50/p90/p99/max of the time abort()/cancel() took to return
  (i.e. until the core confirmed the release);
- ``finish_reasons``, ``rejected_in_use`` (should be 0: ids are reused only when free),
  ``duration_s``, ``threads_left``.

Exit status 0 iff nothing was lost or leaked. Usage::

    python scripts/soak.py --requests 2000 --threads 8 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbengine as nb
from nbengine.core.messages import EngineCoreMessage, MessageType

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
WAIT_S = 120.0


@dataclass(slots=True)
class Totals:
    """Counters shared by the client threads (guarded by ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    handles: list[nb.RequestHandle] = field(default_factory=list)
    abort_latencies: list[float] = field(default_factory=list)
    rejected_in_use: int = 0
    errors: list[str] = field(default_factory=list)
    submitted: int = 0


def _params(rng: random.Random) -> nb.SamplingParams:
    max_tokens = rng.randint(1, 16)
    return nb.SamplingParams(
        n=rng.choice((1, 1, 1, 2)),
        max_tokens=max_tokens,
        min_tokens=rng.randint(0, min(3, max_tokens)),
        ignore_eos=rng.random() < 0.5,
        stop=rng.choice((None, None, ["e"], ["th", "in"])),
        temperature=rng.choice((0.0, 1.0)),
        output_kind=rng.choice(list(nb.RequestOutputKind)),
        seed=rng.choice((None, rng.randint(0, 1000))),
    )


def _finish_one(engine: nb.Engine, h: nb.RequestHandle, rng: random.Random, totals: Totals) -> None:
    """End one in-flight request in a random way; returns once its id is free."""
    r = rng.random()
    if r < 0.45:
        h.result(timeout=WAIT_S)
        return
    if r < 0.85:
        t0 = time.monotonic()
        if r < 0.65:
            engine.abort(h.request_id, timeout=WAIT_S)
        else:
            h.cancel(timeout=WAIT_S)
        with totals.lock:
            totals.abort_latencies.append(time.monotonic() - t0)
        if not h.done():
            raise AssertionError(f"{h.request_id}: abort returned before the final output")
        return
    # Consume a few outputs, then close the iterator early (cancels, confirmed).
    it = iter(h)
    for i, out in enumerate(it):
        if out.finished or i >= rng.randint(0, 2):
            break
    t0 = time.monotonic()
    it.close()
    if not h.done():
        h.result(timeout=WAIT_S)  # it had already finished: nothing to cancel
    else:
        with totals.lock:
            totals.abort_latencies.append(time.monotonic() - t0)


def _client(
    engine: nb.Engine,
    index: int,
    ids_per_client: int,
    budget: list[int],
    deadline: float,
    seed: int,
    totals: Totals,
) -> None:
    rng = random.Random(seed * 1000 + index)
    free = [f"c{index}-{k}" for k in range(ids_per_client)]
    inflight: list[nb.RequestHandle] = []
    try:
        while True:
            with totals.lock:
                may_submit = budget[0] > 0 and time.monotonic() < deadline
                if may_submit and free:
                    budget[0] -= 1
            if may_submit and free:
                rid = free.pop(rng.randrange(len(free)))
                prompt = f"{rid} says hello {rng.randint(0, 99)}"
                try:
                    h = engine.generate(prompt, _params(rng), request_id=rid)
                except nb.RequestIdInUseError:
                    with totals.lock:
                        totals.rejected_in_use += 1
                    free.append(rid)
                    continue
                with totals.lock:
                    totals.handles.append(h)
                    totals.submitted += 1
                inflight.append(h)
                if len(inflight) < 3 and rng.random() < 0.6:
                    continue  # keep several requests of this client in flight
            if not inflight:
                if not may_submit:
                    return
                continue
            h = inflight.pop(rng.randrange(len(inflight)))
            _finish_one(engine, h, rng, totals)
            free.append(h.request_id)  # free at once: reuse right away
    except BaseException as exc:  # reported in the summary, never swallowed
        with totals.lock:
            totals.errors.append(f"client {index}: {type(exc).__name__}: {exc}")


def _core_state(engine: nb.Engine) -> dict[str, int]:
    fut: Future[dict[str, int]] = Future()

    def snap(core: Any) -> dict[str, int]:
        s = core.scheduler
        return {
            "held": len(s.requests),
            "kv_used": s.kv.num_blocks - s.kv.num_free_blocks,
            "kv_total": s.kv.num_blocks,
        }

    engine._core_queue.put(EngineCoreMessage(MessageType.UTILITY, snap, fut))
    return fut.result(WAIT_S)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None, "count": 0}
    ms = sorted(v * 1000 for v in values)
    if len(ms) == 1:
        q = [ms[0]] * 99
    else:
        q = statistics.quantiles(ms, n=100, method="inclusive")
    return {
        "p50": round(q[49], 2),
        "p90": round(q[89], 2),
        "p99": round(q[98], 2),
        "max": round(ms[-1], 2),
        "count": len(ms),
    }


def run(
    requests: int,
    threads: int,
    ids_per_client: int,
    time_limit: float,
    seed: int,
    model: str | None,
    num_kv_blocks: int,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from nbengine.testing import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny", arch="llama", **TINY))
        baseline = {t.ident for t in threading.enumerate()}
        engine = nb.Engine(
            model,
            num_kv_blocks=num_kv_blocks,
            block_size=8,
            max_num_seqs=32,
            max_num_batched_tokens=256,
            seed=seed,
        )
        totals = Totals()
        budget = [requests]
        start = time.monotonic()
        deadline = start + time_limit
        clients = [
            threading.Thread(
                target=_client,
                name=f"soak-client-{i}",
                args=(engine, i, ids_per_client, budget, deadline, seed, totals),
            )
            for i in range(threads)
        ]
        for t in clients:
            t.start()
        for t in clients:
            t.join(time_limit + 4 * WAIT_S)
        hung_clients = sum(t.is_alive() for t in clients)
        # Drain: every handle must deliver its final output within a bounded wait.
        lost = 0
        reasons: Counter[str] = Counter()
        drain_deadline = time.monotonic() + WAIT_S
        for h in totals.handles:
            try:
                final = h.result(timeout=max(0.1, drain_deadline - time.monotonic()))
            except TimeoutError:
                lost += 1
                continue
            except nb.EngineDeadError as exc:
                totals.errors.append(f"{h.request_id}: EngineDeadError: {exc}")
                lost += 1
                continue
            for c in final.outputs:
                reasons[str(c.finish_reason)] += 1
        duration = time.monotonic() - start
        time.sleep(0.05)
        core = (
            _core_state(engine) if engine.is_alive else {"held": -1, "kv_used": -1, "kv_total": -1}
        )
        registry_left = engine.num_unfinished_requests()
        engine.shutdown()
        time.sleep(0.2)
        threads_left = [t.name for t in threading.enumerate() if t.ident not in baseline]
    summary = {
        "requests": len(totals.handles),
        "lost": lost,
        "leaked_blocks": core["kv_used"],
        "kv_blocks_total": core["kv_total"],
        "core_held": core["held"],
        "registry_left": registry_left,
        "abort_latency_ms": _percentiles(totals.abort_latencies),
        "finish_reasons": dict(sorted(reasons.items())),
        "rejected_in_use": totals.rejected_in_use,
        "errors": totals.errors[:10],
        "hung_clients": hung_clients,
        "threads_left": threads_left,
        "duration_s": round(duration, 2),
        "requests_per_s": round(len(totals.handles) / duration, 1) if duration else None,
        "config": {
            "threads": threads,
            "ids_per_client": ids_per_client,
            "seed": seed,
            "num_kv_blocks": num_kv_blocks,
            "time_limit_s": time_limit,
        },
    }
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--ids-per-client", type=int, default=4)
    ap.add_argument(
        "--time-limit", type=float, default=300.0, help="stop submitting after this many seconds"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="model directory (default: a tiny random one)")
    ap.add_argument("--num-kv-blocks", type=int, default=48)
    args = ap.parse_args(argv)
    summary = run(
        args.requests,
        args.threads,
        args.ids_per_client,
        args.time_limit,
        args.seed,
        args.model,
        args.num_kv_blocks,
    )
    print(json.dumps(summary))
    ok = (
        summary["lost"] == 0
        and summary["leaked_blocks"] == 0
        and summary["core_held"] == 0
        and summary["registry_left"] == 0
        and not summary["errors"]
        and not summary["hung_clients"]
        and not summary["threads_left"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
