"""W4's prompt (docs/benchmarks.md): cue + the model's own greedy passage + cue again."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

import nbengine as nb
from nbengine.bench.workloads import engine_continuation, make_workloads

VOCAB = 256  # ids are drawn below the tiny model's vocabulary


def _greedy(engine: nb.Engine, prompt: list[int], n: int) -> list[int]:
    sp = nb.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return list(engine.generate(prompt, sp).result().outputs[0].token_ids)


def test_w4_passage_is_the_engines_greedy_continuation_of_its_cue(
    tiny_model: Path, make_engine: Callable[..., nb.Engine], tmp_path: Path
) -> None:
    cont = engine_continuation(tiny_model, "float32", cache_dir=tmp_path / "a")
    wl = make_workloads(("W4",), VOCAB, continuation=cont)["W4"]
    (prompt,) = wl.prompts
    assert wl.output_lens == [128]
    cue, passage = prompt[:16], prompt[16:-16]
    assert prompt[-16:] == cue  # the cue again, after the passage
    assert len(passage) == 96
    # The passage is exactly what the engine writes after the cue, without speculation.
    assert passage == _greedy(make_engine(dtype="float32"), cue, 96)

    # Deterministic: another cache (so the engine runs again) gives the same prompt;
    # the cache holds the passage, and a second call reads it.
    other = engine_continuation(tiny_model, "float32", cache_dir=tmp_path / "b")
    assert make_workloads(("W4",), VOCAB, continuation=other)["W4"].prompts == [prompt]
    (cached,) = (tmp_path / "a").glob("*.json")
    assert json.loads(cached.read_text()) == passage
    assert make_workloads(("W4",), VOCAB, continuation=cont)["W4"].prompts == [prompt]


def test_w4_without_the_model_is_refused() -> None:
    with pytest.raises(ValueError, match="continuation"):
        make_workloads(("W2", "W4"), VOCAB)
    assert set(make_workloads(("W2",), VOCAB)) == {"W2"}  # the others need no model
