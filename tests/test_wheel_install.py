"""A wheel install works without the repository: the kernelspec is built in code and the
package data (default model, kernel source) ships inside the wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_wheel_installs_the_kernel_and_the_default_model(tmp_path: Path) -> None:
    # Built from a copy of what a source distribution holds, so that setuptools' build/
    # directory (which keeps files deleted since) never lands in the checkout.
    src = tmp_path / "src"
    shutil.copytree(
        ROOT / "nbengine", src / "nbengine", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        timeout=600,
    )
    wheel = next((tmp_path / "dist").glob("nbengine-*.whl"))
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        timeout=600,
    )
    prefix = tmp_path / "prefix"
    code = (
        "import json, nbengine\n"
        "from nbengine.kernelspec import install_kernel\n"
        "from nbengine.model.loader import DEFAULT_MODEL_DIR\n"
        "from nbengine.ops.native_build import SOURCE\n"
        f"path = install_kernel(prefix={str(prefix)!r})\n"
        "print(json.dumps({'package': nbengine.__file__, 'kernel': path,"
        " 'model': (DEFAULT_MODEL_DIR / 'model.safetensors').is_file(),"
        " 'source': SOURCE.is_file()}))"
    )
    # The wheel's copy comes first on the path, ahead of this checkout's editable install.
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["package"].startswith(str(site))
    assert result["model"] and result["source"]
    spec = json.loads((Path(result["kernel"]) / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable and spec["display_name"] == "Python 3 (nbengine)"
    threads = int(spec["env"]["OMP_NUM_THREADS"])
    assert threads == len(os.sched_getaffinity(0))
