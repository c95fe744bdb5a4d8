"""``run_bench``: every engine on every workload, the machine, the bound, one report.

Every measurement (one repeat of one engine on one workload) runs in a fresh process
with the same environment (``isolation``) but for each engine's OpenMP wait policy
(``BenchConfig.wait_policy``), after a warm-up in that process. For each
workload the engines run back to back, their order rotating between repeats, so drift
of a shared machine affects all of them alike; the report gives each figure's median,
its min-max over the repeats, and a warning where they disagree by more than
``BenchConfig.max_spread`` (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nbengine.bench.config import BenchConfig
from nbengine.bench.isolation import WAIT_POLICY_VARIABLES, engine_environment, run_isolated
from nbengine.bench.machine import (
    ModelShape,
    cpu_flags,
    cpu_model,
    last_level_cache_mib,
    load_average,
    measure_bandwidth,
    measure_matmul_flops,
    measure_read_bandwidth,
    physical_cores,
    workload_bound,
)
from nbengine.bench.report import load_figures, median_run, spread_warnings, targets
from nbengine.bench.worker import Job
from nbengine.bench.workloads import (
    bench_model_dir,
    engine_continuation,
    make_workloads,
    scaled,
)

__all__ = ["run_bench"]

Log = Callable[[str], None]


def run_bench(
    config: BenchConfig | None = None, log: Log | None = None, **overrides: Any
) -> dict[str, Any]:
    """Run the benchmark and return the report (a JSON-able dict; see ``format_report``).

    ``overrides`` replace fields of ``config`` (default ``BenchConfig()``), so
    ``run_bench(model_dir=d, scale=0.1)`` works. Every engine process runs
    ``config.threads`` torch threads (None: the physical cores), and so does this process
    while it measures the machine (restored afterwards). ``log`` receives progress lines.
    """
    cfg = dataclasses.replace(config or BenchConfig(), **overrides)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads or physical_cores())
    try:
        return _Run(cfg, log or (lambda _msg: None)).report()
    finally:
        torch.set_num_threads(old_threads)


class _Run:
    """One bench run: prepares the model and workloads, then ``report()`` does the rest."""

    def __init__(self, cfg: BenchConfig, say: Log) -> None:
        self.cfg = cfg
        self.say = say
        self.t_start = time.time()
        self.path = (
            Path(cfg.model_dir)
            if cfg.model_dir is not None
            else bench_model_dir(cfg.cache_dir, cfg.shape)
        )
        self.hf_cfg: dict[str, Any] = json.loads((self.path / "config.json").read_text())
        self.tdtype: torch.dtype = getattr(torch, cfg.dtype)
        self.shape = ModelShape.from_config(
            self.hf_cfg, torch.empty((), dtype=self.tdtype).element_size()
        )
        if cfg.quantization is not None:
            from nbengine.ops.quant import bytes_per_weight

            self.shape.weight_elem_bytes = bytes_per_weight(cfg.quantization)
        # W4's passage: the model's own greedy text, made here once (cached) before timing.
        qkw = {"quantization": cfg.quantization} if cfg.quantization is not None else {}
        self.wls = make_workloads(
            cfg.workloads,
            self.shape.vocab,
            cfg.scale,
            cfg.seed,
            engine_continuation(self.path, cfg.dtype, qkw),
        )
        ekw = {"max_num_seqs": 64, "max_num_batched_tokens": 512, **cfg.engine_kwargs}
        if cfg.quantization is not None:
            ekw["quantization"] = cfg.quantization
        max_len = max(
            len(p) + o for w in self.wls.values() for p, o in zip(w.prompts, w.output_lens)
        )
        ekw.setdefault(
            "max_model_len",
            min(int(self.hf_cfg.get("max_position_embeddings", 2048)), max(max_len, 64)),
        )
        self.ekw: dict[str, Any] = ekw
        self.threads = cfg.threads or physical_cores()
        self.envs = {
            e: engine_environment(self.threads, cfg.wait_policy(e))
            for e in {*cfg.engines, "nbengine"}  # nbengine: the abort check
        }
        self.errors: dict[str, str] = {}  # engine -> its first error; it runs no more jobs
        # Each worker's engine, threads and environment.
        self.processes: list[dict[str, Any]] = []

    def report(self) -> dict[str, Any]:
        """Measure the machine, run the engines, measure again, and assemble the report."""
        machine = self._measure_machine()
        results = self._run_engines()
        self._remeasure_machine(machine)
        bounds = self._bounds(results, machine)
        abort = self._abort_latency()
        machine["load_average_end"] = load_average()
        warnings = spread_warnings(results, self.cfg.max_spread)
        machine["engine_process"], differ = self._common_process_state()
        machine["engine_wait_policy"] = self._wait_policies_seen()
        if differ:
            warnings.append(f"engine processes ran under different settings: {differ}")
        cfg = self.cfg
        return {
            "config": {
                "model_dir": str(self.path),
                "shape": cfg.shape if cfg.model_dir is None else None,
                "dtype": cfg.dtype,
                "quantization": cfg.quantization,
                "scale": cfg.scale,
                "repeats": cfg.repeats,
                "seed": cfg.seed,
                "workloads": list(cfg.workloads),
                "engines": list(cfg.engines),
                "engine_kwargs": self.ekw,
                "static_batch_size": cfg.static_batch_size,
                "threads": self.threads,
                "omp_wait_policy": cfg.omp_wait_policy,
                "omp_wait_policies": {e: cfg.wait_policy(e) for e in cfg.engines},
                "max_spread": cfg.max_spread,
                "model": {
                    k: self.hf_cfg.get(k)
                    for k in (
                        "hidden_size",
                        "num_hidden_layers",
                        "num_attention_heads",
                        "num_key_value_heads",
                        "intermediate_size",
                        "vocab_size",
                        "tie_word_embeddings",
                    )
                },
                "workload_sizes": {
                    w: {
                        "requests": len(wl.prompts),
                        "prompt_tokens": wl.num_prompt_tokens,
                        "output_tokens": wl.num_output_tokens,
                    }
                    for w, wl in self.wls.items()
                },
            },
            "machine": machine,
            "results": results,
            "load": load_figures(results),
            "bounds": bounds,
            "abort": abort,
            "engine_errors": self.errors,
            "targets": targets(results),
            "warnings": warnings,
            "elapsed_s": time.time() - self.t_start,
        }

    def _measure_machine(self) -> dict[str, Any]:
        import transformers

        large = self.cfg.measure_large
        mib = 512 if large else 128
        self.say(f"machine: load {load_average()}, measuring bandwidth and matmul FLOP/s ...")
        bw = measure_bandwidth(mib)
        read = measure_read_bandwidth(mib)
        flops = measure_matmul_flops(self.tdtype, 1536 if large else 512)
        flops_f32 = measure_matmul_flops(torch.float32, 1536 if large else 512)
        return {
            "load_average_start": load_average(),
            "cpu_count": os.cpu_count(),
            "cpu_flags": cpu_flags(),
            "processor": platform.processor() or platform.machine(),
            "cpu_model": cpu_model(),
            "last_level_cache_mib": last_level_cache_mib(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": self.threads,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),  # this process's
            "bandwidth_gb_s": bw / 1e9,
            "read_bandwidth_gb_s": read / 1e9,
            "matmul_gflop_s": flops / 1e9,
            "matmul_gflop_s_float32": flops_f32 / 1e9,
        }

    def _remeasure_machine(self, machine: dict[str, Any]) -> None:
        # The bound is the hardware's capacity: measured again after the runs, the better of
        # the two readings counts (a neighbour's burst during one reading would otherwise
        # lower the bound and flatter every engine).
        large = self.cfg.measure_large
        self.say("measuring bandwidth and matmul FLOP/s again ...")
        bw, flops = machine["bandwidth_gb_s"] * 1e9, machine["matmul_gflop_s"] * 1e9
        read = machine["read_bandwidth_gb_s"] * 1e9
        mib = 512 if large else 128
        bw_end = measure_bandwidth(mib)
        read_end = measure_read_bandwidth(mib)
        flops_end = measure_matmul_flops(self.tdtype, 1536 if large else 512)
        machine.update(
            {
                "bandwidth_gb_s_start": bw / 1e9,
                "bandwidth_gb_s_end": bw_end / 1e9,
                "read_bandwidth_gb_s_start": read / 1e9,
                "read_bandwidth_gb_s_end": read_end / 1e9,
                "read_bandwidth_gb_s": max(read, read_end) / 1e9,
                "matmul_gflop_s_start": flops / 1e9,
                "matmul_gflop_s_end": flops_end / 1e9,
                "bandwidth_gb_s": max(bw, bw_end) / 1e9,
                "matmul_gflop_s": max(flops, flops_end) / 1e9,
            }
        )

    def _job(
        self,
        kind: str,
        engine: str,
        label: str,
        workload: str,
        overrides: dict[str, Any] | None = None,
        **extra: Any,
    ) -> Job:
        cfg = self.cfg
        return Job(
            kind=kind,
            engine=engine,
            label=label,
            workload=workload,
            model_dir=str(self.path),
            dtype=cfg.dtype,
            threads=self.threads,
            scale=cfg.scale,
            seed=cfg.seed,
            vocab=self.shape.vocab,
            engine_kwargs=self.ekw,
            static_batch_size=cfg.static_batch_size,
            overrides=overrides or {},
            **extra,
        )

    def _run_job(self, job: Job) -> dict[str, Any]:
        res = run_isolated(job, self.envs[job.engine])
        if "process" in res:
            self.processes.append({**res["process"], "engine": job.engine})
            res["pid"] = res.pop("process")["pid"]
        if "error" in res and job.kind == "run":
            self.errors.setdefault(job.engine, res["error"])
        return res

    def _run_engines(self) -> dict[str, dict[str, dict[str, Any]]]:
        cfg = self.cfg
        raw: dict[str, dict[str, list[dict[str, Any]]]] = {w: {} for w in cfg.workloads}
        order = list(cfg.engines)
        for rep in range(cfg.repeats):
            for w in cfg.workloads:
                rot = order[rep % len(order) :] + order[: rep % len(order)]
                for name in rot:
                    jobs = [self._job("run", name, name, w)]
                    if name == "nbengine" and w == "W3":
                        jobs.append(
                            self._job(
                                "run",
                                name,
                                "nbengine_no_prefix_cache",
                                w,
                                {"enable_prefix_caching": False},
                            )
                        )
                    if name == "nbengine" and w == "W4":
                        # W4's A/B: the same engine with n-gram speculation, back to back.
                        jobs.append(
                            self._job(
                                "run", name, "nbengine_ngram", w, {"speculative_config": NGRAM}
                            )
                        )
                    if name == "nbengine" and w == "W1" and cfg.lora_adapters:
                        # Right after the base run: the ratio of the two is the LoRA cost.
                        lora = {"lora_adapters": cfg.lora_adapters}
                        jobs.append(self._job("run", name, "nbengine_lora", w, lora))
                    for job in jobs:
                        if name in self.errors:
                            continue
                        self.say(f"[{rep + 1}/{cfg.repeats}] {w} {job.label} (load {_load()}) ...")
                        res = self._run_job(job)
                        raw[w].setdefault(job.label, []).append(res)
                        if "error" in res:
                            self.say(f"  {name} cannot run here: {res['error']}")
                        else:
                            self.say(
                                f"  {res['output_tok_s']:.1f} output tok/s, "
                                f"wall {res['wall_s']:.1f} s{_probes(res)}"
                            )
        return {w: {e: median_run(rs) for e, rs in per.items()} for w, per in raw.items()}

    def _common_process_state(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The engine processes' threads and environment but for the wait policy (each
        engine's own: ``_wait_policies_seen``); the distinct ones if they differ."""
        states: list[dict[str, Any]] = []
        for p in self.processes:
            env = {k: v for k, v in p["env"].items() if k not in WAIT_POLICY_VARIABLES}
            p = {**{k: v for k, v in p.items() if k not in ("pid", "engine")}, "env": env}
            if p not in states:
                states.append(p)
        return (states[0] if states else {}), (states if len(states) > 1 else [])

    def _wait_policies_seen(self) -> dict[str, list[dict[str, str | None]]]:
        """Each engine's distinct OpenMP wait settings, as its worker processes saw them."""
        seen: dict[str, list[dict[str, str | None]]] = {}
        for p in self.processes:
            policy = {k: p["env"].get(k) for k in WAIT_POLICY_VARIABLES}
            if policy not in seen.setdefault(p["engine"], []):
                seen[p["engine"]].append(policy)
        return seen

    def _bounds(
        self, results: dict[str, dict[str, dict[str, Any]]], machine: dict[str, Any]
    ) -> dict[str, Any]:
        bw, flops = machine["bandwidth_gb_s"] * 1e9, machine["matmul_gflop_s"] * 1e9
        bounds: dict[str, Any] = {}
        for w, wl in self.wls.items():
            plens = [len(p) for p in wl.prompts]
            cached = None
            if wl.shared_prefix:
                bs = self.ekw.get("block_size", 16)
                hit = (wl.shared_prefix // bs) * bs
                cached = [0] + [hit] * (len(plens) - 1)
            b = workload_bound(
                self.shape,
                plens,
                wl.output_lens,
                bw,
                flops,
                cached,
                self.ekw["max_num_batched_tokens"],
            )
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
            for r in results[w].values():
                if "error" in r:
                    continue
                r["fraction_of_bound"] = b.seconds / r["wall_s"]
                if w == "W2" and r.get("itl_p50_ms"):
                    r["decode_fraction_of_bound"] = entry["decode_step_ms"] / r["itl_p50_ms"]
        return bounds

    def _abort_latency(self) -> dict[str, Any]:
        if not (
            self.cfg.abort_latency
            and "nbengine" in self.cfg.engines
            and "nbengine" not in self.errors
            and "W1" in self.wls
        ):
            return {}
        n_run = scaled(32, self.cfg.scale, 2)
        self.say(f"abort latency with {n_run} running ...")
        return self._run_job(
            self._job(
                "abort",
                "nbengine",
                "abort",
                "W1",
                abort_running=n_run,
                abort_count=max(1, n_run // 2),
            )
        )


NGRAM: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 4}
"""W4's speculative configuration (docs/speculative-decoding.md)."""


def _probes(res: dict[str, Any]) -> str:
    """The worker's machine probes before -> after its run, for the progress line."""
    a, b = res.get("probe_before"), res.get("probe_after")
    if not a or not b:
        return ""
    return (
        f"; machine probe {a['matmul_gflop_s']:.0f} -> {b['matmul_gflop_s']:.0f} GFLOP/s, "
        f"{a['bandwidth_gb_s']:.1f} -> {b['bandwidth_gb_s']:.1f} GB/s"
    )


def _load() -> str:
    la = load_average()
    return "?" if la is None else f"{la[0]:.2f}"
