"""The bench's chart of engines and precisions (nbengine.bench.peers_figure), drawn from
the side-by-side reports kept in docs/bench-runs/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nbengine.bench import peers_figure

RUNS = Path(__file__).resolve().parents[1] / "docs" / "bench-runs"


def _report(name: str) -> dict:
    return json.loads((RUNS / name).read_text())


def test_one_bar_per_engine_and_precision_with_the_bound() -> None:
    reports = [_report(f"2026-12-01-peers-W2-{p}.json") for p in ("bf16", "int8", "int4")]
    fig = peers_figure(reports, "W2")
    bars = {t.name: t for t in fig.data if t.type == "bar"}
    assert sorted(bars) == ["ct2", "llamacpp", "nbengine"]
    assert list(bars["nbengine"].x) == ["bfloat16", "int8", "int4"]
    for i, r in enumerate(reports):
        res = r["results"]["W2"]["nbengine"]
        assert bars["nbengine"].y[i] == res["output_tok_s"]
        assert bars["nbengine"].error_y.array[i] == res["output_tok_s_max"] - res["output_tok_s"]
    bounds = [s.y0 for s in fig.layout.shapes]
    assert bounds == [r["bounds"]["W2"]["output_tok_s"] for r in reports]
    assert any(t.name == "bound" for t in fig.data)


def test_a_workload_no_report_measured_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="W3"):
        peers_figure([_report("2026-12-01-peers-W2-bf16.json")], "W3")
