"""THE RACE (vLLM's request-id reuse bug), 40 times, each in its own process and engine.

Processes come from a forkserver that has torch and nbengine imported (each child is
a fresh process with its own engine threads); 4 run at a time.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import race_worker


def test_abort_then_readd_40_processes(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The forkserver is a fresh interpreter that ignores our sys.path (CPython 3.11):
    # give it this folder through PYTHONPATH so it can preload race_worker.
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "nbengine", "race_worker"])
    with ctx.Pool(processes=4, maxtasksperchild=1) as pool:
        results = pool.map(race_worker.run_race, [str(tiny_model)] * 40, chunksize=1)
    pids = {r[0] for r in results}
    assert len(pids) == 40  # every copy ran in its own process
    assert [r[1:] for r in results] == [(3, "abort", "length")] * 40
