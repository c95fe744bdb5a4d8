"""LLM.beam_search (vLLM's API) against transformers' beam search on a tiny float32 model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import ENGINE_KW

import nbengine as nb
from nbengine import BeamSearchParams

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("width", [2, 3])
def test_beam_search_matches_transformers(tiny_model: Path, width: int) -> None:
    prompts = [[5, 17, 3, 99], [42, 7]]
    steps = 6
    with nb.LLM(str(tiny_model), dtype="float32", **ENGINE_KW) as llm:
        outs = llm.beam_search(
            [{"prompt_token_ids": p} for p in prompts],
            BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True),
        )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model, torch_dtype=torch.float32
    ).eval()
    for prompt, out in zip(prompts, outs):
        assert len(out.sequences) == width
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]),
                num_beams=width,
                num_return_sequences=width,
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                early_stopping=False,
                length_penalty=1.0,
                pad_token_id=0,
            )
        assert [s.tokens for s in out.sequences] == ref.tolist()
        scores = [s.cum_logprob for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        assert all(s.finish_reason == "length" and s.text is not None for s in out.sequences)


def test_beam_search_stops_beams_at_eos_and_validates(tiny_model: Path) -> None:
    with nb.LLM(str(tiny_model), dtype="float32", **ENGINE_KW) as llm:
        out = llm.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=4))[0]
        assert len(out.sequences) == 2
        eos = llm.engine._eos_token_ids
        for s in out.sequences:
            assert (s.finish_reason == "stop") == (s.tokens[-1] in eos)
        with pytest.raises(ValueError, match="max_logprobs"):
            llm.beam_search("a", BeamSearchParams(beam_width=11, max_tokens=2))
        with pytest.raises(TypeError, match="BeamSearchParams"):
            llm.beam_search("a", {"beam_width": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=2)
    with pytest.raises(TypeError, match="ignore_eos"):
        BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=1)  # type: ignore[arg-type]
