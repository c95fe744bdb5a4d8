"""The report: per-run figures, medians over repeats, targets, and the text table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from nbengine.bench.engines import RunResult

__all__ = ["TARGETS", "format_report", "median_run", "percentile", "summarise", "targets", "to_ms"]

TARGETS = {
    "W1 nbengine / hf_cb output tok/s": 3.0,
    "W1 nbengine / hf_static output tok/s": 1.5,
    "W2 nbengine fraction of the bandwidth bound": 0.6,
    "W3 prefix-cache hit rate": 0.7,
    "W3 TTFT p50 caching on / off (at most)": 0.5,
}


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def to_ms(x: float | None) -> float | None:
    """Seconds to milliseconds, None stays None."""
    return None if x is None else x * 1000.0


def summarise(r: RunResult) -> dict[str, Any]:
    """The figures of one run (or its error)."""
    if r.error is not None:
        return {"error": r.error}
    wall = max(r.wall_s, 1e-9)
    return {
        "wall_s": r.wall_s,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "output_tok_s": r.output_tokens / wall,
        "total_tok_s": (r.prompt_tokens + r.output_tokens) / wall,
        "ttft_p50_ms": to_ms(percentile(r.ttft_s, 50)),
        "ttft_p99_ms": to_ms(percentile(r.ttft_s, 99)),
        "itl_p50_ms": to_ms(percentile(r.itl_s, 50)),
        "itl_p99_ms": to_ms(percentile(r.itl_s, 99)),
        **r.extra,
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median output tok/s, plus every repeat's output tok/s."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    ok.sort(key=lambda r: r["output_tok_s"])
    best = dict(ok[len(ok) // 2])
    best["repeats"] = len(ok)
    best["output_tok_s_all"] = [r["output_tok_s"] for r in ok]
    return best


def targets(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each target of ``TARGETS``: its value in ``results``, and whether it is met."""
    def get(w: str, e: str, k: str) -> float | None:
        v = results.get(w, {}).get(e, {}).get(k)
        return float(v) if isinstance(v, (int, float)) else None

    out: dict[str, dict[str, Any]] = {}

    def ratio(name: str, a: float | None, b: float | None, at_most: bool = False) -> None:
        value = a / b if a is not None and b else None
        target = TARGETS[name]
        ok = None if value is None else (value <= target if at_most else value >= target)
        out[name] = {"value": value, "target": target, "pass": ok}

    nb = get("W1", "nbengine", "output_tok_s")
    ratio("W1 nbengine / hf_cb output tok/s", nb, get("W1", "hf_cb", "output_tok_s"))
    ratio("W1 nbengine / hf_static output tok/s", nb, get("W1", "hf_static", "output_tok_s"))
    ratio("W2 nbengine fraction of the bandwidth bound",
          get("W2", "nbengine", "decode_fraction_of_bound"), 1.0)
    ratio("W3 prefix-cache hit rate", get("W3", "nbengine", "prefix_cache_hit_rate"), 1.0)
    ratio("W3 TTFT p50 caching on / off (at most)", get("W3", "nbengine", "ttft_p50_ms"),
          get("W3", "nbengine_no_prefix_cache", "ttft_p50_ms"), at_most=True)
    return out


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if not isinstance(x, (int, float)) else fmt.format(x)


def format_report(report: dict[str, Any]) -> str:
    """The report as a plain-text table."""
    m = report["machine"]
    cfg = report["config"]
    lines = [
        f"nbengine bench: model {cfg['model_dir']} ({cfg['dtype']}), scale {cfg['scale']}, "
        f"repeats {cfg['repeats']}",
        f"machine: {m['cpu_count']} CPUs, flags {' '.join(m['cpu_flags'])}, torch {m['torch']} "
        f"({m['torch_threads']} threads), transformers {m['transformers']}",
        f"load average: start {m['load_average_start']}, end {m['load_average_end']}",
        f"memory bandwidth (copy) {m['bandwidth_gb_s']:.1f} GB/s; matmul "
        f"{m['matmul_gflop_s']:.0f} GFLOP/s ({cfg['dtype']}) (the better of the readings before "
        f"and after the runs), "
        f"{m['matmul_gflop_s_float32']:.0f} GFLOP/s (float32)",
        "",
        f"{'workload':<9}{'engine':<26}{'out tok/s':>10}{'tot tok/s':>10}{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'of bound':>9}",
    ]
    for w, per in report["results"].items():
        b = report["bounds"].get(w, {})
        lines.append(
            f"{w:<9}{'(bound)':<26}{_f(b.get('output_tok_s')):>10}{'':>10}{'':>10}{'':>10}"
            f"{_f(b.get('decode_step_ms'), '{:.2f}'):>9}{'':>9}{'100%':>9}"
        )
        for e, r in per.items():
            if "error" in r:
                lines.append(f"{'':<9}{e:<26}error: {r['error']}")
                continue
            frac = r.get("decode_fraction_of_bound", r.get("fraction_of_bound"))
            lines.append(
                f"{'':<9}{e:<26}{_f(r['output_tok_s']):>10}{_f(r['total_tok_s']):>10}"
                f"{_f(r['ttft_p50_ms']):>10}{_f(r['ttft_p99_ms']):>10}"
                f"{_f(r['itl_p50_ms'], '{:.2f}'):>9}{_f(r['itl_p99_ms'], '{:.2f}'):>9}"
                f"{_f(None if frac is None else 100 * frac, '{:.0f}%'):>9}"
            )
            if "prefix_cache_hit_rate" in r and w == "W3":
                lines.append(f"{'':<35}prefix-cache hit rate {100 * r['prefix_cache_hit_rate']:.0f}%")
    lines.append("(times in ms; 'of bound' = bound time / measured time; for W2 it is the bound "
                 "decode step / ITL p50)")
    a = report.get("abort") or {}
    if a:
        if "error" in a:
            lines.append(f"abort(): error: {a['error']}")
        else:
            lines.append(f"abort() call-to-return with {a['num_running']} running: "
                         f"p50 {_f(a['p50_ms'], '{:.2f}')} ms, p99 {_f(a['p99_ms'], '{:.2f}')} ms "
                         f"({a['num_aborts']} aborts)")
    for e, msg in report.get("engine_errors", {}).items():
        lines.append(f"{e} did not run: {msg}")
    lines.append("")
    lines.append("targets:")
    for name, t in report["targets"].items():
        verdict = {True: "PASS", False: "MISS", None: "n/a"}[t["pass"]]
        lines.append(f"  {name:<46} {_f(t['value'], '{:.2f}'):>7}  (target {t['target']})  "
                     f"{verdict}")
    lines.append(f"elapsed {report['elapsed_s']:.0f} s")
    return "\n".join(lines)
