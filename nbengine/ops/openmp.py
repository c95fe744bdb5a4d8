"""The process's OpenMP threads: how idle workers wait, and whose pool is alive.

torch's CPU ops (oneDNN's matmuls among them) and nbengine's native kernels run their
parallel work on libgomp's thread pools, and every thread that starts parallel work gets
a pool of its own. What a parallel region costs to start depends on how the pool's
idle workers wait for it (docs/benchmarks.md, "Threads"):

- **Waiting.** A worker that spins takes a core from everything else that wants it (the
  engine's loop thread, the notebook, other processes), so ``import nbengine`` asks for
  ``OMP_WAIT_POLICY=PASSIVE``. A worker that sleeps at once must be woken by a system
  call for the next region, about 0.2 ms here, and a prefill step of the bench model
  starts about 150 regions. ``PASSIVE_SPINCOUNT`` bounds the spin in between: a worker
  spins about 0.1 ms before it sleeps (libgomp's ``GOMP_SPINCOUNT``, which wins over the
  wait policy), which is longer than the gaps inside a step and short next to anything
  it could take a core from.
- **Pools.** Once the live pools together hold more threads than there are CPUs, libgomp
  lets every worker spin only about a thousand iterations (microseconds), whatever the
  spin count says. An engine loads its model on the caller's thread and then computes on
  its core thread: two pools. ``release_thread_pool`` ends the caller's pool after the
  load, so the core thread's is the only one. (A pool is started again by the next
  parallel op on that thread; the engine is then as fast as without the release.)

A 32-token prefill step of the bench model through an ``Engine`` took 50 ms before
either change and 28-30 ms after both (2026-12-01, two threads); either alone changed
nothing measurable.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

__all__ = ["PASSIVE_SPINCOUNT", "release_thread_pool"]

logger = logging.getLogger(__name__)

# Busy-wait iterations of an idle libgomp worker before it sleeps: about 0.1 ms of CPU
# here (0.06 ms at 0, 0.17 ms at 10000, 0.34 ms at 30000: measured per idle gap).
PASSIVE_SPINCOUNT = "10000"

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release threads, keep what is cheap to keep


@cache
def _libgomp() -> ctypes.CDLL | None:
    """The process's libgomp (torch loads it), or None where there is none."""
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL)
        lib.omp_pause_resource_all.restype = ctypes.c_int
        lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
        lib.omp_in_parallel.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None


def release_thread_pool() -> bool:
    """End the calling thread's OpenMP worker pool (OpenMP 5's ``omp_pause_resource_all``).

    Returns True when libgomp released it. A no-op (False) without libgomp, inside a
    parallel region, or where the runtime refuses; the next parallel op on this thread
    starts a new pool either way.
    """
    lib = _libgomp()
    if lib is None or lib.omp_in_parallel():
        return False
    released = lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
    if not released:
        logger.debug("libgomp did not release this thread's OpenMP pool")
    return released
