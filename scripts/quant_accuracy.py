"""Accuracy of weight-only quantization on the shipped default model (docs/quantization.md).

For bfloat16 and each ``quantization`` mode, an engine scores the held-out split of the
default model's training corpus (the validation documents of
scripts/train_default_model.py: same corpus, seed and fraction, packed into the same rows)
and reports

- perplexity: exp of the mean negative log-likelihood of every token after the first of
  each row, read from the engine's ``prompt_logprobs``;
- top-1 agreement with bfloat16: over the first ``--positions`` of those positions, the
  share where the mode's most likely next token is bfloat16's.

``--max-num-batched-tokens 4`` scores in chunks of four tokens, which the quantized
kernels multiply as they do in decode steps of a few rows (inputs scaled to int16 per row
for int8, to int8 per group for int4: ops/quant.py); with the default (512), products of
many rows take the paths of prefill (on AMX CPUs: from 16 rows int8 on the AMX tiles with
the same int16 inputs and int4 by weights rounded to bfloat16, from 256 rows either by
weights rounded to bfloat16; elsewhere int4 from 128 rows by bfloat16-rounded weights).

Prompts are rows of 255 tokens (the model's context is 256 and one token is generated),
so the perplexity covers 254 predictions per row where training's evaluation covered 256:
it is close to, not equal to, TRAINING.json's figure; the bfloat16 row is the baseline.

Usage: python scripts/quant_accuracy.py [--modes int8 int4 int4-g32] [--json out.json]
The corpus is collected once (a subprocess imports the standard library) and cached in
--cache-dir.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LEN = 255


def _train_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "train_default_model", ROOT / "scripts" / "train_default_model.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def held_out_rows(cache_dir: Path) -> tuple[list[list[int]], dict[str, int]]:
    """The validation rows (context + 1 tokens each) of the default model's training run."""
    from tokenizers import Tokenizer

    train = _train_module()
    info = json.loads((ROOT / "nbengine" / "default_model" / "TRAINING.json").read_text())
    seed, context = int(info["training"]["seed"]), int(info["model"]["context"])
    docs = train.collect_corpus(
        cache_dir / f"corpus-py{sys.version_info.major}{sys.version_info.minor}.json"
    )
    order = list(range(len(docs)))
    import random

    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(docs) * 0.02))  # train_default_model.py's --val-frac default
    val_docs = [docs[i] for i in order[:n_val]]
    tok = Tokenizer.from_file(str(ROOT / "nbengine" / "default_model" / "tokenizer.json"))
    eot = tok.token_to_id(train.EOT)
    ids = [e.ids for e in tok.encode_batch(val_docs, add_special_tokens=False)]
    rows = train.pack(ids, eot, context)
    stats = {
        "documents": len(docs),
        "val_documents": len(val_docs),
        "val_tokens": rows.numel(),
        "expected_documents": info["corpus"]["documents"],
        "expected_val_tokens": info["corpus"]["val_tokens"],
    }
    return rows.tolist(), stats


def score(rows: list[list[int]], quantization: str | None, batched_tokens: int) -> dict[str, Any]:
    """Per position: the true token's logprob and the most likely token, for one engine."""
    import nbengine as nb

    prompts = [r[:PROMPT_LEN] for r in rows]
    params = nb.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    start = time.perf_counter()
    with nb.LLM(
        None,
        dtype="bfloat16",
        quantization=quantization,
        max_model_len=256,
        max_num_batched_tokens=batched_tokens,
        seed=0,
    ) as llm:
        shown = repr(llm.engine)
        outs = llm.generate(prompts, params, use_tqdm=False)
    nll: list[float] = []
    top1: list[int] = []
    for prompt, out in zip(prompts, outs):
        plp = out.prompt_logprobs
        assert plp is not None
        for pos in range(1, len(prompt)):
            entry = plp[pos]
            assert entry is not None
            nll.append(-entry[prompt[pos]].logprob)
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return {"nll": nll, "top1": top1, "seconds": time.perf_counter() - start, "engine": shown}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=["int8", "int4", "int4-g32"])
    p.add_argument("--positions", type=int, default=1000, help="positions for top-1 agreement")
    p.add_argument("--cache-dir", default="/work/train_out/cache")
    p.add_argument("--json", help="write the results here too")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="tokens per step: from 128, int4 scores partly through the kernels' "
        "prefill path; below 128 only through their decode path",
    )
    args = p.parse_args()

    rows, stats = held_out_rows(Path(args.cache_dir))
    print(f"held-out split: {stats}")
    if stats["documents"] != stats["expected_documents"]:
        print(
            "WARNING: the corpus differs from the training run's (another Python?); "
            "the split is not the held-out one."
        )
    chunk = args.max_num_batched_tokens
    base = score(rows, None, chunk)
    print(base["engine"])
    results: list[dict[str, Any]] = []
    base_ppl = math.exp(sum(base["nll"]) / len(base["nll"]))
    results.append(
        {
            "mode": "bfloat16",
            "perplexity": base_ppl,
            "ppl_change": 0.0,
            "top1_agreement": 1.0,
            "positions": len(base["nll"]),
        }
    )
    n = min(args.positions, len(base["top1"]))
    for mode in args.modes:
        r = score(rows, mode, chunk)
        print(r["engine"])
        ppl = math.exp(sum(r["nll"]) / len(r["nll"]))
        agree = sum(a == b for a, b in zip(r["top1"][:n], base["top1"][:n])) / n
        results.append(
            {
                "mode": mode,
                "perplexity": ppl,
                "ppl_change": ppl / base_ppl - 1,
                "top1_agreement": agree,
                "positions": len(r["nll"]),
            }
        )
    print(f"\n| weights | perplexity | vs bfloat16 | top-1 agreement ({n} positions) |")
    print("|---|---|---|---|")
    for r in results:
        print(
            f"| {r['mode']} | {r['perplexity']:.3f} | {r['ppl_change']:+.2%} | "
            f"{r['top1_agreement']:.1%} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"split": stats, "results": results}, indent=1))


if __name__ == "__main__":
    main()
