"""How often a seeded request samples other tokens alone than beside 11 other requests.

Usage: python scripts/batch_invariance.py float32|bfloat16 (the default model, 30
requests of 32 tokens). docs/api.md ("seed") records the figures.
"""
import nbengine as nb, random, sys
dtype = sys.argv[1]
with nb.Engine(dtype=dtype, seed=0) as e:
    prompts = ["The for statement", "A list is", "The import system", "Dictionaries are", "In Python,"]
    differ = 0
    for i in range(30):
        p = nb.SamplingParams(max_tokens=32, seed=1000 + i, temperature=1.0, ignore_eos=True)
        alone = e.generate(prompts[i % 5], p).result(120).outputs[0].token_ids
        others = [e.generate(prompts[(i + j) % 5] + " x" * j, nb.SamplingParams(max_tokens=40, seed=j, ignore_eos=True)) for j in range(1, 12)]
        batched = e.generate(prompts[i % 5], p).result(120).outputs[0].token_ids
        for o in others: o.result(120)
        differ += alone != batched
    print(dtype, "differ", differ, "of 30")
