"""Install the Jupyter kernelspec the tutorials run under (``nbengine install-kernel``).

The spec is built here, in code, so a wheel install needs no file outside the package.
It runs ``ipykernel`` in the interpreter that has nbengine, with:

- ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``: the CPUs this process may use (its
  affinity), derived at install time; one OpenMP pool sized to the machine;
- ``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP workers sleep instead of spinning, so the
  notebook's own thread and the engine's loop thread keep a core (docs/architecture.md),
  after a spin of about 0.1 ms (``GOMP_SPINCOUNT``, nbengine/ops/openmp.py);
- ``PYTHONHASHSEED=0`` and ``TOKENIZERS_PARALLELISM=false``: stable notebook outputs
  (nbval compares them) and no tokenizer thread pool forked under the kernel.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from nbengine.ops.openmp import PASSIVE_SPINCOUNT

KERNEL_NAME = "nbengine"
DISPLAY_NAME = "Python 3 (nbengine)"


def available_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS reports one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def kernel_spec(python: str | None = None, threads: int | None = None) -> dict[str, Any]:
    """The ``kernel.json`` of the nbengine kernel (see the module docstring)."""
    n = str(threads if threads is not None else available_cpus())
    return {
        "argv": [python or sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": DISPLAY_NAME,
        "language": "python",
        "env": {
            "PYTHONHASHSEED": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": n,
            "MKL_NUM_THREADS": n,
            "OMP_WAIT_POLICY": "PASSIVE",
            "GOMP_SPINCOUNT": PASSIVE_SPINCOUNT,
        },
        "metadata": {"debugger": False},
    }


def install_kernel(user: bool = False, sys_prefix: bool = False, prefix: str | None = None) -> str:
    """Install the ``nbengine`` kernelspec, pointing at this Python interpreter.

    With neither ``user`` nor ``sys_prefix``, installs into ``sys.prefix`` (the active
    virtual environment), which is what the test command uses. Returns the install path.
    """
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / KERNEL_NAME
        target.mkdir()
        (target / "kernel.json").write_text(json.dumps(kernel_spec(), indent=2) + "\n")
        if not user and prefix is None:
            sys_prefix = True
        return str(
            KernelSpecManager().install_kernel_spec(
                str(target),
                kernel_name=KERNEL_NAME,
                user=user,
                prefix=sys.prefix if sys_prefix else prefix,
            )
        )
