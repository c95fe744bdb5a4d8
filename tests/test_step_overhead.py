"""scripts/step_overhead.py (docs/benchmarks.md, "Per-step overhead") cannot rot: it runs
small on a tiny model and splits the run into compute and overhead."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from nbengine.testing import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def test_step_overhead_script_splits_a_run(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", max_position_embeddings=512, vocab_size=512)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "step_overhead.py"), "--model", str(model)]
        + ["--workload", "W1", "--scale", "0.1", "--quantization", "int8"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "W1 (int8" in out and "steps" in out
    compute = float(out.split("compute")[1].split("s")[0])
    overhead = float(out.split("overhead")[1].split("s")[0])
    assert compute > 0 and overhead > 0
