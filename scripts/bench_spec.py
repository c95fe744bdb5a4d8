"""A/B of n-gram speculative decoding: tokens/s with and without it, interleaved in one process.

For each model (the shipped default model, the bench model) and workload (W4: the
output repeats its prompt; W2: one stream, nothing planned to look up), the same
``NbengineDriver`` runs the workload without and with ``speculative_config``, A and B
alternating (the order flips every repeat), so the machine's load hits both alike.
W4's passage is each model's own greedy text (made once before timing, cached:
``engine_continuation``). Prints one line per run and the median ratio per (model,
workload, k), and the share of drafted tokens accepted (docs/speculative-decoding.md,
docs/benchmarks.md).

    python scripts/bench_spec.py [--repeats 5] [--k 4 | --k 3,4,5,6,7,8] [--models default,bench]
        [--draft DIR]   # method "draft_model" with the model in DIR instead of n-gram
        [--json PATH]   # also write every run and the summaries as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from nbengine.bench.engines import NbengineDriver
from nbengine.bench.workloads import bench_model_dir, engine_continuation, make_workloads
from nbengine.model.loader import resolve_model_dir


def _model(name: str) -> tuple[Path, int]:
    if name == "bench":
        return bench_model_dir(), 49152
    path = resolve_model_dir(None, None)
    vocab = 6144  # the shipped default model's tokenizer (nbengine/default_model)
    return path, vocab


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--k", default="4", help="num_speculative_tokens (comma-separated: each)")
    p.add_argument("--models", default="default,bench")
    p.add_argument("--workloads", default="W4,W2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--draft", default=None, help="draft model directory (draft_model)")
    p.add_argument("--json", default=None, help="write the runs and summaries here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    record: dict[str, Any] = {"argv": sys.argv[1:], "started": _now(), "commit": _commit()}
    record["load_before"] = os.getloadavg()
    results: list[dict[str, Any]] = []
    for model in args.models.split(","):
        path, vocab = _model(model)
        wls = make_workloads(args.workloads.split(","), vocab, continuation=_cont(path))
        driver = NbengineDriver(path, "bfloat16", {"num_kv_blocks": 256})
        for name, wl in wls.items():
            driver.run(wl)  # warm-up (page cache, kernels)
            for k in (int(x) for x in args.k.split(",")):
                results.append(_ab(driver, model, name, wl, _spec(args.draft, k), args.repeats))
    if args.json:
        record.update(results=results, finished=_now(), load_after=os.getloadavg())
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        return out.stdout.strip()
    except OSError:
        return "unknown"


def _cont(path: Path) -> Any:
    return engine_continuation(path, "bfloat16")


def _spec(draft: str | None, k: int) -> dict[str, Any]:
    if draft:
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    return {"method": "ngram", "num_speculative_tokens": k}


def _ab(
    driver: NbengineDriver, model: str, name: str, wl: Any, spec: dict[str, Any], repeats: int
) -> dict[str, Any]:
    """``repeats`` off/on pairs, order flipping each repeat; prints runs and the medians,
    and returns them."""
    k = spec["num_speculative_tokens"]
    rates: dict[str, list[float]] = {"off": [], "on": []}
    drafted = accepted = 0
    steps: dict[str, list[int]] = {"off": [], "on": []}
    for rep in range(repeats):
        order = ("off", "on") if rep % 2 == 0 else ("on", "off")
        for label in order:
            kw = {"speculative_config": spec} if label == "on" else {}
            res = driver.run(wl, **kw)
            rate = res.output_tokens / res.wall_s
            rates[label].append(rate)
            drafted += res.extra["spec_draft_tokens"]
            accepted += res.extra["spec_accepted_tokens"]
            steps[label].append(res.extra["num_steps"])
            print(
                f"{model} {name} k={k} {label:3s} {rate:8.1f} tok/s "
                f"({res.output_tokens} tokens, {res.extra['num_steps']} steps)",
                flush=True,
            )
    ratios = [b / a for a, b in zip(rates["off"], rates["on"])]
    print(
        f"== {model} {name} k={k}: off {statistics.median(rates['off']):.1f} tok/s, "
        f"on {statistics.median(rates['on']):.1f} tok/s, "
        f"ratio median {statistics.median(ratios):.2f}x "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}); "
        f"accepted {accepted}/{drafted} drafted ({accepted / max(drafted, 1):.0%})",
        flush=True,
    )
    return {
        "model": model,
        "workload": name,
        "k": k,
        "tok_s": rates,
        "steps": steps,
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "drafted": drafted,
        "accepted": accepted,
    }


if __name__ == "__main__":
    main()
