"""Structured outputs on the shipped default model (``nb.Engine()``), as a user first meets them.

The random tiny model of the other structured suites says nothing like a real model would;
the default model has its own habits, and an unbounded grammar lets it wander: under a
JSON schema with free whitespace it spent half of 40 samples on runs of spaces and
newlines until ``max_tokens`` (issue 31, item 1). Every one of these 120 seeded samples
must finish ``"stop"`` and parse under its constraint. Sampling is seeded, so the
outcome is fixed for a given model and tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

import nbengine as nb
from nbengine import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow  # the default model: under a minute for the module

# The small schema: a name of at most 20 characters, a year, at most 3 short tags.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "year", "tags"],
    "additionalProperties": False,
}
CHOICES = ["red", "green", "blue", "yellow"]
REGEX = r"[A-Z][a-z]{2,8} [0-9]{4}"


@pytest.fixture(scope="module")
def engine() -> Iterator[nb.Engine]:
    with nb.Engine() as eng:
        yield eng


def _invalid(kind: str, out: nb.CompletionOutput) -> bool:
    if out.finish_reason != "stop":
        return True
    if kind == "json":
        try:
            jsonschema.validate(json.loads(out.text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return True
        return False
    if kind == "choice":
        return out.text not in CHOICES
    return re.fullmatch(REGEX, out.text) is None


def test_120_seeded_samples_at_temperature_1_all_finish_and_parse(engine: nb.Engine) -> None:
    specs = {
        "json": StructuredOutputsParams(json=SCHEMA),  # the default whitespace: bounded
        "choice": StructuredOutputsParams(choice=CHOICES),
        "regex": StructuredOutputsParams(regex=REGEX),
    }
    runs = [(kind, seed) for kind in specs for seed in range(40)]
    handles = [
        engine.generate(
            f"Item {seed}:",
            SamplingParams(
                temperature=1.0, seed=seed, max_tokens=120, structured_outputs=specs[kind]
            ),
        )
        for kind, seed in runs
    ]
    outs = [h.result(timeout=300).outputs[0] for h in handles]
    bad = [(kind, o.finish_reason, o.text) for (kind, _), o in zip(runs, outs) if _invalid(kind, o)]
    assert not bad, f"{len(bad)} of 120 invalid, e.g. {bad[:3]}"


def _whitespace_runs_outside_strings(text: str) -> list[str]:
    """The runs of whitespace between JSON tokens (string literals, also an unfinished
    last one, removed)."""
    outside = re.sub(r'"(?:[^"\\]|\\.)*("|$)', '""', text)
    return re.findall(r"\s+", outside)


def test_json_object_whitespace_is_bounded_by_default(engine: nb.Engine) -> None:
    # Any object: its keys and strings are the model's, so some samples run to
    # max_tokens inside a string; but no sample spends it on blank runs, and every one
    # that finishes is an object.
    spec = StructuredOutputsParams(json_object=True)
    handles = [
        engine.generate(
            f"Record {seed}:",
            SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured_outputs=spec),
        )
        for seed in range(12)
    ]
    outs = [h.result(timeout=300).outputs[0] for h in handles]
    runs = [r for o in outs for r in _whitespace_runs_outside_strings(o.text)]
    bounded = re.compile(r" |\n[ \t]{0,8}")
    assert all(bounded.fullmatch(r) for r in runs), [r for r in runs if not bounded.fullmatch(r)]
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished
    assert all(isinstance(json.loads(o.text), dict) for o in finished)


def test_any_whitespace_opts_in_to_free_whitespace(engine: nb.Engine) -> None:
    # The opt-in gives vLLM's default grammar back: this model then writes blank runs.
    spec = StructuredOutputsParams(json=SCHEMA, any_whitespace=True)
    handles = [
        engine.generate(
            f"Item {seed}:",
            SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs=spec),
        )
        for seed in range(4)
    ]
    texts = [h.result(timeout=300).outputs[0].text for h in handles]
    runs = [r for t in texts for r in _whitespace_runs_outside_strings(t)]
    assert any(len(r) > 9 or r.count("\n") > 1 for r in runs)
