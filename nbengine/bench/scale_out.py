"""Scale-out measurements behind docs/scale-out.md.

``python -m nbengine.bench.scale_out [--model DIR] [--requests 64] [--max-tokens 32]``
builds a tiny model if none is given, starts a local Ray instance, and prints, for the
in-process backend and for ``backend="ray"`` with 1 and 2 replicas: requests/s and
output tokens/s of a burst, the per-token overhead of one streamed request (frontend
inter-token gap minus the core's own step time), the abort round trip, and the prefix
cache hits of a shared-prefix workload under least-loaded vs prefix-aware routing.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import nbengine as nb

_ENGINE_KW = dict(num_kv_blocks=1024, block_size=16, max_num_seqs=64, max_num_batched_tokens=512)
_TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def _burst(engine: nb.Engine, n: int, max_tokens: int) -> dict[str, float]:
    params = nb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    handles = [engine.generate(f"Request number {i} says", params) for i in range(n)]
    tokens = sum(len(h.result(timeout=600).outputs[0].token_ids) for h in handles)
    took = time.perf_counter() - start
    return {"req_per_s": n / took, "tok_per_s": tokens / took}


def _stream_overhead(engine: nb.Engine, tokens: int) -> dict[str, float]:
    """Mean frontend gap between tokens of one request vs the core's mean step time."""
    params = nb.SamplingParams(
        max_tokens=tokens, ignore_eos=True, output_kind=nb.RequestOutputKind.DELTA
    )
    steps_before = len(engine.step_stats())
    arrivals: list[float] = []
    for out in engine.generate("A single streamed request", params):
        arrivals.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
    gaps = [b - a for a, b in zip(arrivals[10:], arrivals[11:])]
    steps = engine.step_stats().step_time.iloc[steps_before:].iloc[10:]
    gap = statistics.mean(gaps) if gaps else float("nan")
    step = float(steps.mean()) if len(steps) else float("nan")
    return {"itl_ms": gap * 1e3, "step_ms": step * 1e3, "overhead_ms": (gap - step) * 1e3}


def _abort_round_trip(engine: nb.Engine, repeats: int = 10) -> float:
    times = []
    for i in range(repeats):
        h = engine.generate(
            "Abort me",
            nb.SamplingParams(max_tokens=100_000, ignore_eos=True),
            request_id=f"abort-{i}",
        )
        while not h.token_ids:
            time.sleep(0.001)
        t0 = time.perf_counter()
        engine.abort(h.request_id)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _prefix_hits(engine: nb.Engine, groups: int = 4, per_group: int = 8) -> dict[str, float]:
    vocab = engine.vocab_size
    params = nb.SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = []
    for g in range(groups):
        base = [(31 * g + 7 * j) % (vocab - 20) + 10 for j in range(64)]  # shared 64-token prefix
        prompts += [base + [(g * per_group + k) % vocab] for k in range(per_group)]
    handles = []
    for p in prompts:
        handles.append(engine.generate(p, params))
    outs = [h.result(timeout=600) for h in handles]
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    return {"cached_tokens": cached, "prompt_tokens": sum(len(p) for p in prompts)}


def run(model: str, n: int, max_tokens: int) -> list[dict[str, Any]]:
    import ray

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    rows: list[dict[str, Any]] = []
    setups: list[tuple[str, dict[str, Any]]] = [
        ("inproc", {}),
        ("ray x1", {"backend": "ray", "data_parallel_size": 1}),
        ("ray x2", {"backend": "ray", "data_parallel_size": 2}),
        (
            "ray x2 least_loaded",
            {"backend": "ray", "data_parallel_size": 2, "routing": "least_loaded"},
        ),
    ]
    for name, kw in setups:
        t0 = time.perf_counter()
        with nb.Engine(model, **_ENGINE_KW, **kw) as engine:
            row: dict[str, Any] = {"setup": name, "start_s": time.perf_counter() - t0}
            _burst(engine, 8, 4)  # warm-up
            if name != "ray x2 least_loaded":
                row.update(_burst(engine, n, max_tokens))
                row.update(_stream_overhead(engine, 120))
                row["abort_ms"] = _abort_round_trip(engine)
            if name != "ray x1":
                row.update(_prefix_hits(engine))
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from nbengine.testing import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", **_TINY))
    run(model, args.requests, args.max_tokens)


if __name__ == "__main__":
    main()
