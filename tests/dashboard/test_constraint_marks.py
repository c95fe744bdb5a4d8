"""The dashboard and the handle widget mark requests under a structured-output constraint."""

from __future__ import annotations

import nbengine as nb
from nbengine import StructuredOutputsParams

from support.requests import wait_until


def test_handle_widget_and_dashboard_mark_constrained_requests(engine: nb.Engine) -> None:
    dash = engine.dashboard()
    spec = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}}
    )
    constrained = engine.generate(
        "x", nb.SamplingParams(max_tokens=2000, structured_outputs=spec), request_id="shaped"
    )
    plain = engine.generate(
        "x", nb.SamplingParams(max_tokens=2000, ignore_eos=True), request_id="free"
    )
    try:
        w = constrained.widget()
        assert "nbengine-constraint" in w.title.value and "json" in w.title.value
        assert "nbengine-constraint" not in plain.widget().title.value

        def cell(rid: str) -> str | None:
            for row in dash.rows:
                if row.request_id == rid:
                    return row.id_cell.value
            return None

        wait_until(
            lambda: cell("shaped") is not None and cell("free") is not None, what="both rows"
        )
        shaped, free = cell("shaped"), cell("free")
        assert shaped is not None and free is not None
        assert "nbengine-constraint" in shaped and "json" in shaped and "integer" in shaped
        assert "nbengine-constraint" not in free
        rows = {r.request_id: r for r in engine.monitor.metrics.snapshot_requests()}
        assert rows["shaped"].constraint is not None
        assert rows["shaped"].constraint.startswith("json: ")
        assert rows["free"].constraint is None
    finally:
        constrained.cancel()
        plain.cancel()
