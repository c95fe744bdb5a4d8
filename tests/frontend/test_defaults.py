"""What a call runs with when the user does not say: the engine seed and the model's
generation_config.json (vLLM's rules)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

import nbengine as nb

from support.models import ENGINE_KW


def _sampled(engine: nb.Engine) -> list[int]:
    params = nb.SamplingParams(max_tokens=24, ignore_eos=True)  # temperature 1, no seed
    return engine.generate("Once upon", params).result(60).outputs[0].token_ids


def test_each_engine_draws_its_own_seed_and_a_given_seed_repeats(tiny_model: Path) -> None:
    with nb.Engine(str(tiny_model), **ENGINE_KW) as a, nb.Engine(str(tiny_model), **ENGINE_KW) as b:
        assert a.config.model.seed != b.config.model.seed
        assert _sampled(a) != _sampled(b)
        seed = a.config.model.seed
    with (
        nb.Engine(str(tiny_model), seed=seed, **ENGINE_KW) as c,
        nb.Engine(str(tiny_model), seed=seed, **ENGINE_KW) as d,
    ):
        assert _sampled(c) == _sampled(d)


def test_generation_config_supplies_the_defaults(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "generation_config.json").read_text())
    cfg.update(temperature=0.0, top_k=5, max_new_tokens=7, repetition_penalty=1.1, top_p=5)
    (model / "generation_config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING), nb.Engine(str(model), **ENGINE_KW) as engine:
        defaults = engine.get_default_sampling_params()
        assert (
            defaults.temperature,
            defaults.top_k,
            defaults.max_tokens,
            defaults.repetition_penalty,
            defaults.top_p,
        ) == (0.0, 5, 7, 1.1, 1.0)
        assert "Ignoring top_p=5" in caplog.text  # an invalid value is skipped, not fatal
        out = engine.generate("Once upon").result(60).outputs[0]
        greedy = nb.SamplingParams(temperature=0, max_tokens=7, repetition_penalty=1.1)
        assert out.token_ids == engine.generate("Once upon", greedy).result(60).outputs[0].token_ids
        assert len(out.token_ids) <= 7
    with nb.LLM(str(model), **ENGINE_KW) as llm:
        assert llm.generate("Once upon", use_tqdm=False)[0].outputs[0].token_ids == out.token_ids


def test_repr_shows_what_was_loaded(tiny_model: Path) -> None:
    with nb.Engine(str(tiny_model), **ENGINE_KW) as engine:
        plan = engine._core.runner.memory_plan
        assert repr(engine) == (
            f"Engine(model={str(tiny_model)!r}, dtype=float32, "
            f"max_model_len={engine.max_model_len}, alive, "
            f"memory: {plan.summary()})"
        )
    assert repr(engine).endswith("dead)")
