"""Decode step time per precision, with every precision meeting the same machine states.

``nbengine bench`` runs each precision in its own process, a minute or more apart. On a
shared VM whose memory speed flips between states from minute to minute (the AMD host:
bf16 decode steps of the 1B shape at about 48 or about 72 ms), the ratio of two such
runs says more about the states they met than about the engines. This script loads one
engine per precision in one process and alternates short greedy generations between
them, round after round, and reads each generation's decode steps (steps without prefill
tokens) from the engine's public step log (``Engine.step_stats()``: the whole engine step,
scheduling included). The ratio of the per-precision medians over many rounds is the figure
docs/benchmarks.md quotes as "paired" ("The int8 decode rows read in order").

Usage: python scripts/paired_decode.py [--shape llama-3.2-1b] [--precisions bf16,int8,int4]
[--rounds 16] [--tokens 48] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the bench's engine processes

import torch

import nbengine as nb
from nbengine.bench.workloads import SHAPES, bench_model_dir

PROMPT = "The quick brown fox jumps over the lazy dog, again and again"


def _decode_step_p50_ms(llm: nb.LLM, after: int) -> tuple[float, int]:
    """The median time (ms) of the engine's decode-only steps numbered above ``after``,
    and the last step's number."""
    steps = llm.engine.step_stats()
    new = steps[steps["step"] > after]
    decode = new[(new["prefill_tokens"] == 0) & (new["decode_tokens"] > 0)]
    return float(decode["step_time"].median()) * 1e3, int(new["step"].max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=tuple(SHAPES))
    parser.add_argument("--precisions", default="bf16,int8,int4")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per generation")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the step medians here")
    args = parser.parse_args()
    precisions = args.precisions.split(",")
    if args.rounds < 1 or args.tokens < 2:
        raise SystemExit("--rounds must be at least 1 and --tokens at least 2")

    torch.set_num_threads(args.threads)
    model = str(bench_model_dir(shape=args.shape))
    engines = {p: nb.LLM(model, quantization=None if p == "bf16" else p) for p in precisions}
    params = nb.SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    last: dict[str, int] = {}
    for p, llm in engines.items():  # warm-up
        llm.generate([PROMPT], params, use_tqdm=False)
        last[p] = int(llm.engine.step_stats()["step"].max())

    medians: dict[str, list[float]] = {p: [] for p in precisions}
    for r in range(args.rounds):
        for p, llm in engines.items():
            llm.generate([PROMPT], params, use_tqdm=False)
            p50, last[p] = _decode_step_p50_ms(llm, last[p])
            medians[p].append(p50)
        print(f"round {r}: " + "  ".join(f"{p} {medians[p][-1]:.1f} ms" for p in precisions))

    overall = {p: statistics.median(v) for p, v in medians.items()}
    print(
        "step p50, median over rounds (ms): "
        + ", ".join(f"{p} {v:.2f}" for p, v in overall.items())
    )
    base = precisions[0]
    for p in precisions[1:]:
        per_round = sorted(a / b for a, b in zip(medians[base], medians[p]))
        print(
            f"{p}: {overall[base] / overall[p]:.2f}x {base} (medians); per round "
            f"{per_round[0]:.2f}-{per_round[-1]:.2f}, median {statistics.median(per_round):.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "shape": args.shape,
                    "tokens": args.tokens,
                    "threads": args.threads,
                    "step_p50_ms_per_round": medians,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
