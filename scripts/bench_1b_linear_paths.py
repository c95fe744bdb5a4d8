"""The product paths over a whole 1B-shaped model, per step size (rows).

``python scripts/bench_1b_linear_paths.py MODE 16,32,64,96 [PATHS]``: random weights in
Llama-3.2-1B's shape (16 layers of qkv 3072x2048, o 2048x2048, gate_up 16384x2048 and
down 2048x8192, plus the 128256x2048 head), packed or quantized once; for each row count,
the time of one pass over every linear (what a step of that many rows spends in its
products), the best of 3 after a warm-up, 2 torch threads, on each path.

``MODE`` int8 or int4 (paths ``row,amx,dense``, the default):

- ``row``: the VNNI row kernels (``amx=False``);
- ``amx``: the AMX tile kernels (``amx=True``; the row kernels where the CPU has no AMX);
- ``dense``: ops/quant.py's dense path, the weight dequantized to bfloat16 into the reused
  per-thread buffer, in slices of ``_DENSE_TILE_BYTES``, and multiplied in oneDNN.

``MODE`` bf16 (paths ``native,amx,onednn``, the default):

- ``native``: the dpbf16 kernels on the packed weights (``amx=False``);
- ``amx``: the AMX tile kernels on the same packed weights (``amx=True``);
- ``onednn``: oneDNN's prepacked weights (``torch.ops.mkldnn._linear_pointwise``), as
  ``PackedLinear`` multiplies them (this doubles the weights' memory: 5 GB in all).

The weights (about 1.2 GB at int8) do not fit in the last-level cache, so each pass reads
them from memory, as a decode step does (docs/quantization.md, "Kernels"). Run it under
the bench lock (``flock /tmp/nbengine-bench.lock``) with ``GOMP_SPINCOUNT=10000``, the
bench's setting.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nbengine.ops import native
from nbengine.ops.quant import (
    _DENSE_TILE_BYTES,
    QUANTIZATION_MODES,
    _scratch,
    quantize_int4,
    quantize_int8,
)

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]
LAYERS = 16
HEAD = (128256, 2048)


def main() -> None:
    """Print one line per row count with each path's milliseconds per pass."""
    mode = sys.argv[1] if len(sys.argv) > 1 else "int8"
    rows = [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "16,32,64,96").split(",")]
    paths = (sys.argv[3] if len(sys.argv) > 3 else "row,amx,dense").split(",")
    torch.set_num_threads(2)
    kernels = native.kernels()
    if kernels is None:
        raise SystemExit("the native kernels are unavailable on this machine (ops/native.py)")
    if mode == "bf16":
        bf16_paths(kernels, rows, paths if len(sys.argv) > 3 else ["native", "amx", "onednn"])
        return
    group = QUANTIZATION_MODES[mode]

    def quantize(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        q, s = quantize_int8(w) if group is None else quantize_int4(w, group)
        return q, s, k

    weights = [quantize(n, k) for _ in range(LAYERS) for n, k in SHAPES] + [quantize(*HEAD)]

    def one_pass(m: int, path: str) -> float:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, _, k in weights}}
        start = time.perf_counter()
        for q, s, k in weights:
            x = xs[k]
            if path == "dense":
                n = q.shape[0]
                step = min(n, max(1, _DENSE_TILE_BYTES // (2 * k)))
                for n0 in range(0, n, step):
                    n1 = min(n, n0 + step)
                    w = kernels.dequantize(q, s, k, group, (n0, n1), out=_scratch.take(n1 - n0, k))
                    F.linear(x, w)
            else:
                kernels.linear_quantized(x, q, s, k, group, None, amx=path == "amx")
        return time.perf_counter() - start

    report(mode, kernels, rows, paths, one_pass)


def bf16_paths(kernels: native.NativeKernels, rows: list[int], paths: list[str]) -> None:
    """``main`` for bfloat16 weights."""

    def make(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None, int, int]:
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        packed = native.pack_linear_weight(w)
        dnn = torch.ops.mkldnn._reorder_linear_weight(w, None) if "onednn" in paths else None
        return packed, dnn, n, k

    weights = [make(n, k) for _ in range(LAYERS) for n, k in SHAPES] + [make(*HEAD)]

    def one_pass(m: int, path: str) -> float:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for *_, k in weights}}
        start = time.perf_counter()
        for packed, dnn, n, k in weights:
            if path == "onednn":
                torch.ops.mkldnn._linear_pointwise(xs[k], dnn, None, "none", [None], "")
            else:
                kernels.linear(xs[k], packed, n, amx=path == "amx")
        return time.perf_counter() - start

    report("bf16", kernels, rows, paths, one_pass)


def report(
    mode: str,
    kernels: native.NativeKernels,
    rows: list[int],
    paths: list[str],
    one_pass: Callable[[int, str], float],
) -> None:
    """Print one line per row count: each path's best of 3 passes after a warm-up, in ms."""
    print(f"{mode}, ms per pass over the 1B shape's linears (AMX tiles usable: {kernels.amx})")
    for m in rows:
        cells = []
        for path in paths:
            one_pass(m, path)
            cells.append(f"{path} {min(one_pass(m, path) for _ in range(3)) * 1e3:7.1f}")
        print(f"M = {m:4d}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
