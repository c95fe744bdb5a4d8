"""Runs bench jobs each in a fresh process with one fixed environment.

Why: run in one process, an engine inherits what the engines before it left behind
(allocator state, OpenMP pools and their wait policy, thread settings, a warm page
cache of weights), so its figure depends on the order (docs/benchmarks.md, "Why
earlier figures differed"). Here every job is ``python -m nbengine.bench.worker`` with
the environment ``engine_environment`` builds once per bench run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from nbengine.bench.worker import Job, job_json
from nbengine.ops.openmp import PASSIVE_SPINCOUNT

__all__ = ["WAIT_POLICY_VARIABLES", "engine_environment", "run_isolated"]

# The variables through which ``engine_environment`` sets a wait policy.
WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

# A job that takes longer than this is reported as an error (a full W1 on hf_cb takes
# about a minute on two cores).
JOB_TIMEOUT_S = 3600.0


def engine_environment(threads: int, wait_policy: str) -> dict[str, str]:
    """The environment of every engine process: this one's, with the threading pinned.

    ``OMP_WAIT_POLICY`` decides whether idle OpenMP workers spin or sleep, which moves
    every engine's speed on a shared machine; ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``
    size the pools before torch is imported (the worker also calls
    ``torch.set_num_threads``). ``PYTHONPATH`` starts with the directory this nbengine
    was imported from, so the worker runs the same code as the parent.
    """
    import nbengine

    env = dict(os.environ)
    root = str(Path(nbengine.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_WAIT_POLICY"] = wait_policy
    # nbengine's short spin before sleeping goes with PASSIVE only: libgomp's explicit
    # spin count would otherwise cut ACTIVE's endless one short (ops/openmp.py).
    if wait_policy.upper() == "PASSIVE":
        env.setdefault("GOMP_SPINCOUNT", PASSIVE_SPINCOUNT)
    elif env.get("GOMP_SPINCOUNT") == PASSIVE_SPINCOUNT:
        del env["GOMP_SPINCOUNT"]
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    return env


def run_isolated(job: Job, env: dict[str, str], timeout_s: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    """Run ``job`` in a new worker process under ``env``; its summary, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory(prefix="nbengine-bench-") as tmp:
        job_path, result_path, log_path = (
            Path(tmp) / n for n in ("job.json", "result.json", "worker.log")
        )
        job_path.write_text(job_json(job))
        cmd = [sys.executable, "-m", "nbengine.bench.worker", str(job_path), str(result_path)]
        try:
            with open(log_path, "wb") as log:
                done = subprocess.run(
                    cmd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=timeout_s,
                    check=False,
                )
        except subprocess.TimeoutExpired:
            return {"error": f"the worker took longer than {timeout_s:.0f} s"}
        if result_path.is_file():
            return dict(json.loads(result_path.read_text()))
        tail = log_path.read_text(errors="replace")[-2000:].strip()
        return {"error": f"the worker exited with status {done.returncode}: {tail}"}
