"""Where ``nb.Engine(model)`` spends its time and memory while it loads (docs/benchmarks.md,
"Load time and memory").

Run in a fresh process per configuration:

    python scripts/profile_load.py MODEL_DIR [--quantization int8|int4] [--dtype bfloat16]

It prints one JSON line: seconds from process start to ``import nbengine`` done, to the
engine ready (``Engine()`` returned) and to the first token of a 16-token greedy request;
the cumulative seconds of each load phase (cProfile, by function); the resident and peak
memory (VmRSS, VmHWM) after the load and after the first token; the weight bytes + KV
cache bytes of the engine's memory plan; and the decode tokens/s of one more greedy
request (``--decode-tokens``, 64 by default; 0 skips it).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time

# Load phases: (label, module path suffix, function name) of the functions cProfile times.
PHASES = (
    ("tokenizer", "model/tokenizer.py", "from_dir"),
    ("memory plan", "model/memory_plan.py", "plan_memory"),
    ("build modules", "model/loader.py", "build_model"),
    ("cast to dtype (model.to)", "torch/nn/modules/module.py", "to"),
    ("read + copy weights", "model/loader.py", "load_weights"),
    ("read weights (cache)", "model/load_cache.py", "restore"),
    ("store cache", "model/load_cache.py", "store"),
    ("quantize", "ops/quant.py", "quantize_linears"),
    ("quantize (tensor by tensor, inside read + copy)", "model/loader.py", "_quantize"),
    ("pack for native kernels", "ops/linear.py", "pack_linears"),
    ("check packing (_agrees)", "ops/linear.py", "_agrees"),
    ("native kernel build/load", "ops/native.py", "kernels"),
    ("KV cache alloc", "torch", "zeros"),
    ("load_model total", "model/loader.py", "load_model"),
)


def _status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _process_start() -> float:
    """This process's start, in time.time() seconds (Linux /proc)."""
    with open("/proc/self/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[19])  # starttime: field 22, the third after ")" is field 3
    with open("/proc/stat", encoding="ascii") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--decode-tokens",
        type=int,
        default=64,
        help="then one more greedy request of this many tokens: decode tokens/s (0: none)",
    )
    args = ap.parse_args()
    start = _process_start()
    import torch

    torch.set_num_threads(args.threads)
    import nbengine as nb

    t_import = time.time() - start
    prof = cProfile.Profile()
    t0 = time.time()
    prof.enable()
    engine = nb.Engine(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=512,
        kv_cache_memory_gb=0.25,
    )
    prof.disable()
    t_ready = time.time()
    mem_ready = _status()
    sp = nb.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first: list[float] = []
    for _out in engine.generate(list(range(3, 35)), sp):
        if not first:
            first.append(time.time())
    t_done = time.time()
    mem_after = _status()
    decode_tps = None
    if args.decode_tokens:
        sp = nb.SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
        stamps: list[float] = []
        for _out in engine.generate(list(range(5, 37)), sp):
            stamps.append(time.time())
        # From the first token to the last: decode only (the prefill is before the first).
        decode_tps = round((len(stamps) - 1) / (stamps[-1] - stamps[0]), 2)
    plan = engine._core.runner.memory_plan  # type: ignore[attr-defined]
    stats = pstats.Stats(prof)
    phases: dict[str, float] = {}
    for (file, _line, fn), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        for label, suffix, name in PHASES:
            if fn == name and (file.endswith(suffix) or suffix in file):
                phases[label] = max(phases.get(label, 0.0), ct)
    engine.shutdown()
    gib = 1 << 30
    print(
        json.dumps(
            {
                "model": args.model,
                "dtype": args.dtype,
                "quantization": args.quantization,
                "load_average": os.getloadavg(),
                "import_s": round(t_import, 2),
                "engine_s": round(t_ready - t0, 2),
                "start_to_ready_s": round(t_ready - start, 2),
                "start_to_first_token_s": round(first[0] - start, 2),
                "sixteen_tokens_s": round(t_done - t_ready, 2),
                "decode_tokens_per_s": decode_tps,
                "phases_s": {k: round(v, 2) for k, v in sorted(phases.items())},
                "rss_ready_gib": round(mem_ready["VmRSS"] / gib, 3),
                "peak_load_gib": round(mem_ready["VmHWM"] / gib, 3),
                "rss_after_gib": round(mem_after["VmRSS"] / gib, 3),
                "peak_after_gib": round(mem_after["VmHWM"] / gib, 3),
                "plan_weights_gib": round(plan.weights_bytes / gib, 3),
                "plan_kv_gib": round(plan.kv_cache_bytes / gib, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
