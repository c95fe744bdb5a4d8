"""``nbengine bench``: nbengine against transformers on fixed workloads, and the physical bound.

The package, one concept per module (docs/benchmarks.md describes the method):

- ``config``: ``BenchConfig``, what a run measures and how;
- ``workloads``: the bench model (random weights in SmolLM2-135M's shape) and the seeded
  workloads W1, W2, W3 and W4;
- ``engines``: the engines under test (nbengine, transformers static ``generate``,
  transformers continuous batching, CTranslate2), one driver each;
- ``gguf``: the llama.cpp peer's weights (GGUF conversion, cached);
- ``llamacpp``: the llama.cpp peer (the check against transformers, the batched driver);
- ``machine``: what the machine can do (bandwidth, matmul FLOP/s) and a workload's bound;
- ``runner``: ``run_bench``, which runs them all and assembles the report;
- ``report``: per-run figures, medians, targets, ``format_report``;
- ``chart``: ``peers_figure``, the plotly bar chart of engines and precisions;
- ``peers``: ``run_peers``, the peers at several precisions in one call, shown as that
  chart in a notebook;
- ``scale_out``: the Ray data-parallel measurements behind docs/scale-out.md.
- ``cli``: the ``nbengine bench`` command's options and run.

``run_bench(BenchConfig(...))`` (or ``run_bench(model_dir=..., scale=0.1)``) returns one
JSON-able dict; ``format_report()`` renders it as a table.
"""

from nbengine.bench.chart import peers_figure
from nbengine.bench.config import ALL_ENGINES, BenchConfig
from nbengine.bench.peers import PeersRun, run_peers
from nbengine.bench.report import TARGETS, format_report
from nbengine.bench.runner import run_bench
from nbengine.bench.workloads import ALL_WORKLOADS, SMOLLM2_135M, bench_model_dir, make_workloads

__all__ = [
    "ALL_ENGINES",
    "ALL_WORKLOADS",
    "BenchConfig",
    "SMOLLM2_135M",
    "TARGETS",
    "bench_model_dir",
    "format_report",
    "make_workloads",
    "PeersRun",
    "peers_figure",
    "run_bench",
    "run_peers",
]
