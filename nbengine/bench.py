"""``nbengine bench``: nbengine against transformers on fixed workloads, and the physical bound.

``run_bench()`` builds (or reuses) a model directory, generates deterministic workloads,
runs every engine on every workload in one process, interleaved (for each workload the
engines run back to back, their order rotating between repeats, so machine drift hits
all of them alike), measures the machine (memory bandwidth, matmul FLOP/s) and returns
one JSON-able dict; ``format_report()`` renders it as a table.

Workloads (``scale`` shrinks counts and lengths; all greedy, ``ignore_eos``):

- W1: 64 requests, prompt lengths uniform in 16..256, output lengths uniform in 16..128;
- W2: one request decoding 256 tokens (a 32-token prompt);
- W3: 64 requests sharing a 192-token prefix (+ 16 own tokens), 32 output tokens each;
  nbengine runs it with prefix caching on and off.

Plus: ``engine.abort()`` call-to-return latency while 32 requests are decoding.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from nbengine.bench_engines import (
    HFContinuousDriver,
    HFStaticDriver,
    NbengineDriver,
    RunResult,
    Workload,
)
from nbengine.bench_machine import (
    ModelShape,
    physical_cores,
    cpu_flags,
    load_average,
    measure_bandwidth,
    measure_matmul_flops,
    workload_bound,
)

__all__ = ["SMOLLM2_135M", "run_bench", "format_report", "make_workloads", "bench_model_dir"]

# SmolLM2-135M's shape (Llama architecture), random weights.
SMOLLM2_135M: dict[str, Any] = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
}
ALL_WORKLOADS = ("W1", "W2", "W3")
ALL_ENGINES = ("nbengine", "hf_static", "hf_cb")
TARGETS = {
    "W1 nbengine / hf_cb output tok/s": 3.0,
    "W1 nbengine / hf_static output tok/s": 1.5,
    "W2 nbengine fraction of the bandwidth bound": 0.6,
    "W3 prefix-cache hit rate": 0.7,
    "W3 TTFT p50 caching on / off (at most)": 0.5,
}


def bench_model_dir(cache_dir: str | Path | None = None, **config: Any) -> Path:
    """A random-initialised model of SmolLM2-135M's shape (or ``config``), cached on disk."""
    from nbengine.testing import make_tiny_model

    cfg = {**SMOLLM2_135M, **config}
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir is not None else Path(
        os.environ.get("NBENGINE_CACHE", Path.home() / ".cache" / "nbengine")
    ) / "bench"
    path = root / f"llama-random-{key}"
    if not (path / ".complete").is_file():
        make_tiny_model(path, arch="llama", seed=0, weight_std=0.02, **cfg)
        (path / ".complete").write_text("ok\n")
    return path


def _scaled(n: int, scale: float, lo: int) -> int:
    return max(lo, round(n * scale))


def make_workloads(names: Sequence[str], vocab: int, scale: float = 1.0, seed: int = 0
                   ) -> dict[str, Workload]:
    """Deterministic workloads: the same ``(names, vocab, scale, seed)`` give the same token ids."""
    out: dict[str, Workload] = {}
    hi_id = vocab - 1
    for name in names:
        rng = random.Random(f"{seed}-{name}")

        def ids(n: int, rng: random.Random = rng) -> list[int]:
            return [rng.randint(3, hi_id) for _ in range(n)]

        if name == "W1":
            n = _scaled(64, scale, 2)
            p_lo, p_hi = _scaled(16, scale, 2), _scaled(256, scale, 4)
            o_lo, o_hi = _scaled(16, scale, 2), _scaled(128, scale, 4)
            prompts = [ids(rng.randint(p_lo, p_hi)) for _ in range(n)]
            outs = [rng.randint(o_lo, o_hi) for _ in range(n)]
            out[name] = Workload(name, prompts, outs)
        elif name == "W2":
            out[name] = Workload(name, [ids(_scaled(32, scale, 4))], [_scaled(256, scale, 8)])
        elif name == "W3":
            n = _scaled(64, scale, 2)
            prefix = ids(_scaled(192, scale, 32))
            prompts = [prefix + ids(16) for _ in range(n)]
            out[name] = Workload(name, prompts, [_scaled(32, scale, 4)] * n, len(prefix))
        else:
            raise ValueError(f"Unknown workload {name!r}; choose from {ALL_WORKLOADS}.")
    return out


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


def _summarise(r: RunResult) -> dict[str, Any]:
    if r.error is not None:
        return {"error": r.error}
    wall = max(r.wall_s, 1e-9)
    return {
        "wall_s": r.wall_s,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "output_tok_s": r.output_tokens / wall,
        "total_tok_s": (r.prompt_tokens + r.output_tokens) / wall,
        "ttft_p50_ms": _ms(_pct(r.ttft_s, 50)),
        "ttft_p99_ms": _ms(_pct(r.ttft_s, 99)),
        "itl_p50_ms": _ms(_pct(r.itl_s, 50)),
        "itl_p99_ms": _ms(_pct(r.itl_s, 99)),
        **r.extra,
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    ok.sort(key=lambda r: r["output_tok_s"])
    best = dict(ok[len(ok) // 2])
    best["repeats"] = len(ok)
    best["output_tok_s_all"] = [r["output_tok_s"] for r in ok]
    return best


def _safe(fn: Any, engine: str, wl: str) -> RunResult:
    try:
        return fn()
    except Exception as exc:  # an engine that cannot run is reported, not fatal
        return RunResult(engine, wl, error=f"{type(exc).__name__}: {exc}")


def run_bench(
    model_dir: str | Path | None = None,
    workloads: Sequence[str] = ALL_WORKLOADS,
    engines: Sequence[str] = ALL_ENGINES,
    dtype: str = "bfloat16",
    scale: float = 1.0,
    repeats: int = 1,
    seed: int = 0,
    abort_latency: bool = True,
    static_batch_size: int = 16,
    engine_kwargs: dict[str, Any] | None = None,
    cache_dir: str | Path | None = None,
    threads: int | None = None,
    log: Any = None,
) -> dict[str, Any]:
    """Run the benchmark and return the report (see the module docstring).

    ``model_dir`` None builds the SmolLM2-135M-shaped random model into ``cache_dir``.
    ``engine_kwargs`` are extra ``nb.Engine`` arguments. ``threads`` sets
    ``torch.set_num_threads`` for the run (every engine alike; None: the physical cores),
    restored afterwards. ``log`` (a callable taking a str) receives progress lines.
    """
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads or physical_cores())
    try:
        return _run_bench(model_dir, workloads, engines, dtype, scale, repeats, seed,
                          abort_latency, static_batch_size, engine_kwargs, cache_dir, log)
    finally:
        torch.set_num_threads(old_threads)


def _run_bench(
    model_dir: str | Path | None,
    workloads: Sequence[str],
    engines: Sequence[str],
    dtype: str,
    scale: float,
    repeats: int,
    seed: int,
    abort_latency: bool,
    static_batch_size: int,
    engine_kwargs: dict[str, Any] | None,
    cache_dir: str | Path | None,
    log: Any,
) -> dict[str, Any]:
    say = log or (lambda _msg: None)
    for w in workloads:
        if w not in ALL_WORKLOADS:
            raise ValueError(f"Unknown workload {w!r}; choose from {ALL_WORKLOADS}.")
    for e in engines:
        if e not in ALL_ENGINES:
            raise ValueError(f"Unknown engine {e!r}; choose from {ALL_ENGINES}.")
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}.")
    t_start = time.time()
    path = Path(model_dir) if model_dir is not None else bench_model_dir(cache_dir)
    hf_cfg = json.loads((path / "config.json").read_text())
    tdtype = getattr(torch, dtype)
    shape = ModelShape.from_config(hf_cfg, torch.empty((), dtype=tdtype).element_size())
    wls = make_workloads(workloads, shape.vocab, scale, seed)

    say(f"machine: load {load_average()}, measuring bandwidth and matmul FLOP/s ...")
    bw = measure_bandwidth(512 if scale >= 0.5 else 128)
    flops = measure_matmul_flops(tdtype, 1536 if scale >= 0.5 else 512)
    flops_f32 = measure_matmul_flops(torch.float32, 1536 if scale >= 0.5 else 512)
    import transformers

    machine = {
        "load_average_start": load_average(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "bandwidth_gb_s": bw / 1e9,
        "matmul_gflop_s": flops / 1e9,
        "matmul_gflop_s_float32": flops_f32 / 1e9,
    }

    drivers: dict[str, Any] = {}
    errors: dict[str, str] = {}
    ekw = {"max_num_seqs": 64, "max_num_batched_tokens": 512, **(engine_kwargs or {})}
    max_len = max(len(p) + o for w in wls.values() for p, o in zip(w.prompts, w.output_lens))
    ekw.setdefault("max_model_len", min(int(hf_cfg.get("max_position_embeddings", 2048)),
                                        max(max_len, 64)))
    warm = Workload("warmup", [[5, 6, 7, 8]] * 2, [4, 4])
    for name in engines:
        say(f"loading {name} ...")
        try:
            if name == "nbengine":
                d: Any = NbengineDriver(path, dtype, ekw)
            elif name == "hf_static":
                d = HFStaticDriver(path, dtype, static_batch_size)
            else:
                d = HFContinuousDriver(path, dtype, ekw["max_num_batched_tokens"],
                                       ekw["max_num_seqs"])
            r = d.run(warm)
            if r.error:
                raise RuntimeError(r.error)
            drivers[name] = d
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            say(f"  {name} cannot run here: {errors[name]}")

    raw: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in workloads}
    order = [e for e in engines if e in drivers]
    for rep in range(repeats):
        for w in workloads:
            wl = wls[w]
            rot = order[rep % len(order):] + order[: rep % len(order)] if order else []
            for name in rot:
                runs: list[tuple[str, Any]] = [(name, lambda d=drivers[name]: d.run(wl))]
                if name == "nbengine" and w == "W3":
                    runs.append(("nbengine_no_prefix_cache",
                                 lambda d=drivers[name]: d.run(wl, enable_prefix_caching=False)))
                for label, fn in runs:
                    say(f"[{rep + 1}/{repeats}] {w} {label} ...")
                    res = _summarise(_safe(fn, label, w))
                    raw[w].setdefault(label, []).append(res)
                    if "error" in res:
                        say(f"  error: {res['error']}")
                    else:
                        say(f"  {res['output_tok_s']:.1f} output tok/s, wall {res['wall_s']:.1f} s")

    results = {w: {e: _median_run(rs) for e, rs in per.items()} for w, per in raw.items()}

    # The bound is the hardware's capacity: measured again after the runs, the better of
    # the two readings counts (a neighbour's burst during one reading would otherwise
    # lower the bound and flatter every engine).
    say("measuring bandwidth and matmul FLOP/s again ...")
    bw_end = measure_bandwidth(512 if scale >= 0.5 else 128)
    flops_end = measure_matmul_flops(tdtype, 1536 if scale >= 0.5 else 512)
    machine.update({"bandwidth_gb_s_start": bw / 1e9, "bandwidth_gb_s_end": bw_end / 1e9,
                    "matmul_gflop_s_start": flops / 1e9, "matmul_gflop_s_end": flops_end / 1e9})
    bw, flops = max(bw, bw_end), max(flops, flops_end)
    machine.update({"bandwidth_gb_s": bw / 1e9, "matmul_gflop_s": flops / 1e9})

    bounds: dict[str, Any] = {}
    for w, wl in wls.items():
        plens = [len(p) for p in wl.prompts]
        cached = None
        if wl.shared_prefix:
            bs = ekw.get("block_size", 16)
            hit = (wl.shared_prefix // bs) * bs
            cached = [0] + [hit] * (len(plens) - 1)
        b = workload_bound(shape, plens, wl.output_lens, bw, flops, cached,
                           ekw["max_num_batched_tokens"])
        entry: dict[str, Any] = {
            "seconds": b.seconds,
            "prefill_seconds": b.prefill_seconds,
            "decode_seconds": b.decode_seconds,
            "decode_steps": b.decode_steps,
            "bandwidth_bound_decode_steps": b.bytes_bound_steps,
            "output_tok_s": wl.num_output_tokens / b.seconds,
        }
        if w == "W2":
            entry["decode_step_ms"] = b.decode_step_seconds_first * 1000
        bounds[w] = entry
        for e, r in results[w].items():
            if "error" in r:
                continue
            r["fraction_of_bound"] = b.seconds / r["wall_s"]
            if w == "W2" and r.get("itl_p50_ms"):
                r["decode_fraction_of_bound"] = entry["decode_step_ms"] / r["itl_p50_ms"]

    abort: dict[str, Any] = {}
    if abort_latency and "nbengine" in drivers and "W1" in wls:
        n_run = _scaled(32, scale, 2)
        say(f"abort latency with {n_run} running ...")
        try:
            lat = drivers["nbengine"].abort_latency(wls["W1"].prompts, n_run, max(1, n_run // 2))
            abort = {"num_running": n_run, "num_aborts": len(lat),
                     "p50_ms": _ms(_pct(lat, 50)), "p99_ms": _ms(_pct(lat, 99))}
        except Exception as exc:
            abort = {"error": f"{type(exc).__name__}: {exc}"}

    machine["load_average_end"] = load_average()
    report = {
        "config": {
            "model_dir": str(path), "dtype": dtype, "scale": scale, "repeats": repeats,
            "seed": seed, "workloads": list(workloads), "engines": list(engines),
            "engine_kwargs": ekw, "static_batch_size": static_batch_size,
            "model": {k: hf_cfg.get(k) for k in ("hidden_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "intermediate_size",
                      "vocab_size", "tie_word_embeddings")},
            "workload_sizes": {w: {"requests": len(wl.prompts),
                                   "prompt_tokens": wl.num_prompt_tokens,
                                   "output_tokens": wl.num_output_tokens}
                               for w, wl in wls.items()},
        },
        "machine": machine,
        "results": results,
        "bounds": bounds,
        "abort": abort,
        "engine_errors": errors,
        "targets": _targets(results),
        "elapsed_s": time.time() - t_start,
    }
    return report


def _targets(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
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


def format_report(report: dict[str, Any]) -> str:
    """The report as a plain-text table."""
    m = report["machine"]
    cfg = report["config"]
    lines = [
        f"nbengine bench: model {cfg['model_dir']} ({cfg['dtype']}), scale {cfg['scale']}, "
        f"repeats {cfg['repeats']}",
        f"machine: {m['cpu_count']} CPUs, flags {' '.join(m['cpu_flags'])}, torch {m['torch']} "
        f"({m['torch_threads']} threads), transformers {m['transformers']}",
        f"load average (1, 5, 15 min): {_load(m['load_average_start'])} at the start, "
        f"{_load(m['load_average_end'])} at the end",
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
                f"{_of_bound(frac):>9}"
            )
            if "prefix_cache_hit_rate" in r and w == "W3":
                lines.append(f"{'':<35}prefix-cache hit rate {100 * r['prefix_cache_hit_rate']:.0f}%")
    lines.append("(times in ms; 'of bound' = bound time / measured time, so 100% is the fastest "
                 "this machine's measured bandwidth and FLOP/s allow; for W2 it is the bound "
                 "decode step / ITL p50)")
    if any(_of_bound(r.get("decode_fraction_of_bound", r.get("fraction_of_bound"))).endswith("!")
           for per in report["results"].values() for r in per.values() if "error" not in r):
        lines.append("(! over 100%: faster than the bound, so the bound is too low here: its "
                     "bandwidth or FLOP/s reading was taken while the machine was busy, or the "
                     "workload fits in caches (--quick); compare the engines with each other)")
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
