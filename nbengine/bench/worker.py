"""One engine on one workload, in a process of its own: ``python -m nbengine.bench.worker``.

``run_bench`` starts this module once per measurement (repeat x workload x engine) with
the same environment every time (each engine's wait policy aside), so no engine
inherits another's allocator state, OpenMP pools, thread settings or warm caches
(docs/benchmarks.md, "Why earlier figures differed"). The job arrives as a JSON file; the
summarised run goes back as a JSON file.

Invariant: every job of one ``run_bench`` call differs only in ``engine``, ``workload``,
``run`` and ``overrides``; the model, dtype, threads, engine arguments and environment
are the same but for each engine's OpenMP wait policy (``BenchConfig.wait_policy``: its
faster one, part of its configuration), so a difference between two results is the
engines' own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Job", "main", "run_job"]

# What the worker reports about its own process, so the report shows that every engine
# ran under the same settings (and each under its own wait policy).
_ENV_KEYS = (
    "OMP_WAIT_POLICY",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OMP_PROC_BIND",
    "GOMP_SPINCOUNT",
    "KMP_BLOCKTIME",
    "NBENGINE_NATIVE",
)


@dataclass(slots=True)
class Job:
    """What one worker process measures.

    ``kind`` "run": ``engine`` runs workload ``workload`` (rebuilt from ``workloads``'
    seed and scale, so it is the same token ids as in the parent) under the label
    ``label`` with ``overrides`` (nb.Engine arguments for this run only). ``kind``
    "abort": nbengine's ``abort()`` latency with ``abort_running`` requests decoding.
    Every run is preceded by a warm-up on the first requests of the same workload.
    """

    kind: str
    engine: str
    label: str
    workload: str
    model_dir: str
    dtype: str
    threads: int
    scale: float
    seed: int
    vocab: int
    engine_kwargs: dict[str, Any]
    static_batch_size: int
    overrides: dict[str, Any] = field(default_factory=dict)
    abort_running: int = 0
    abort_count: int = 0


def _driver(job: Job) -> Any:
    from nbengine.bench.engines import HFContinuousDriver, HFStaticDriver, NbengineDriver

    path = Path(job.model_dir)
    if job.engine == "nbengine":
        return NbengineDriver(path, job.dtype, job.engine_kwargs)
    if job.engine == "hf_static":
        return HFStaticDriver(path, job.dtype, job.static_batch_size)
    if job.engine == "hf_cb":
        return HFContinuousDriver(
            path,
            job.dtype,
            job.engine_kwargs["max_num_batched_tokens"],
            job.engine_kwargs["max_num_seqs"],
        )
    if job.engine == "ct2":
        from nbengine.bench.engines import CT2Driver

        return CT2Driver(
            path, job.dtype, job.static_batch_size, job.engine_kwargs.get("quantization")
        )
    if job.engine == "llamacpp":
        from nbengine.bench.llamacpp import LlamaCppDriver

        return LlamaCppDriver(
            path,
            job.dtype,
            job.engine_kwargs.get("quantization"),
            n_batch=job.engine_kwargs["max_num_batched_tokens"],
            n_seq_max=job.engine_kwargs["max_num_seqs"],
        )
    raise ValueError(f"unknown engine {job.engine!r}")


def _warmup(wl: Any) -> Any:
    """The first (up to) 8 requests of ``wl`` with at most 8 output tokens each.

    Long enough for first-call costs (kernel compilation or loading, allocator growth,
    thread pool start, nbengine's thread chooser) to be paid outside the measurement;
    short next to the measured run.
    """
    from nbengine.bench.workloads import Workload

    n = min(8, len(wl.prompts))
    return Workload(
        f"{wl.name}-warmup",
        wl.prompts[:n],
        [min(8, o) for o in wl.output_lens[:n]],
        wl.shared_prefix,
    )


def _process_state() -> dict[str, Any]:
    import torch

    return {
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "env": {k: os.environ.get(k) for k in _ENV_KEYS},
    }


def run_job(job: Job) -> dict[str, Any]:
    """Run ``job`` in this process and return its summary (figures, or an error)."""
    import torch

    from nbengine.bench.machine import probe, process_memory
    from nbengine.bench.report import percentile, summarise, to_ms
    from nbengine.bench.workloads import engine_continuation, make_workloads
    from nbengine.model import load_cache

    torch.set_num_threads(job.threads)
    quant = job.engine_kwargs.get("quantization")
    cont = engine_continuation(job.model_dir, job.dtype, {"quantization": quant} if quant else {})
    wl = make_workloads((job.workload,), job.vocab, job.scale, job.seed, cont)[job.workload]
    t_load = time.perf_counter()
    driver = _driver(job)
    out: dict[str, Any] = {"load_s": time.perf_counter() - t_load}
    loaded = {"ready_time": time.time(), **process_memory()}
    t_warm = time.perf_counter()
    warm = driver.run(_warmup(wl), **job.overrides)
    if warm.error:
        raise RuntimeError(f"warm-up failed: {warm.error}")
    out["warmup_s"] = time.perf_counter() - t_warm
    out.update(_load_figures(driver, loaded, warm))
    # A first load (a load-cache miss) writes its entry in the background once the engine
    # is ready (docs/load-cache.md): gigabytes at the 1B shape, which would share the
    # cores and the memory bus with the measured run. Its time is reported, not measured.
    t_store = time.perf_counter()
    load_cache.wait_for_stores()
    out["cache_store_wait_s"] = time.perf_counter() - t_store
    dtype = getattr(torch, job.dtype)
    out["probe_before"] = probe(dtype)
    out["load_average_before"] = list(os.getloadavg())
    if job.kind == "abort":
        lat = driver.abort_latency(wl.prompts, job.abort_running, job.abort_count)
        out.update(
            {
                "num_running": job.abort_running,
                "num_aborts": len(lat),
                "p50_ms": to_ms(percentile(lat, 50)),
                "p99_ms": to_ms(percentile(lat, 99)),
            }
        )
    else:
        out.update(summarise(driver.run(wl, **job.overrides)))
    out["load_average_after"] = list(os.getloadavg())
    out["memory_after_run"] = process_memory()
    out["probe_after"] = probe(dtype)
    out["process"] = _process_state()
    return out


def _load_figures(driver: Any, loaded: dict[str, Any], warm: Any) -> dict[str, Any]:
    """Process start -> engine ready and -> first token (of the warm-up), and the memory
    at ready: ``loaded`` was taken when the driver was made, which is when the peers load;
    nbengine loads in its first run (``NbengineDriver.first_load``). The first token is
    the warm-up's first TTFT after its start (nbengine's: after its engine was ready)."""
    from nbengine.bench.machine import process_start_time

    first = getattr(driver, "first_load", None) or loaded
    start = process_start_time()
    out: dict[str, Any] = {
        "rss_ready_bytes": first.get("rss_bytes"),
        "peak_rss_load_bytes": first.get("peak_rss_bytes"),
    }
    for key in ("weights_bytes", "kv_cache_bytes"):
        if key in first:
            out[key] = first[key]
    if start is not None:
        ready = first["ready_time"]
        out["start_to_ready_s"] = ready - start
        if warm.ttft_s:
            # The warm-up's TTFTs count from its t0: its start (the peers: at once after
            # ``loaded``), or its engine's ready (nbengine): ``ready`` either way.
            out["start_to_first_token_s"] = ready + min(warm.ttft_s) - start
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m nbengine.bench.worker JOB.json RESULT.json``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job")
    ap.add_argument("result")
    args = ap.parse_args(argv)
    job = Job(**json.loads(Path(args.job).read_text()))
    try:
        result = run_job(job)
    except Exception as exc:  # reported by the parent as this engine's error
        result = {"error": f"{type(exc).__name__}: {exc}"}
    Path(args.result).write_text(json.dumps(result))
    return 0


def job_json(job: Job) -> str:
    """``job`` as the JSON the worker reads."""
    return json.dumps(asdict(job))


if __name__ == "__main__":
    sys.exit(main())
