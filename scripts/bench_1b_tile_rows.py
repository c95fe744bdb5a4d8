"""Where the quantized tile path starts to pay: row kernels against dequantized tiles.

``python scripts/bench_1b_tile_rows.py [--rows 8,16,32,64]``: builds ops/kernels.c twice
into a temporary folder, once with every product on the row kernels (``NB_Q_TILE_ROWS``
huge) and once with every product on the dequantized bf16 tiles (``NB_Q_TILE_ROWS`` 1),
loads both into this process and times one linear at Llama-3.2-1B's shapes with each, and
bf16's kernel, interleaved, 2 torch threads, best of several calls (docs/benchmarks.md,
"At the 1B shape"). Random weights; the same weight is called repeatedly.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from nbengine.ops import native, native_build
from nbengine.ops.linear import NativeLinear
from nbengine.ops.quant import QUANTIZATION_MODES, quantize_weight

SHAPES: dict[str, tuple[int, int]] = {
    "qkv 3072x2048": (3072, 2048),
    "o 2048x2048": (2048, 2048),
    "gate_up 16384x2048": (16384, 2048),
    "down 2048x8192": (2048, 8192),
}


def build_variant(folder: Path, tile_rows: int) -> native.NativeKernels:
    """ops/kernels.c compiled with ``NB_Q_TILE_ROWS = tile_rows``, loaded."""
    target = folder / f"kernels_tile{tile_rows}.so"
    subprocess.run(
        [
            "cc",
            *native_build.CFLAGS,
            f"-DNB_Q_TILE_ROWS={tile_rows}",
            str(native_build.SOURCE),
            *native_build.LIBS,
            "-o",
            str(target),
        ],
        check=True,
        timeout=300,
    )
    return native.NativeKernels(ctypes.CDLL(str(target)), target)


def best_ms(f: Callable[[], torch.Tensor], reps: int) -> float:
    """The fastest of ``reps`` calls of ``f()`` after one warm-up call, in milliseconds."""
    f()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    """Print one line per shape, row count and mode: row kernel, tile path, bf16 (ms)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="8,16,32,64", help="comma-separated row counts")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best kept)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    bf16_kernels = native.kernels()
    if bf16_kernels is None:
        raise SystemExit("the native kernels are unavailable on this machine (ops/native.py)")
    with tempfile.TemporaryDirectory() as tmp:
        variants = {
            "row": build_variant(Path(tmp), 1 << 30),
            "tile": build_variant(Path(tmp), 1),
        }
        for name, (n, k) in SHAPES.items():
            lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
            dense = NativeLinear(lin, bf16_kernels)
            quant = {
                mode: (*quantize_weight([lin.weight.data], n, k, mode), QUANTIZATION_MODES[mode])
                for mode in ("int8", "int4")
            }
            for m in [int(r) for r in args.rows.split(",") if r]:
                x = torch.randn(m, k).to(torch.bfloat16)
                for mode, (q, s, g) in quant.items():
                    calls: dict[str, Callable[[], torch.Tensor]] = {
                        "bf16": functools.partial(dense, x)
                    }
                    for v, kern in variants.items():
                        calls[v] = functools.partial(kern.linear_quantized, x, q, s, k, g)
                    times = {c: float("inf") for c in calls}
                    for _ in range(args.rounds):
                        for c, f in calls.items():
                            times[c] = min(times[c], best_ms(f, 7))
                    cells = ", ".join(f"{c} {t:.2f} ms" for c, t in times.items())
                    vs_row = times["row"] / times["tile"]
                    vs_bf16 = times["bf16"] / times["tile"]
                    print(
                        f"{name} M={m} {mode}: {cells}; tile/row {vs_row:.2f}x"
                        f", tile vs bf16 {vs_bf16:.2f}x",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
