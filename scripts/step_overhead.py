"""How much of an engine step is spent outside the model's compute (issue 17, item 3).

Runs a bench workload (default W1: 64 mixed requests) on the bench model through one
``nb.Engine`` and splits the ``nbengine-core`` thread's step time into

- compute: time inside the calls that do the model's arithmetic: nbengine's native
  kernels (``NativeKernels`` methods and the whole-stack decode plan), oneDNN's linears
  (``torch.ops.mkldnn._linear_pointwise``, and ``F.linear`` on the weights quantized
  layers dequantize for it), SDPA, the embedding lookup and the sampler's native argmax;
- overhead: the rest of ``EngineCore.step``: scheduling, batch preparation, the Python
  and the torch calls between kernels (norm residuals, K/V writes, reshapes), sampling
  bookkeeping and the scheduler's update, reported by phase.

Each timed call is wrapped (a few hundred nanoseconds per call, counted as overhead), so
the overhead figure is an upper bound. The frontend's work (detokenization, outputs)
runs on the ``nbengine-loop`` thread and is not part of a step, but it shares the GIL;
steps that wait for it show as overhead where they wait.

Usage: python scripts/step_overhead.py [--workload W1] [--quantization int8] [--scale 1.0]
[--model DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import nbengine as nb
from nbengine.bench.workloads import bench_model_dir, engine_continuation, make_workloads
from nbengine.core import engine_core
from nbengine.frontend import registry
from nbengine.model import decode_plan, runner
from nbengine.ops import attention_kernels, native

_state = threading.local()
_totals: dict[str, float] = defaultdict(float)


def _timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its time added to ``_totals[key]`` (outermost timed call only)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_state, "depth", 0):
            return fn(*args, **kwargs)
        _state.depth = 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _totals[key] += time.perf_counter() - start
            _state.depth = 0

    return wrapper


def _instrument() -> None:
    for name in (
        "linear",
        "linear_quantized",
        "rms_norm",
        "silu_mul",
        "rotary_",
        "cached_attention",
        "rope_attention",
        "argmax",
        "dequantize",
    ):
        setattr(native.NativeKernels, name, _timed("compute", getattr(native.NativeKernels, name)))
    decode_plan.DecodePlan._call = _timed("compute", decode_plan.DecodePlan._call)  # type: ignore[method-assign]
    mkldnn = torch.ops.mkldnn
    linear = mkldnn._linear_pointwise
    mkldnn._linear_pointwise = _timed("compute", linear)  # type: ignore[attr-defined]
    attention_kernels.F.scaled_dot_product_attention = _timed(  # type: ignore[assignment]
        "compute", attention_kernels.F.scaled_dot_product_attention
    )
    torch.nn.functional.embedding = _timed("compute", torch.nn.functional.embedding)  # type: ignore[assignment]
    torch.nn.functional.linear = _timed("compute", torch.nn.functional.linear)  # type: ignore[assignment]
    engine_core.EngineCore.step = _phase("step", engine_core.EngineCore.step)  # type: ignore[method-assign]
    runner.ModelRunner.execute = _phase("execute", runner.ModelRunner.execute)  # type: ignore[method-assign]
    registry.RequestRegistry.process = _phase("frontend", registry.RequestRegistry.process)  # type: ignore[method-assign]


def _phase(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its time added to ``_totals[key]`` and its calls counted in
    ``_totals[key + " calls"]`` (every call, nested or not)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _totals[key] += time.perf_counter() - start
            _totals[key + " calls"] += 1

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="W1", choices=("W1", "W2", "W3"))
    p.add_argument("--quantization", default=None)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--model", default=None, help="a model directory (default: the bench model)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    _instrument()
    model = Path(args.model) if args.model else bench_model_dir()
    engine = nb.Engine(
        str(model),
        dtype="bfloat16",
        quantization=args.quantization,
        max_num_seqs=64,
        max_num_batched_tokens=512,
    )
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    qkw = {"quantization": args.quantization} if args.quantization else {}
    cont = engine_continuation(model, "bfloat16", qkw)
    work = make_workloads([args.workload], vocab, args.scale, continuation=cont)[args.workload]

    def run(prompts: list[list[int]], outs: list[int]) -> float:
        start = time.perf_counter()
        handles = [
            engine.generate(
                {"prompt_token_ids": ids},
                nb.SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0),
            )
            for ids, n in zip(prompts, outs)
        ]
        for h in handles:
            h.result()
        return time.perf_counter() - start

    run(work.prompts[:8], [min(8, n) for n in work.output_lens[:8]])  # warm-up
    _totals.clear()
    wall = run(work.prompts, work.output_lens)
    engine.shutdown()
    step, compute, execute = _totals["step"], _totals["compute"], _totals["execute"]
    print(
        f"{args.workload} ({args.quantization or 'bf16'}, threads {torch.get_num_threads()}): "
        f"{sum(work.output_lens) / wall:.1f} output tok/s, {int(_totals['step calls'])} steps, "
        f"wall {wall:.2f} s, steps {step:.2f} s"
    )
    print(f"  compute  {compute:.3f} s  {100 * compute / step:.1f}% of step time")
    print(
        f"  overhead {step - compute:.3f} s  {100 * (step - compute) / step:.1f}%: "
        f"in the runner {execute - compute:.3f} s, schedule + update {step - execute:.3f} s"
    )
    print(
        f"  frontend (nbengine-loop thread, outside the steps): {_totals['frontend']:.3f} s "
        "applying the core's outputs"
    )


if __name__ == "__main__":
    main()
