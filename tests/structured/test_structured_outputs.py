"""Structured outputs (vLLM's ``SamplingParams(structured_outputs=...)``) on a tiny model.

What a user notices: every completion parses under its constraint, whatever the random
model would have said; a bad schema or regex fails at ``generate()``; constrained and
unconstrained requests share batches without changing each other's output.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import nbengine as nb
from nbengine import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "colour", "ok"],
    "additionalProperties": False,
}


def _run(
    engine: nb.Engine, prompts: list[str], params: list[SamplingParams]
) -> list[nb.RequestOutput]:
    handles = [engine.generate(p, sp) for p, sp in zip(prompts, params)]
    return [h.result(timeout=600) for h in handles]


def test_200_seeded_samples_validate_against_the_schema(engine: nb.Engine) -> None:
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=160, structured_outputs=spec)
        for s in range(200)
    ]
    outs = _run(engine, [f"Person {i}:" for i in range(200)], params)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_free_whitespace_opt_in_still_parses(engine: nb.Engine) -> None:
    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer"}},
        "required": ["x"],
        "additionalProperties": False,
    }
    outs = _run(
        engine,
        ["a"] * 10,
        [
            SamplingParams(
                seed=s,
                max_tokens=400,
                structured_outputs=StructuredOutputsParams(
                    json=json.dumps(schema), any_whitespace=True
                ),
            )
            for s in range(10)
        ],
    )
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished  # a random model may spend its budget on whitespace, but not always
    for c in finished:
        jsonschema.validate(json.loads(c.text), schema)


def test_choice_always_yields_one_of_the_choices(engine: nb.Engine) -> None:
    choices = ["positive", "negative", "neutral", "a mix of both"]
    spec = StructuredOutputsParams(choice=choices)
    outs = _run(
        engine,
        ["Sentiment:"] * 60,
        [SamplingParams(seed=s, max_tokens=20, structured_outputs=spec) for s in range(60)],
    )
    texts = [o.outputs[0].text for o in outs]
    assert set(texts) <= set(choices)
    assert len(set(texts)) > 1  # the model's randomness still picks among them
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_regex_always_fullmatches(engine: nb.Engine) -> None:
    # [0-9], not \d: \d is Unicode digits in both engines, but Python's Unicode tables
    # may be older than llguidance's (docs/structured-outputs.md).
    pattern = r"[A-Z][a-z]{1,6} [0-9]{2,4}(-[a-z]+)?"
    spec = StructuredOutputsParams(regex=pattern)
    outs = _run(
        engine,
        ["Code:"] * 60,
        [SamplingParams(seed=s, max_tokens=40, structured_outputs=spec) for s in range(60)],
    )
    for o in outs:
        assert re.fullmatch(pattern, o.outputs[0].text), o.outputs[0].text


def test_greedy_constrained_request(engine: nb.Engine) -> None:
    spec = StructuredOutputsParams(regex=r"(yes|no)")
    out = engine.generate(
        "Answer:", SamplingParams(temperature=0, structured_outputs=spec)
    ).result()
    assert out.outputs[0].text in ("yes", "no")
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None


def test_json_object_and_grammars(engine: nb.Engine) -> None:
    out = engine.generate(
        "{",
        SamplingParams(
            seed=1,
            max_tokens=200,
            structured_outputs=(
                StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
            ),
        ),
    ).result()
    assert isinstance(json.loads(out.outputs[0].text), dict)
    lark = 'start: "(" num (" + " num)* ")"\nnum: /[0-9]{1,3}/\n'
    gbnf = 'root ::= "(" num (" + " num)* ")"\nnum ::= [0-9] [0-9]? [0-9]?\n'
    for grammar in (lark, gbnf):
        outs = _run(
            engine,
            ["Sum:"] * 8,
            [
                SamplingParams(
                    seed=s,
                    max_tokens=60,
                    structured_outputs=StructuredOutputsParams(grammar=grammar),
                )
                for s in range(8)
            ],
        )
        for o in outs:
            if o.outputs[0].finish_reason == "stop":
                assert re.fullmatch(r"\(\d{1,3}( \+ \d{1,3})*\)", o.outputs[0].text)


def test_n_completions_each_follow_the_grammar(engine: nb.Engine) -> None:
    out = engine.generate(
        "x",
        SamplingParams(
            n=5,
            seed=3,
            max_tokens=20,
            structured_outputs=(StructuredOutputsParams(choice=["alpha", "beta", "gamma"])),
        ),
    ).result()
    assert len(out.outputs) == 5
    assert {c.text for c in out.outputs} <= {"alpha", "beta", "gamma"}


def test_older_spelling_guided_decoding(engine: nb.Engine) -> None:
    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["on", "off"]), seed=0)
    assert params.structured_outputs == StructuredOutputsParams(choice=["on", "off"])
    assert engine.generate("s", params).result().outputs[0].text in ("on", "off")


def test_constrained_and_plain_requests_share_a_batch_unchanged(engine: nb.Engine) -> None:
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["The weather", "Once upon", "In a galaxy"]
    alone = [o.outputs[0].token_ids for o in _run(engine, prompts, [plain] * 3)]
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    mixed_params = [plain, SamplingParams(seed=1, max_tokens=100, structured_outputs=spec)] * 3
    mixed_prompts = [p for p in prompts for _ in range(2)]
    mixed = _run(engine, mixed_prompts, mixed_params)
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    for i in (1, 3, 5):
        jsonschema.validate(json.loads(mixed[i].outputs[0].text), SCHEMA)


def test_compiled_grammars_are_cached_by_spec(engine: nb.Engine) -> None:
    compiler = engine._inputs.grammars
    spec = {"type": "object", "properties": {"cached": {"type": "boolean"}}}
    engine.generate(
        "a", SamplingParams(max_tokens=30, structured_outputs=(StructuredOutputsParams(json=spec)))
    ).result()
    hits, misses = compiler.hits, compiler.misses
    # The same schema, given as JSON text with other key order: no new compile.
    engine.generate(
        "b",
        SamplingParams(
            max_tokens=30,
            structured_outputs=(
                StructuredOutputsParams(json=json.dumps(dict(reversed(list(spec.items())))))
            ),
        ),
    ).result()
    assert (compiler.hits, compiler.misses) == (hits + 1, misses)


@pytest.mark.parametrize(
    "spec, match",
    [
        (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "json"),
        (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "json"),
        (dict(regex="(unclosed"), "regex"),
        (dict(regex=r"(a)\1"), "regex"),
        (dict(grammar="start: undefined_rule\n"), "grammar"),
    ],
)
def test_bad_schemas_and_regexes_fail_at_generate(
    engine: nb.Engine, spec: dict, match: str
) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=match):
        engine.generate("p", params)
    assert engine.num_unfinished_requests() == 0
    # The engine serves the next request normally.
    assert engine.generate("p", SamplingParams(max_tokens=2)).result().outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({}, ValueError, "exactly one"),
        (dict(json={"type": "object"}, regex="a"), ValueError, "exactly one"),
        (dict(json="{not json"), ValueError, "json"),
        (dict(json=3), TypeError, "json"),
        (dict(json=[1]), TypeError, "json"),
        (dict(json="[1]"), ValueError, "json"),
        (dict(regex=""), TypeError, "regex"),
        (dict(choice="abc"), TypeError, "choice"),
        (dict(choice=[]), ValueError, "choice"),
        (dict(choice=["a", 1]), TypeError, "choice"),
        (dict(grammar=5), TypeError, "grammar"),
        (dict(json_object="yes"), TypeError, "json_object"),
        (dict(json_object=True, disable_any_whitespace=1), TypeError, "disable_any_whitespace"),
        (dict(json_object=True, any_whitespace=1), TypeError, "any_whitespace"),
        (
            dict(json_object=True, any_whitespace=True, disable_any_whitespace=True),
            ValueError,
            "not both",
        ),
    ],
)
def test_params_are_validated_at_construction(kwargs: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        StructuredOutputsParams(**kwargs)


def _accepts(engine: nb.Engine, spec: StructuredOutputsParams, text: str) -> bool:
    m = engine._inputs.grammars.matcher(spec)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return all(m.consume(t) is None for t in ids)


def test_json_whitespace_options(engine: nb.Engine) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spaced, pretty, blank = '{"a": 1}', '{\n  "a": 1\n}', '{\n\n  "a":   1}'
    default = StructuredOutputsParams(json=schema)
    assert _accepts(engine, default, spaced) and _accepts(engine, default, pretty)
    assert not _accepts(engine, default, blank)  # bounded: no blank runs
    free = StructuredOutputsParams(json=schema, any_whitespace=True)
    assert _accepts(engine, free, blank)
    compact = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert _accepts(engine, compact, '{"a":1}') and not _accepts(engine, compact, spaced)
    # The schema's own llguidance settings win.
    own = StructuredOutputsParams(json={**schema, "x-guidance": {"whitespace_flexible": True}})
    assert _accepts(engine, own, blank)
    assert not _accepts(engine, StructuredOutputsParams(json_object=True), blank)


def test_sampling_params_field_checks() -> None:
    with pytest.raises(TypeError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]
    spec = StructuredOutputsParams(regex="a")
    with pytest.raises(ValueError, match="guided_decoding"):
        SamplingParams(structured_outputs=spec, guided_decoding=spec)
    # replace/clone keep the constraint.
    assert SamplingParams(structured_outputs=spec).replace(seed=1).structured_outputs == spec


def test_a_token_the_grammar_rejects_ends_the_request_in_error(engine: nb.Engine) -> None:
    import torch

    def unmask(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))
        out[engine.tokenizer.encode("Z", add_special_tokens=False)[0]] = 0.0
        return out  # overrides the grammar's mask: a token no choice starts with

    params = SamplingParams(
        max_tokens=5,
        logits_processors=[unmask],
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    out = engine.generate("x", params).result()
    assert out.outputs[0].finish_reason == "error"
    assert engine.generate("x", SamplingParams(max_tokens=2)).result().finished
