"""The bench's chart: output tokens/s per engine and precision, with the bound as a line.

``peers_figure(reports)`` takes one or more ``run_bench`` reports (typically one per
precision: ``--quantization`` unset, int8, int4) and draws, for one workload, a bar per
engine per report with the repeats' min-max as error bars, and the workload's physical
bound of each report as a dashed line over its bars (docs/benchmarks.md, "The bound").
In a notebook the returned plotly figure displays itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["peers_figure", "precision_label"]


def precision_label(report: dict[str, Any]) -> str:
    """The weights a report's nbengine ran: its ``--quantization``, else its dtype."""
    cfg = report["config"]
    return str(cfg.get("quantization") or cfg["dtype"])


def peers_figure(reports: Sequence[dict[str, Any]], workload: str = "W2") -> Any:
    """A plotly bar chart of output tok/s per engine for ``workload``, one group per report.

    Raises ``ValueError`` when no report measured ``workload``.
    """
    import plotly.graph_objects as go

    measured = [r for r in reports if workload in r.get("results", {})]
    if not measured:
        raise ValueError(f"none of the {len(reports)} report(s) measured {workload!r}.")
    labels = [precision_label(r) for r in measured]
    engines: list[str] = []
    for r in measured:
        engines += [e for e in r["results"][workload] if e not in engines]
    fig = go.Figure()
    for engine in engines:
        ys: list[float | None] = []
        lo: list[float] = []
        hi: list[float] = []
        for r in measured:
            res = r["results"][workload].get(engine, {})
            y = res.get("output_tok_s") if "error" not in res else None
            ys.append(y)
            lo.append(y - res.get("output_tok_s_min", y) if y is not None else 0.0)
            hi.append(res.get("output_tok_s_max", y) - y if y is not None else 0.0)
        fig.add_trace(
            go.Bar(
                name=engine,
                x=labels,
                y=ys,
                error_y={"type": "data", "symmetric": False, "array": hi, "arrayminus": lo},
            )
        )
    for i, r in enumerate(measured):
        bound = r.get("bounds", {}).get(workload, {}).get("output_tok_s")
        if bound is not None:
            fig.add_shape(
                type="line",
                x0=i - 0.45,
                x1=i + 0.45,
                y0=bound,
                y1=bound,
                line={"dash": "dash", "color": "black"},
            )
    fig.add_trace(  # a legend entry for the bound lines
        go.Scatter(x=[None], y=[None], mode="lines", name="bound", line={"dash": "dash"})
    )
    fig.update_layout(
        barmode="group",
        title=f"{workload}: output tokens/s (median; bars: min-max of the repeats)",
        xaxis_title="weights",
        yaxis_title="output tokens/s",
    )
    return fig
