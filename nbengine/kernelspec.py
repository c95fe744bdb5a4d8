"""Install the Jupyter kernelspec the tutorials run under (``nbengine install-kernel``)."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

KERNEL_NAME = "nbengine"


def _source_dir() -> Path:
    """The kernelspec shipped in the repository (kernels/nbengine) or inside the package."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "kernels" / KERNEL_NAME, here / "kernels" / KERNEL_NAME):
        if (candidate / "kernel.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"kernels/{KERNEL_NAME}/kernel.json not found next to the nbengine package."
    )


def install_kernel(user: bool = False, sys_prefix: bool = False, prefix: str | None = None) -> str:
    """Install the ``nbengine`` kernelspec, pointing at this Python interpreter.

    With neither ``user`` nor ``sys_prefix``, installs into ``sys.prefix`` (the active
    virtual environment), which is what the test command uses. Returns the install path.
    """
    from jupyter_client.kernelspec import KernelSpecManager

    spec = json.loads((_source_dir() / "kernel.json").read_text())
    spec["argv"][0] = sys.executable  # run the kernel in the interpreter that has nbengine
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / KERNEL_NAME
        shutil.copytree(_source_dir(), target)
        (target / "kernel.json").write_text(json.dumps(spec, indent=2) + "\n")
        if not user and prefix is None:
            sys_prefix = True
        return KernelSpecManager().install_kernel_spec(
            str(target),
            kernel_name=KERNEL_NAME,
            user=user,
            prefix=sys.prefix if sys_prefix else prefix,
        )
