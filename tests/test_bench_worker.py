"""The bench worker measures a quiet process: a load-cache miss's background store of the
new entry (gigabytes at the 1B shape) is finished before the measured run starts
(nbengine/bench/worker.py; docs/benchmarks.md, "What is measured")."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nbengine.bench.engines import NbengineDriver
from nbengine.bench.worker import Job, run_job
from nbengine.model import load_cache
from nbengine.testing import make_tiny_model

STORE_S = 1.5  # how long each store is held back, so a measured run that raced it sees it


def _stores_in_flight() -> int:
    with load_cache._stores_lock:
        return sum(t.is_alive() for t in load_cache._stores)


def test_the_measured_run_starts_after_the_cache_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = make_tiny_model(tmp_path / "m", vocab_size=512, max_position_embeddings=256)
    monkeypatch.setenv("NBENGINE_LOAD_CACHE", str(tmp_path / "load-cache"))  # a miss

    write = load_cache._write

    def slow_write(*args: Any, **kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(STORE_S)
        write(*args, **kwargs)

    monkeypatch.setattr(load_cache, "_write", slow_write)

    seen: list[int] = []  # stores in flight at the start of each driver run
    run = NbengineDriver.run

    def watched_run(self: NbengineDriver, wl: Any, **overrides: Any) -> Any:
        seen.append(_stores_in_flight())
        return run(self, wl, **overrides)

    monkeypatch.setattr(NbengineDriver, "run", watched_run)
    job = Job(
        kind="run",
        engine="nbengine",
        label="nbengine",
        workload="W2",
        model_dir=str(model_dir),
        dtype="float32",
        threads=1,
        scale=0.02,
        seed=0,
        vocab=512,
        engine_kwargs={"max_num_seqs": 8, "max_num_batched_tokens": 128, "quantization": "int8"},
        static_batch_size=8,
    )
    out = run_job(job)
    # Runs: the continuation probe may load once first; then the warm-up; then the run.
    assert len(seen) >= 2
    assert seen[-1] == 0, f"a load-cache store was still being written: {seen}"
    assert out["cache_store_wait_s"] >= 0.0
    assert out["output_tok_s"] > 0
    assert list((tmp_path / "load-cache").glob("*.safetensors")), "no entry was stored"
