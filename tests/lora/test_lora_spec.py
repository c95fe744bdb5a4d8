"""LoRA adapters with speculative decoding: a request's drafted rows get its adapter's
delta like its decoded row, so mixed batches of adapters, the base and drafts keep
transformers + PEFT's greedy tokens (docs/lora.md, docs/speculative-decoding.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from lora_setup import hf_greedy, make_adapter, tiny

import nbengine as nb

N_NEW = 24
# Repeating prompts: the n-gram lookup proposes drafts from the first step on.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9, 10], [3, 4, 3, 4, 3]]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def test_drafted_rows_get_their_requests_adapter(tmp_path: Path) -> None:
    base = tiny(tmp_path / "base", "llama")
    dir_a, peft_a = make_adapter(base, tmp_path / "a", "llama", seed=1)
    dir_b, peft_b = make_adapter(base, tmp_path / "b", "llama", seed=2)
    with peft_a.disable_adapter():
        want_base = [hf_greedy(peft_a, p, N_NEW) for p in PROMPTS]
    want = {
        "a": [hf_greedy(peft_a, p, N_NEW) for p in PROMPTS],
        "b": [hf_greedy(peft_b, p, N_NEW) for p in PROMPTS],
        "base": want_base,
    }
    loras = {
        "a": nb.LoRARequest("a", 1, str(dir_a)),
        "b": nb.LoRARequest("b", 2, str(dir_b)),
        "base": None,
    }
    plan = [("a", 0), ("base", 1), ("b", 2), ("base", 0), ("b", 1), ("a", 2)]
    greedy = nb.SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
    with nb.Engine(
        base,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        block_size=4,
        num_kv_blocks=256,
        speculative_config=SPEC,
    ) as engine:
        handles = engine.generate_many(
            [PROMPTS[i] for _, i in plan], [greedy] * len(plan), [loras[w] for w, _ in plan]
        )
        got = [h.result(timeout=120).outputs[0].token_ids for h in handles]
        drafted = int(engine.step_stats()["spec_draft_tokens"].sum())
    assert drafted > 0  # the steps verified drafts, under adapters and the base together
    assert got == [want[w][i] for w, i in plan]
