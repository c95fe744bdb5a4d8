"""The report: per-run figures, medians over repeats, targets, and the text table."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from nbengine.bench.engines import RunResult

__all__ = [
    "TARGETS",
    "format_report",
    "load_figures",
    "median_run",
    "percentile",
    "spread_warnings",
    "summarise",
    "targets",
    "to_ms",
]

TARGETS = {
    "W1 nbengine / hf_cb output tok/s": 3.0,
    "W1 nbengine / hf_static output tok/s": 1.5,
    "W2 nbengine fraction of the bandwidth bound": 0.6,
    "W3 prefix-cache hit rate": 0.7,
    "W3 TTFT p50 caching on / off (at most)": 0.5,
    "W1 wall time over LoRA adapters / base (at most)": 1.3,
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
    """The run with the median output tok/s (the upper middle one for an even count), plus
    the spread of every repeat's.

    Adds ``output_tok_s_all`` (in run order), ``output_tok_s_min`` / ``_max``,
    ``output_tok_s_median`` (the mean of the middle two for an even count) and
    ``spread`` = (max - min) / median.
    """
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    rates = [r["output_tok_s"] for r in ok]
    chosen = dict(sorted(ok, key=lambda r: r["output_tok_s"])[len(ok) // 2])
    med = statistics.median(rates)
    chosen.update(
        {
            "repeats": len(ok),
            "output_tok_s_all": rates,
            "output_tok_s_min": min(rates),
            "output_tok_s_max": max(rates),
            "output_tok_s_median": med,
            "spread": (max(rates) - min(rates)) / med if med > 0 else 0.0,
        }
    )
    chosen.update(_probe_spread(ok))
    return chosen


def _probe_spread(runs: list[dict[str, Any]]) -> dict[str, float]:
    """How far the machine's own probe (taken before and after every repeat, in the same
    process) moved over ``runs``: ``probe_matmul_spread`` and ``probe_bandwidth_spread``,
    (max - min) / median of every reading. Empty when a run has no probe."""
    out: dict[str, float] = {}
    for key, name in (("matmul_gflop_s", "matmul"), ("bandwidth_gb_s", "bandwidth")):
        vals = [r[when][key] for r in runs for when in ("probe_before", "probe_after") if when in r]
        if vals:
            med = statistics.median(vals)
            out[f"probe_{name}_spread"] = (max(vals) - min(vals)) / med if med > 0 else 0.0
    return out


def spread_warnings(results: dict[str, dict[str, dict[str, Any]]], limit: float) -> list[str]:
    """One line per figure whose repeats disagree by more than ``limit`` (a fraction)."""
    out = []
    for w, per in results.items():
        for e, r in per.items():
            if r.get("spread", 0.0) > limit:
                out.append(
                    f"{w} {e}: repeats disagree by {100 * r['spread']:.0f}% "
                    f"({r['output_tok_s_min']:.1f}-{r['output_tok_s_max']:.1f} output tok/s, "
                    f"more than {100 * limit:.0f}%): the machine was not steady; do not "
                    f"publish this figure{_probe_note(r)}"
                )
    return out


def _probe_note(r: dict[str, Any]) -> str:
    """What the same processes' machine probes did while the figure spread."""
    if "probe_matmul_spread" not in r:
        return ""
    return (
        f" (the machine's own probe moved by {100 * r['probe_matmul_spread']:.0f}% in matmul "
        f"and {100 * r['probe_bandwidth_spread']:.0f}% in bandwidth over the same repeats)"
    )


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
    ratio(
        "W2 nbengine fraction of the bandwidth bound",
        get("W2", "nbengine", "decode_fraction_of_bound"),
        1.0,
    )
    ratio("W3 prefix-cache hit rate", get("W3", "nbengine", "prefix_cache_hit_rate"), 1.0)
    ratio(
        "W3 TTFT p50 caching on / off (at most)",
        get("W3", "nbengine", "ttft_p50_ms"),
        get("W3", "nbengine_no_prefix_cache", "ttft_p50_ms"),
        at_most=True,
    )
    lora = get("W1", "nbengine_lora", "wall_s")
    if lora is not None:  # `nbengine bench --lora N` (docs/lora.md)
        ratio(
            "W1 wall time over LoRA adapters / base (at most)",
            lora,
            get("W1", "nbengine", "wall_s"),
            at_most=True,
        )
    return out


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if not isinstance(x, (int, float)) else fmt.format(x)


def _load(x: Any) -> str:
    """Load averages as ``uptime`` prints them: ``1.23, 0.98, 0.50``."""
    if not isinstance(x, (list, tuple)) or not x:
        return "unknown"
    return ", ".join(f"{float(v):.2f}" for v in x)


def _of_bound(frac: float | None) -> str:
    """``58%``; over 100% is flagged ``!`` (the footnote of the table explains it)."""
    if frac is None:
        return "-"
    return f"{100 * frac:.0f}%" + ("!" if frac > 1.0 else "")


def _wait_policies(cfg: dict[str, Any]) -> str:
    """The wait policy when every engine had the same, else each one's, grouped by policy."""
    policies: dict[str, str] = cfg.get("omp_wait_policies") or {}
    if cfg.get("omp_wait_policy") or len(set(policies.values())) <= 1:
        return str(cfg.get("omp_wait_policy") or next(iter(policies.values()), "?"))
    by_policy: dict[str, list[str]] = {}
    for engine, policy in policies.items():
        by_policy.setdefault(policy, []).append(engine)
    return "; ".join(f"{p} for {', '.join(es)}" for p, es in by_policy.items())


def format_report(report: dict[str, Any]) -> str:
    """The report as a plain-text table."""
    m = report["machine"]
    cfg = report["config"]
    lines = [
        f"nbengine bench: model {cfg['model_dir']} ({cfg['dtype']}"
        + (f"; nbengine weights {cfg['quantization']}" if cfg.get("quantization") else "")
        + f"), scale {cfg['scale']}, "
        f"repeats {cfg['repeats']}",
        f"machine: {m.get('cpu_model', '?')}, {m['cpu_count']} CPUs, "
        + (f"L3 {m['last_level_cache_mib']} MiB, " if m.get("last_level_cache_mib") else "")
        + f"flags {' '.join(m['cpu_flags'])}, torch {m['torch']} "
        f"({m['torch_threads']} threads), transformers {m['transformers']}",
        f"every run in a fresh process: {m.get('engine_process', {}).get('torch_threads', '?')} "
        f"torch threads, OMP_WAIT_POLICY {_wait_policies(cfg)}, a warm-up first",
        f"load average (1, 5, 15 min): {_load(m['load_average_start'])} at the start, "
        f"{_load(m['load_average_end'])} at the end",
        f"memory bandwidth (copy) {m['bandwidth_gb_s']:.1f} GB/s"
        + (f", (read) {m['read_bandwidth_gb_s']:.1f} GB/s" if m.get("read_bandwidth_gb_s") else "")
        + "; matmul "
        f"{m['matmul_gflop_s']:.0f} GFLOP/s ({cfg['dtype']}) (the better of the readings before "
        f"and after the runs), "
        f"{m['matmul_gflop_s_float32']:.0f} GFLOP/s (float32)",
        "",
        f"{'workload':<9}{'engine':<26}{'out tok/s':>10}{'min-max':>14}{'tot tok/s':>10}"
        f"{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'of bound':>9}",
    ]
    for w, per in report["results"].items():
        b = report["bounds"].get(w, {})
        lines.append(
            f"{w:<9}{'(bound)':<26}{_f(b.get('output_tok_s')):>10}{'':>14}{'':>10}{'':>10}"
            f"{'':>10}"
            f"{_f(b.get('decode_step_ms'), '{:.2f}'):>9}{'':>9}{'100%':>9}"
        )
        for e, r in per.items():
            if "error" in r:
                lines.append(f"{'':<9}{e:<26}error: {r['error']}")
                continue
            frac = r.get("decode_fraction_of_bound", r.get("fraction_of_bound"))
            lines.append(
                f"{'':<9}{e:<26}{_f(r['output_tok_s']):>10}{_range(r):>14}"
                f"{_f(r['total_tok_s']):>10}"
                f"{_f(r['ttft_p50_ms']):>10}{_f(r['ttft_p99_ms']):>10}"
                f"{_f(r['itl_p50_ms'], '{:.2f}'):>9}{_f(r['itl_p99_ms'], '{:.2f}'):>9}"
                f"{_of_bound(frac):>9}"
            )
            if "gguf_type" in r:  # llama.cpp: which weights, and what was turned off
                off = "off" if not r.get("use_extra_bufts") else "on"
                lines.append(
                    f"{'':<35}{r['gguf_type']} GGUF, extra buffer types {off}, "
                    f"{r.get('n_seq_max')} sequences x {r.get('n_batch')} batch tokens"
                )
            if "prefix_cache_hit_rate" in r and w == "W3":
                lines.append(
                    f"{'':<35}prefix-cache hit rate {100 * r['prefix_cache_hit_rate']:.0f}%"
                )
    lines.append(
        "(out tok/s: the median repeat; min-max over the repeats; times in ms; 'of bound' "
        "= bound time / measured time, so 100% is the fastest this machine's measured "
        "bandwidth and FLOP/s allow; for W2 it is the bound decode step / ITL p50)"
    )
    if any(
        _of_bound(r.get("decode_fraction_of_bound", r.get("fraction_of_bound"))).endswith("!")
        for per in report["results"].values()
        for r in per.values()
        if "error" not in r
    ):
        lines.append(
            "(! over 100%: faster than the bound, so the bound is too low here: its "
            "bandwidth or FLOP/s reading was taken while the machine was busy, or the "
            "workload fits in caches (--quick); compare the engines with each other)"
        )
    lines.extend(_load_lines(report["results"]))
    a = report.get("abort") or {}
    if a:
        if "error" in a:
            lines.append(f"abort(): error: {a['error']}")
        else:
            lines.append(
                f"abort() call-to-return with {a['num_running']} running: "
                f"p50 {_f(a['p50_ms'], '{:.2f}')} ms, p99 {_f(a['p99_ms'], '{:.2f}')} ms "
                f"({a['num_aborts']} aborts)"
            )
    for e, msg in report.get("engine_errors", {}).items():
        lines.append(f"{e} did not run: {msg}")
    for e, why in cfg.get("skipped_engines", {}).items():
        lines.append(f"{e} skipped (--peers): {why}")
    lines.append("")
    lines.append("targets:")
    for name, t in report["targets"].items():
        verdict = {True: "PASS", False: "MISS", None: "n/a"}[t["pass"]]
        lines.append(
            f"  {name:<46} {_f(t['value'], '{:.2f}'):>7}  (target {t['target']})  {verdict}"
        )
    warnings = report.get("warnings") or []
    if warnings:
        lines.append("")
        lines.append("WARNINGS:")
        lines.extend(f"  {w}" for w in warnings)
    lines.append(f"elapsed {report['elapsed_s']:.0f} s")
    return "\n".join(lines)


def load_figures(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each engine's load: process start -> ready and -> first token (seconds), resident
    memory at ready and its peak during the load, resident after the run (bytes), from
    its first workload's median run; for nbengine also the weights + KV cache its memory
    plan counts, and the ratios resident / (weights + KV) and peak / resident."""
    out: dict[str, dict[str, Any]] = {}
    for per in results.values():
        for e, r in per.items():
            if e in out or "error" in r or "start_to_ready_s" not in r:
                continue
            fig: dict[str, Any] = {
                k: r.get(k)
                for k in (
                    "start_to_ready_s",
                    "start_to_first_token_s",
                    "rss_ready_bytes",
                    "peak_rss_load_bytes",
                    "weights_bytes",
                    "kv_cache_bytes",
                )
            }
            fig["rss_after_run_bytes"] = (r.get("memory_after_run") or {}).get("rss_bytes")
            rss, peak = fig["rss_ready_bytes"], fig["peak_rss_load_bytes"]
            planned = (fig["weights_bytes"] or 0) + (fig["kv_cache_bytes"] or 0)
            if rss and planned:
                fig["resident_over_planned"] = rss / planned
            if rss and peak:
                fig["peak_over_resident"] = peak / rss
            out[e] = fig
    return out


def _load_lines(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    figs = load_figures(results)
    if not figs:
        return []
    gib = float(1 << 30)

    def g(x: Any) -> str:
        return "-" if not isinstance(x, (int, float)) else f"{x / gib:.2f}"

    lines = [
        "",
        f"{'load':<26}{'start->ready s':>15}{'->1st token s':>14}{'RSS ready':>10}"
        f"{'peak load':>10}{'RSS after':>10}{'weights+KV':>11}{'RSS/plan':>9}{'peak/RSS':>9}",
    ]
    for e, f in figs.items():
        planned = (f["weights_bytes"] or 0) + (f["kv_cache_bytes"] or 0)
        lines.append(
            f"{e:<26}{_f(f['start_to_ready_s'], '{:.2f}'):>15}"
            f"{_f(f['start_to_first_token_s'], '{:.2f}'):>14}{g(f['rss_ready_bytes']):>10}"
            f"{g(f['peak_rss_load_bytes']):>10}{g(f['rss_after_run_bytes']):>10}"
            f"{g(planned or None):>11}{_f(f.get('resident_over_planned'), '{:.2f}'):>9}"
            f"{_f(f.get('peak_over_resident'), '{:.2f}'):>9}"
        )
    lines.append(
        "(memory in GiB, of the engine's process, after its first load: RSS ready = "
        "VmRSS then, peak load = VmHWM then; weights+KV: nbengine's memory plan)"
    )
    return lines


def _range(r: dict[str, Any]) -> str:
    """``min-max`` of the repeats' output tok/s."""
    lo, hi = r.get("output_tok_s_min"), r.get("output_tok_s_max")
    if not isinstance(lo, (int, float)) or not isinstance(hi, (int, float)):
        return "-"
    return f"{lo:.1f}-{hi:.1f}"
