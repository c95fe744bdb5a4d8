"""Interleaved timings of one linear at Llama-3.2-1B's shapes: bf16 against int8 and int4.

``python scripts/bench_1b_kernels.py``: random weights, 2 torch threads, best of several
calls, each precision measured twice in turn (docs/benchmarks.md, "At the 1B shape").
The same weight is called repeatedly, so weights that fit in the last-level cache (int4
gate_up: 17 MiB) read faster than from memory; compare rows of many inputs, not M = 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from nbengine.ops import native
from nbengine.ops.linear import NativeLinear
from nbengine.ops.quant import QuantLinear

SHAPES: dict[str, tuple[int, int, list[int]]] = {
    "gate_up 16384x2048": (16384, 2048, [1, 16, 64, 256, 1024]),
    "down 2048x8192": (2048, 8192, [1, 64, 1024]),
    "lm_head 128256x2048": (128256, 2048, [1, 16]),
}


def best_ms(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, reps: int) -> float:
    """The fastest of ``reps`` calls of ``f(x)`` after one warm-up call, in milliseconds."""
    f(x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(x)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    """Print one line per shape and row count: each precision's time and its speed vs bf16."""
    torch.manual_seed(0)
    torch.set_num_threads(2)
    kernels = native.kernels()
    if kernels is None:
        raise SystemExit("the native kernels are unavailable on this machine (ops/native.py)")
    for name, (n, k, row_counts) in SHAPES.items():
        lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
        mods: dict[str, nn.Module] = {
            "bf16": NativeLinear(lin, kernels),
            "int8": QuantLinear(lin, "int8"),
            "int4": QuantLinear(lin, "int4"),
        }
        for m in row_counts:
            x = torch.randn(m, k).to(torch.bfloat16)
            reps = 5 if m * n * k > 5e9 else 15
            times: dict[str, list[float]] = {p: [] for p in mods}
            for _ in range(2):
                for p, mod in mods.items():
                    times[p].append(best_ms(mod, x, reps))
            base = min(times["bf16"])
            cells = ", ".join(
                f"{p} {min(v):.2f} ms ({base / min(v):.2f}x bf16)" for p, v in times.items()
            )
            print(f"{name} M={m}: {cells}", flush=True)


if __name__ == "__main__":
    main()
