"""nbengine against its peers at several precisions: ``run_peers``, for a notebook.

``nbengine bench --peers`` runs one precision per command and prints its table. In a
notebook, ``run_peers()`` runs the same bench once per precision (bfloat16, int8, int4 by
default: nbengine's ``quantization``, llama.cpp's GGUF type and CTranslate2's compute
type follow it, docs/benchmarks.md) with the installed peers, prints each table as it
completes, and returns a ``PeersRun``: displayed as the last value of a cell it is the
plotly bar chart of ``peers_figure`` (output tokens/s per engine and precision, the bound
as a dashed line), and ``.reports`` holds the JSON-able reports.

    from nbengine.bench import run_peers
    run = run_peers(workloads=("W2",), repeats=3)
    run                      # the chart
    run.figure("W2").write_html("peers.html")
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from nbengine.bench.chart import peers_figure
from nbengine.bench.config import BenchConfig, peer_engines
from nbengine.bench.report import format_report
from nbengine.bench.runner import run_bench

__all__ = ["PeersRun", "run_peers"]


@dataclass
class PeersRun:
    """The reports of one ``run_peers`` call, one per precision, in the order run."""

    reports: list[dict[str, Any]]
    workloads: tuple[str, ...]

    def figure(self, workload: str | None = None) -> Any:
        """``peers_figure`` of every report for ``workload`` (default: the first one run)."""
        return peers_figure(self.reports, workload or self.workloads[0])

    def table(self) -> str:
        """Every report's table (``format_report``), one after another."""
        return "\n\n".join(format_report(r) for r in self.reports)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """A notebook shows the chart of the first workload (plotly's own MIME type, which
        JupyterLab renders through plotly's extension); a terminal, the tables."""
        import plotly.io as pio

        chart = json.loads(pio.to_json(self.figure(), validate=False))
        return {"application/vnd.plotly.v1+json": chart, "text/plain": self.table()}


def run_peers(
    precisions: Sequence[str | None] = (None, "int8", "int4"),
    workloads: Sequence[str] = ("W2",),
    repeats: int = 3,
    engines: Sequence[str] | None = None,
    log: Callable[[str], None] | None = print,
    **config: Any,
) -> PeersRun:
    """Run nbengine and every installed peer (``--peers``) at each of ``precisions``.

    A precision is a ``quantization`` value, None for the bench dtype. ``engines`` (default:
    those of ``--peers`` installed here) narrows the set; ``config`` takes the other
    ``BenchConfig`` fields (``scale``, ``threads``, ``model_dir``, ...). Raises
    ``ValueError`` for an unknown precision, engine or workload before anything runs.
    """
    installed, skipped = peer_engines()
    if engines is None:
        engines = installed
    configs = [
        BenchConfig(
            workloads=tuple(workloads),
            engines=tuple(engines),
            quantization=p,
            repeats=repeats,
            abort_latency=False,
            **config,
        )
        for p in precisions
    ]
    reports = []
    for cfg in configs:
        report = run_bench(cfg, log=log)
        report["config"]["skipped_engines"] = skipped
        if log is not None:
            log(format_report(report))
        reports.append(report)
    return PeersRun(reports, tuple(workloads))
