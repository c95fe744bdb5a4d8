"""The OpenMP settings of ops/openmp.py, checked in fresh processes (each one's own pools)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from nbengine.ops.openmp import PASSIVE_SPINCOUNT

_PROBE = r"""
import json, os, sys, threading, time
import nbengine
import torch
from nbengine.ops.openmp import release_thread_pool

def threads() -> int:
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(2)
a = torch.randn(512, 512)
base = threads()
torch.mm(a, a)  # this thread's OpenMP pool: one more thread
with_pool = threads()
released = release_thread_pool()
deadline = time.monotonic() + 30
while threads() > base and time.monotonic() < deadline:
    time.sleep(0.01)
after = threads()
torch.mm(a, a)  # the next parallel op starts a pool again
again = threads()
print(json.dumps(dict(env={k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
                      base=base, with_pool=with_pool, released=released, after=after, again=again)))
"""


def _probe(env: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_NUM_THREADS"] = "2"
    return env


def test_import_sets_passive_waiting_with_a_short_spin_and_the_pool_can_be_released() -> None:
    got = _probe(_clean_env())
    assert got["env"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": PASSIVE_SPINCOUNT}
    assert got["with_pool"] == got["base"] + 1, got  # the pool's worker
    assert got["released"] and got["after"] == got["base"], got  # ... gone after release
    assert got["again"] == got["with_pool"], got


def test_an_explicit_wait_policy_is_left_alone() -> None:
    env = _clean_env()
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    got = _probe(env)
    assert got["env"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}
