"""``nbengine bench``: the command's options and its run (the measurements: runner.py).

``add_bench_parser`` adds the subcommand to ``nbengine``'s parser (nbengine/cli.py);
``run_bench_cli`` runs it: the table on stdout, progress on stderr, and the JSON report
and charts where asked for.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_bench_parser", "bench_engines", "run_bench_cli"]


def add_bench_parser(
    sub: Any,
    parents: list[argparse.ArgumentParser],
    formatter_class: type,
    help_text: str = "measure throughput and latency",
) -> None:
    """Add the ``bench`` subcommand to ``sub`` (argparse subparsers); ``help_text`` is its
    line in ``nbengine --help``."""
    from nbengine.bench.workloads import DEFAULT_SHAPE, SHAPES
    from nbengine.cli_args import positive_int

    bench = sub.add_parser(
        "bench",
        parents=parents,
        formatter_class=formatter_class,
        help=help_text,
        description="Run fixed workloads through nbengine and transformers, every run in a "
        "fresh process with the same environment, and compare them with this "
        "machine's memory-bandwidth bound (docs/benchmarks.md). Needs transformers: "
        'pip install transformers, or pip install "nbengine[bench]" for every peer.',
    )
    bench.add_argument(
        "--model",
        default=None,
        help="model directory or Hub id (default: random weights in SmolLM2-135M's shape)",
    )
    bench.add_argument(
        "--shape",
        default=None,
        choices=tuple(SHAPES),
        help="random weights in this real model's dimensions, bfloat16, written once to "
        f"the cache (default without --model: {DEFAULT_SHAPE})",
    )
    bench.add_argument(
        "--workloads",
        default="W1,W2,W3",
        help="comma-separated: W1,W2,W3,W4 (P1024: TTFT of one 1024-token prompt, on request)",
    )
    bench.add_argument(
        "--engines",
        default="nbengine,hf_static,hf_cb",
        help="comma-separated: nbengine,hf_static,hf_cb,ct2,llamacpp (ct2: "
        "CTranslate2, llamacpp: llama.cpp; both in the bench extra)",
    )
    bench.add_argument(
        "--peers",
        action="store_true",
        help="nbengine, the transformers engines, ct2 and llamacpp (those installed; "
        "the skipped ones are named), instead of --engines",
    )
    bench.add_argument(
        "--chart",
        metavar="PATH",
        help="also write the plotly bar chart of tokens/s per engine, with the bound, as "
        "HTML (PATH-W1.html ... for several workloads; in a notebook, "
        "nbengine.bench.run_peers shows it inline)",
    )
    bench.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="weights and compute type",
    )
    bench.add_argument(
        "--quantization",
        default=None,
        choices=("int8", "int4", "int4-g32"),
        help="nbengine's weights quantized (docs/quantization.md); the "
        "bandwidth bound counts the quantized bytes",
    )
    bench.add_argument("--scale", type=float, default=1.0, help="shrink workloads (e.g. 0.1)")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="same as --scale 0.1: a smoke run, still a fresh process per engine and "
        "workload (about 2.5 minutes on 2 cores)",
    )
    bench.add_argument(
        "--repeats", type=positive_int, default=1, help="runs of each engine on each workload"
    )
    bench.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads for every engine (default: physical cores)",
    )
    bench.add_argument(
        "--omp-wait-policy",
        default=None,
        choices=("PASSIVE", "ACTIVE"),
        help="OMP_WAIT_POLICY of every engine's process (default: each engine's faster one, "
        "ACTIVE for ct2, PASSIVE for the others)",
    )
    bench.add_argument("--no-abort", action="store_true", help="skip the abort() latency check")
    bench.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="N",
        help="also run W1 on nbengine with its requests over N LoRA adapters of rank 16",
    )
    bench.add_argument("--json", default=None, metavar="PATH", help="also write the report here")


def run_bench_cli(args: argparse.Namespace) -> int:
    """``nbengine bench``: run, print the table, optionally write the JSON report."""
    import json

    from nbengine.bench import BenchConfig, format_report, run_bench
    from nbengine.bench.config import peer_engines
    from nbengine.bench.workloads import DEFAULT_SHAPE
    from nbengine.cli_args import check_model_arg

    engines = bench_engines(args)
    skipped: dict[str, str] = {}
    if args.peers:
        engines, skipped = peer_engines()
        for e, why in skipped.items():
            print(f"--peers: skipping {e}: {why}", file=sys.stderr, flush=True)
    model = check_model_arg(args.model)
    if model is not None and args.shape is not None:
        raise SystemExit("nbengine bench: give --model or --shape, not both.")
    if model is not None and not Path(model).is_dir():  # a Hub id: the engines need files
        from nbengine.model import resolve_model_dir

        model = str(resolve_model_dir(model))
    config = BenchConfig(
        model_dir=model,
        shape=args.shape or DEFAULT_SHAPE,
        workloads=tuple(w.strip() for w in args.workloads.split(",") if w.strip()),
        engines=engines,
        dtype=args.dtype,
        quantization=args.quantization,
        scale=0.1 if args.quick else args.scale,
        repeats=args.repeats,
        abort_latency=not args.no_abort,
        threads=args.threads,
        omp_wait_policy=args.omp_wait_policy,
        lora_adapters=args.lora,
    )
    report = run_bench(config, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.peers:
        report["config"]["skipped_engines"] = skipped
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    if args.chart:
        _write_charts(report, args.chart)
    return 0


def bench_engines(args: argparse.Namespace) -> tuple[str, ...]:
    """``--engines`` as a tuple of names."""
    return tuple(e.strip() for e in args.engines.split(",") if e.strip())


def _write_charts(report: dict[str, object], path: str) -> None:
    """``--chart``: the bar chart of each workload as HTML (PATH, or PATH-W1.html ... for
    several workloads)."""
    from nbengine.bench import peers_figure

    results = report["results"]
    assert isinstance(results, dict)
    target = Path(path)
    for w in results:
        out = target if len(results) == 1 else target.with_name(f"{target.stem}-{w}{target.suffix}")
        peers_figure([report], w).write_html(out)
        print(f"chart of {w}: {out}", file=sys.stderr, flush=True)
