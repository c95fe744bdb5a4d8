"""Structured outputs in a shared batch: what constrained rows cost the unconstrained ones.

Run: ``python scripts/bench_structured.py [--model DIR] [--requests N] [--tokens T]``
(default: the shipped model). Three runs on one engine, each a batch of 2N greedy
requests decoding T tokens (``ignore_eos``):

- plain: 2N unconstrained requests;
- mixed: N unconstrained + N under a JSON schema (the grammar keeps them going);
- then the mask alone: the time to fill and apply N rows' grammar bitmasks, per step.

It prints the mean inter-token latency (ITL) of the unconstrained requests in each run:
the mixed run's extra per-step time should be about the mask cost. Numbers are recorded
in docs/structured-outputs.md; no timing is asserted in tests.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import nbengine as nb
from nbengine import SamplingParams, StructuredOutputsParams
from nbengine.structured_outputs import apply_bitmask, bitmask_words

# A schema whose strings are long enough to keep a constrained request decoding T tokens.
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 40}}},
    "required": ["items"],
}


def _itl(engine: nb.Engine, ids: list[str]) -> float:
    df = engine.request_stats()
    df = df[df["request_id"].isin(ids)]
    return float(df["itl_mean"].mean())


def _batch(engine: nb.Engine, n_plain: int, n_constrained: int, tokens: int, tag: str) -> float:
    plain = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    shaped = SamplingParams(temperature=0, max_tokens=tokens, structured_outputs=spec)
    prompts = [f"Item list {i}:" for i in range(n_plain + n_constrained)]
    handles = [
        engine.generate(p, plain, request_id=f"{tag}-p{i}") for i, p in enumerate(prompts[:n_plain])
    ]
    handles += [
        engine.generate(p, shaped, request_id=f"{tag}-c{i}")
        for i, p in enumerate(prompts[n_plain:])
    ]
    for h in handles:
        h.result(timeout=600)
    return _itl(engine, [f"{tag}-p{i}" for i in range(n_plain)])


def _mask_cost(engine: nb.Engine, rows: int, steps: int = 50) -> float:
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    matchers = [engine._inputs.grammars.matcher(spec) for _ in range(rows)]
    vocab = engine._vocab_size
    logits = torch.randn(rows * 2, vocab)
    bitmask = torch.empty(rows, bitmask_words(vocab), dtype=torch.int32)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for j, m in enumerate(matchers):
            m.fill_bitmask(bitmask[j])
        apply_bitmask(logits, list(range(rows)), bitmask)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=8, help="N (the batch holds 2N)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n, t = args.requests, args.tokens
    with nb.Engine(args.model, seed=0) as engine:
        _batch(engine, 2 * n, 0, 8, "warm")
        plain, mixed = [], []
        for r in range(args.repeats):  # interleaved, so machine load hits both alike
            plain.append(_batch(engine, 2 * n, 0, t, f"plain{r}"))
            mixed.append(_batch(engine, n, n, t, f"mixed{r}"))
        mask = _mask_cost(engine, n)
        print(
            f"model vocab {engine._vocab_size}; batch {2 * n} requests x {t} tokens; "
            f"{args.repeats} repeats; torch threads {torch.get_num_threads()}"
        )
        print(f"unconstrained ITL, plain batch : {statistics.median(plain) * 1e3:7.2f} ms")
        print(
            f"unconstrained ITL, mixed batch : {statistics.median(mixed) * 1e3:7.2f} ms "
            f"({n} constrained rows)"
        )
        print(f"mask fill + apply, {n} rows    : {mask * 1e3:7.2f} ms per step")


if __name__ == "__main__":
    main()
