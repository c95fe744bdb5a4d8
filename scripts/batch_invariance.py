"""How often a seeded request samples other tokens alone than beside 11 other requests.

Usage: ``python scripts/batch_invariance.py float32|bfloat16`` (the default model, 30
seeded requests of 32 tokens). docs/api.md ("seed") records the figures.
"""

from __future__ import annotations

import sys

import nbengine as nb

PROMPTS = ["The for statement", "A list is", "The import system", "Dictionaries are", "In Python,"]


def main(dtype: str) -> None:
    differ = 0
    with nb.Engine(dtype=dtype, seed=0) as engine:
        for i in range(30):
            prompt = PROMPTS[i % len(PROMPTS)]
            params = nb.SamplingParams(max_tokens=32, seed=1000 + i, ignore_eos=True)
            alone = engine.generate(prompt, params).result(120).outputs[0].token_ids
            others = [
                engine.generate(
                    PROMPTS[(i + j) % len(PROMPTS)] + " x" * j,
                    nb.SamplingParams(max_tokens=40, seed=j, ignore_eos=True),
                )
                for j in range(1, 12)
            ]
            batched = engine.generate(prompt, params).result(120).outputs[0].token_ids
            for other in others:
                other.result(120)
            differ += alone != batched
    print(f"{dtype}: {differ} of 30 seeded requests differ alone vs batched")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "float32")
