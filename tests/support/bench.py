"""A bench report with no runs in it, for tests of ``format_report``'s header and notes."""

from __future__ import annotations

from typing import Any


def empty_report(**config: Any) -> dict[str, Any]:
    """A report of a two-CPU machine with no results; ``config`` adds to its config."""
    machine = {
        "cpu_count": 2,
        "cpu_flags": [],
        "torch": "t",
        "torch_threads": 2,
        "transformers": "x",
        "load_average_start": None,
        "load_average_end": None,
        "bandwidth_gb_s": 1.0,
        "matmul_gflop_s": 1.0,
        "matmul_gflop_s_float32": 1.0,
    }
    return {
        "machine": machine,
        "config": {"model_dir": "m", "dtype": "bfloat16", "scale": 1, "repeats": 1, **config},
        "results": {},
        "bounds": {},
        "targets": {},
        "warnings": [],
        "elapsed_s": 1.0,
    }
