"""nbengine on the shipped default model matches transformers token for token."""

from __future__ import annotations

import pytest
import torch
import transformers

import nbengine as nb
from nbengine.model.loader import DEFAULT_MODEL_DIR

PROMPTS = ["The for statement", "A list is", "The import system", "An exception is raised when"]
NEW_TOKENS = 40


def _transformers_greedy(prompt_ids: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        DEFAULT_MODEL_DIR, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None  # compare full lengths, like ignore_eos
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                pad_token_id=0,
            )
            out.append(y[0, len(ids) :].tolist())
    return out


@pytest.fixture(scope="module")
def llm() -> nb.LLM:
    with nb.LLM(dtype="float32") as llm:  # no model argument: the shipped default
        yield llm


def test_default_model_greedy_matches_transformers(llm: nb.LLM) -> None:
    params = nb.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    expected = _transformers_greedy([o.prompt_token_ids for o in outs])
    for out, want in zip(outs, expected):
        assert out.outputs[0].token_ids == want, out.prompt


def test_default_model_prompts_are_tokenized_like_transformers(llm: nb.LLM) -> None:
    hf_tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    outs = llm.generate(PROMPTS, nb.SamplingParams(max_tokens=1), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == hf_tok(prompt)["input_ids"]
