"""A short soak run (scripts/soak.py): nothing lost, nothing leaked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


def test_soak_loses_and_leaks_nothing(tiny_model: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--requests",
            "300",
            "--time-limit",
            "40",
            "--threads",
            "6",
            "--seed",
            "1",
            "--model",
            str(tiny_model),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no summary; stderr:\n{proc.stderr[-3000:]}"
    summary = json.loads(lines[-1])
    assert summary["errors"] == [], summary["errors"]
    assert summary["lost"] == 0
    assert summary["leaked_blocks"] == 0
    assert summary["core_held"] == 0 and summary["registry_left"] == 0
    assert summary["hung_clients"] == 0 and summary["threads_left"] == []
    assert summary["rejected_in_use"] == 0  # ids were reused only once free
    assert summary["requests"] >= 100  # the time limit still leaves a real workload
    assert summary["finish_reasons"].get("abort", 0) > 0
    assert summary["abort_latency_ms"]["count"] > 0
    assert proc.returncode == 0
