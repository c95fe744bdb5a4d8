"""The engines under test: one driver per engine, each running a ``Workload``.

- ``NbengineDriver``: ``nb.Engine`` (a fresh engine per run, so the prefix cache starts
  empty), every request submitted at t0, greedy, ``ignore_eos``. Token arrival times
  are taken when the frontend receives each core batch (the loop thread).
- ``HFStaticDriver``: transformers ``model.generate`` on static batches of the prompts
  in submission order (left padding); a batch runs until its longest request is done.
  A streamer timestamps every decoding step.
- ``HFContinuousDriver``: transformers' continuous batching (the manager behind
  ``generate_batch``; requests are added one by one so each keeps its own
  ``max_new_tokens``), with per-token timestamps (``record_timestamps``).
- ``CT2Driver``: CTranslate2's ``Generator`` (optional: ``pip install ctranslate2``; not a
  default engine), the model converted once into the bench cache; static batches as
  ``HFStaticDriver``, a per-step callback timestamps every token.

All times are ``time.perf_counter()`` seconds; TTFT is measured from the moment the
whole workload was submitted (t0).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nbengine.bench.workloads import Workload
from nbengine.frontend.observer import EngineObserver

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RunResult:
    """One engine on one workload."""

    engine: str
    workload: str
    wall_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)  # one per request
    itl_s: list[float] = field(default_factory=list)  # every gap between output tokens
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


# --------------------------------------------------------------------------- nbengine


class _TokenTimes(EngineObserver):
    """An engine observer (nbengine/frontend/observer.py) that records, per request key,
    when each batch of new tokens reached the frontend, and the prefix-cache counters of
    the latest step. Runs on the engine's loop thread."""

    def __init__(self) -> None:
        self.token_times: dict[str, list[tuple[float, int]]] = {}
        self.hits = (0, 0)
        self._counts: dict[str, int] = {}
        self._batch: tuple[float, float] = (-1.0, 0.0)  # (the batch's `now`, perf_counter)

    def on_tokens(
        self, key: str, num_output_tokens: int, now: float, num_cached_tokens: int | None
    ) -> None:
        if self._batch[0] != now:  # `now` is one reading per core batch: stamp it once
            self._batch = (now, time.perf_counter())
        new = num_output_tokens - self._counts.get(key, 0)
        self._counts[key] = num_output_tokens
        self.token_times.setdefault(key, []).append((self._batch[1], new))

    def on_step(self, stats: Any) -> None:
        self.hits = (stats.prefix_cache_hits, stats.prefix_cache_queries)


LORA_RANK = 16  # the rank of the bench's LoRA adapters (`nbengine bench --lora N`)


class NbengineDriver:
    """Runs workloads on ``nb.Engine``; a fresh engine per run."""

    name = "nbengine"

    def __init__(
        self, model_dir: Path, dtype: str, engine_kwargs: dict[str, Any] | None = None
    ) -> None:
        self.model_dir = model_dir
        self.dtype = dtype
        self.engine_kwargs = dict(engine_kwargs or {})
        # The first engine's load: when it was ready (time.time()), the process's memory
        # then, and what its memory plan counts (weights, KV cache).
        self.first_load: dict[str, Any] | None = None

    def _engine(self, **overrides: Any) -> tuple[Any, _TokenTimes]:
        from nbengine.bench.machine import process_memory
        from nbengine.frontend.engine import Engine

        kw = {"dtype": self.dtype, **self.engine_kwargs, **overrides}
        engine = Engine(str(self.model_dir), **kw)
        if self.first_load is None:
            self.first_load = {"ready_time": time.time(), **process_memory()}
            plan = engine.memory_plan  # in-process engines only
            if plan is not None:
                self.first_load["weights_bytes"] = plan.weights_bytes
                self.first_load["kv_cache_bytes"] = plan.kv_cache_bytes
        timer = _TokenTimes()
        engine.add_observer(timer)
        return engine, timer

    def run(self, wl: Workload, **overrides: Any) -> RunResult:
        import nbengine as nb

        res = RunResult(self.name, wl.name)
        # W1 over LoRA adapters (docs/lora.md): request i runs under adapter i % n.
        n_lora = int(overrides.pop("lora_adapters", 0))
        loras: list[Any] = [None]
        if n_lora:
            from nbengine.bench.workloads import bench_lora_adapters

            dirs = bench_lora_adapters(self.model_dir, n_lora, LORA_RANK)
            loras = [nb.LoRARequest(f"bench-{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
            overrides = {
                **overrides,
                "enable_lora": True,
                "max_loras": n_lora,
                "max_lora_rank": LORA_RANK,
            }
        engine, timer = self._engine(**overrides)
        try:
            for lora in loras[: n_lora or 0]:
                engine.add_lora(lora)  # loaded before t0: the run measures the steps
            params = [
                nb.SamplingParams(
                    temperature=0.0,
                    max_tokens=n,
                    ignore_eos=True,
                    output_kind=nb.RequestOutputKind.FINAL_ONLY,
                )
                for n in wl.output_lens
            ]
            t0 = time.perf_counter()
            handles = [
                engine.generate(p, sp, lora_request=loras[i % len(loras)])
                for i, (p, sp) in enumerate(zip(wl.prompts, params))
            ]
            finals = [h.result() for h in handles]
            res.wall_s = time.perf_counter() - t0
            by_key = timer.token_times
            for h, final in zip(handles, finals):
                n_out = len(final.outputs[0].token_ids)
                res.output_tokens += n_out
                res.prompt_tokens += len(final.prompt_token_ids)
                key = next((k for k in by_key if k.rsplit("#", 1)[0] == h.request_id), None)
                stamps = by_key.get(key, []) if key else []
                if stamps:
                    res.ttft_s.append(stamps[0][0] - t0)
                    res.itl_s.extend(_gaps(stamps))
            hits, queries = timer.hits
            res.extra["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
            steps = engine.step_stats()
            res.extra["num_steps"] = len(steps)
            res.extra["spec_draft_tokens"] = int(steps["spec_draft_tokens"].sum())
            res.extra["spec_accepted_tokens"] = int(steps["spec_accepted_tokens"].sum())
        finally:
            engine.shutdown()
        return res

    def abort_latency(
        self, prompts: list[list[int]], num_running: int, num_aborts: int
    ) -> list[float]:
        """Seconds per ``engine.abort()`` call while ``num_running`` requests decode."""
        import nbengine as nb

        engine, timer = self._engine()
        lat: list[float] = []
        try:
            sp = nb.SamplingParams(
                temperature=0.0,
                max_tokens=100_000,
                ignore_eos=True,
                output_kind=nb.RequestOutputKind.DELTA,
            )
            handles = [
                engine.generate(prompts[i % len(prompts)], sp, request_id=f"a{i}")
                for i in range(num_running)
            ]
            # Wait until every request has produced a token (all RUNNING and decoding).
            deadline = time.monotonic() + 600
            while len(timer.token_times) < num_running and time.monotonic() < deadline:
                time.sleep(0.01)
            for i in range(min(num_aborts, num_running)):
                t = time.perf_counter()
                engine.abort(f"a{i}")
                lat.append(time.perf_counter() - t)
            engine.abort([h.request_id for h in handles])
        finally:
            engine.shutdown()
        return lat


def _gaps(stamps: list[tuple[float, int]]) -> list[float]:
    """Inter-token gaps; tokens delivered together count as zero gaps."""
    gaps: list[float] = []
    prev = stamps[0][0]
    gaps.extend([0.0] * (stamps[0][1] - 1))
    for t, n in stamps[1:]:
        gaps.append(t - prev)
        gaps.extend([0.0] * (n - 1))
        prev = t
    return gaps


# ----------------------------------------------------------------------- transformers


def load_hf_model(model_dir: Path, dtype: str) -> Any:
    """The transformers model for ``model_dir`` in ``dtype`` (SDPA attention, eval mode)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    return model.eval()


class _StepClock:
    """A transformers streamer that timestamps every ``put`` (the prompt, then each step)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFStaticDriver:
    """transformers ``generate`` on static batches of ``batch_size`` prompts."""

    name = "hf_static"

    def __init__(self, model_dir: Path, dtype: str, batch_size: int = 16) -> None:
        self.model = load_hf_model(model_dir, dtype)
        self.batch_size = batch_size

    def run(self, wl: Workload) -> RunResult:
        from transformers import GenerationConfig

        res = RunResult(self.name, wl.name)
        res.extra["batch_size"] = self.batch_size
        model = self.model
        t0 = time.perf_counter()
        with torch.inference_mode():
            for s in range(0, len(wl.prompts), self.batch_size):
                prompts = wl.prompts[s : s + self.batch_size]
                outs = wl.output_lens[s : s + self.batch_size]
                width = max(len(p) for p in prompts)
                ids = torch.zeros(len(prompts), width, dtype=torch.int64)
                mask = torch.zeros(len(prompts), width, dtype=torch.int64)
                for i, p in enumerate(prompts):  # left padding
                    ids[i, width - len(p) :] = torch.tensor(p)
                    mask[i, width - len(p) :] = 1
                n_new = max(outs)
                cfg = GenerationConfig(
                    max_new_tokens=n_new,
                    min_new_tokens=n_new,
                    do_sample=False,
                    pad_token_id=0,
                    eos_token_id=None,
                )
                clock = _StepClock()
                out = model.generate(
                    input_ids=ids, attention_mask=mask, generation_config=cfg, streamer=clock
                )
                assert out.shape[1] == width + n_new, "generate stopped early"
                steps = clock.times[1:]  # times[0] is the prompt
                for p, n in zip(prompts, outs):
                    res.prompt_tokens += len(p)
                    res.output_tokens += n
                    res.ttft_s.append(steps[0] - t0)
                    res.itl_s.extend(b - a for a, b in zip(steps[: n - 1], steps[1:n]))
        res.wall_s = time.perf_counter() - t0
        return res


class HFContinuousDriver:
    """transformers continuous batching (``generate_batch``'s manager)."""

    name = "hf_cb"

    def __init__(
        self, model_dir: Path, dtype: str, max_batch_tokens: int = 512, max_requests: int = 64
    ) -> None:
        self.model = load_hf_model(model_dir, dtype)
        self.max_batch_tokens = max_batch_tokens
        self.max_requests = max_requests

    def run(self, wl: Workload) -> RunResult:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        res = RunResult(self.name, wl.name)
        model = self.model
        max_len = max(len(p) for p in wl.prompts) + max(wl.output_lens)
        page = 16
        per_req = -(-max_len // page) + 1
        cb = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=per_req * len(wl.prompts) + 8,
            max_batch_tokens=self.max_batch_tokens,
            max_requests_per_batch=self.max_requests,
            allow_block_sharing=True,
            auto_switch_to_flash=False,
            use_cuda_graph=False,
            use_async_batching=False,
        )
        gen = GenerationConfig(
            do_sample=False, max_new_tokens=max(wl.output_lens), eos_token_id=-1, pad_token_id=0
        )
        results: dict[str, Any] = {}
        with (
            torch.inference_mode(),
            model.continuous_batching_context_manager(
                generation_config=gen,
                continuous_batching_config=cb,
                block=True,
                timeout=30,
                warmup=False,
            ) as manager,
        ):
            t0 = time.perf_counter()
            ids = [
                manager.add_request(
                    p, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True, eos_token_id=-1
                )
                for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens))
            ]
            while len(results) < len(ids):
                r = manager.get_result(timeout=1.0)
                if r is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous batching thread stopped")
                    continue
                if r.is_finished():
                    if r.error is not None:
                        raise RuntimeError(f"request {r.request_id} failed: {r.error}")
                    results[r.request_id] = r
            res.wall_s = time.perf_counter() - t0
        for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens)):
            r = results[f"r{i}"]
            got = len(r.generated_tokens)
            res.prompt_tokens += len(p)
            res.output_tokens += got
            stamps = r.timestamps or []
            if stamps:
                res.ttft_s.append(stamps[0] - t0)
                res.itl_s.extend(b - a for a, b in zip(stamps, stamps[1:]))
            if got != n:
                res.extra.setdefault("length_mismatches", 0)
                res.extra["length_mismatches"] += 1
        return res


# ------------------------------------------------------------------------- CTranslate2


def ct2_compute_type(dtype: str, quantization: str | None) -> str:
    """CTranslate2's CPU compute type for a bench run: int8 for any nbengine quantization
    (CTranslate2 has no int4), else float32 (it has no bfloat16 on CPUs)."""
    return "int8" if quantization is not None else "float32"


def ct2_model_dir(model_dir: Path, compute_type: str) -> Path:
    """``model_dir`` converted to CTranslate2's format (once; cached beside it)."""
    import ctranslate2

    out = model_dir.parent / f"{model_dir.name}-ct2-{compute_type}"
    if not (out / "model.bin").is_file():
        tmp = out.with_name(out.name + ".tmp")
        ctranslate2.converters.TransformersConverter(str(model_dir)).convert(
            str(tmp), quantization=compute_type, force=True
        )
        tmp.replace(out)
    return out


class CT2Driver:
    """CTranslate2's ``Generator`` on static batches of ``batch_size`` prompts."""

    name = "ct2"

    def __init__(
        self, model_dir: Path, dtype: str, batch_size: int = 16, quantization: str | None = None
    ) -> None:
        import json

        import ctranslate2

        self.compute_type = ct2_compute_type(dtype, quantization)
        ct2_dir = ct2_model_dir(model_dir, self.compute_type)
        self.generator = ctranslate2.Generator(
            str(ct2_dir),
            device="cpu",
            compute_type=self.compute_type,
            intra_threads=torch.get_num_threads(),
        )
        # The Generator takes token strings: the converted model's vocabulary (one per id,
        # the ids past the tokenizer's own padded with placeholder names, as in the bench
        # model whose vocab_size exceeds its small tokenizer's).
        self.tokens: list[str] = json.loads((ct2_dir / "vocabulary.json").read_text())
        self.batch_size = batch_size

    def run(self, wl: Workload) -> RunResult:
        res = RunResult(self.name, wl.name)
        res.extra.update(batch_size=self.batch_size, compute_type=self.compute_type)
        t0 = time.perf_counter()
        for s in range(0, len(wl.prompts), self.batch_size):
            prompts = wl.prompts[s : s + self.batch_size]
            outs = wl.output_lens[s : s + self.batch_size]
            n_new = max(outs)
            steps: dict[int, float] = {}

            def on_step(step: Any, steps: dict[int, float] = steps) -> bool:
                steps.setdefault(step.step, time.perf_counter())
                return False  # go on

            results = self.generator.generate_batch(
                [[self.tokens[i] for i in p] for p in prompts],
                max_batch_size=self.batch_size,
                max_length=n_new,
                min_length=n_new,
                include_prompt_in_result=False,
                sampling_topk=1,
                callback=on_step,
            )
            times = [steps[k] for k in sorted(steps)]
            for p, n, r in zip(prompts, outs, results):
                if len(r.sequences_ids[0]) < n:
                    res.extra["length_mismatches"] = res.extra.get("length_mismatches", 0) + 1
                res.prompt_tokens += len(p)
                res.output_tokens += n
                res.ttft_s.append(times[0] - t0)
                res.itl_s.extend(b - a for a, b in zip(times[: n - 1], times[1:n]))
        res.wall_s = time.perf_counter() - t0
        return res
