"""Constraints that cannot be met, or that cost too much, fail clearly and never stall the core.

What a user notices (issue 31, items 3-5): a constraint that nothing can satisfy is a
``ValueError`` at ``generate()`` (or a request that ends ``finish_reason="error"`` with
the grammar engine's message), never ``"stop"`` with empty text; a grammar too costly
to compile is refused at the call, on the caller's thread, naming the limit, while the
other streams keep running; a long choice list works; a schema nested too deep is a
``ValueError`` naming the depth, not a ``RecursionError``.
"""

from __future__ import annotations

import json
import threading

import pytest

import nbengine as nb
from nbengine import SamplingParams, StructuredOutputsParams

# --- item 3: constraints nothing can satisfy --------------------------------------------

UNSATISFIABLE = [
    # A $ref cycle: each definition is only the other.
    dict(
        json={
            "$ref": "#/$defs/a",
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
        }
    ),
    dict(json={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
    # A grammar with no finite sentence: it never terminates.
    dict(grammar='start: "a" start\n'),
    dict(grammar='root ::= "(" root ")"\n'),
    # A regex that matches nothing.
    dict(regex=r"[^\x00-\x{10FFFF}]"),
]


@pytest.mark.parametrize("spec", UNSATISFIABLE, ids=lambda s: json.dumps(s)[:40])
def test_an_unsatisfiable_constraint_is_refused_at_generate(engine: nb.Engine, spec: dict) -> None:
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=rf"structured_outputs\.{next(iter(spec))}"):
        engine.generate("p", params)
    assert engine.num_unfinished_requests() == 0
    assert engine.generate("p", SamplingParams(max_tokens=2)).result().outputs[0].token_ids


def test_a_grammar_error_in_the_core_ends_the_request_in_error(engine: nb.Engine) -> None:
    # Two branches: one ends at once, the other leads to a row of 3000 alternatives,
    # more than the grammar engine allows (2000). generate() walks the first tokens of
    # the branch with the lower token id, which is fine; logit_bias steers the model
    # into the other, where the grammar engine fails in the core.
    ids = {c: engine.tokenizer.encode(c, add_special_tokens=False) for c in "xy"}
    assert all(len(v) == 1 for v in ids.values())
    safe, bad = sorted("xy", key=lambda c: ids[c][0])
    alts = " | ".join(json.dumps(f"w{i}") for i in range(3000))
    grammar = f'start: "{safe}" | "{bad}" alt\nalt: {alts}\n'
    params = SamplingParams(
        max_tokens=20,
        logit_bias={ids[bad][0]: 50.0},
        structured_outputs=StructuredOutputsParams(grammar=grammar),
    )
    out = engine.generate("p", params).result(timeout=120)
    c = out.outputs[0]
    assert c.finish_reason == "error", (c.finish_reason, c.text)
    assert c.text.startswith(bad)
    assert out.error is not None and "max_items_in_row=2000" in out.error, out.error
    assert out.error.startswith("structured outputs:"), out.error
    assert engine.generate("p", SamplingParams(max_tokens=2)).result().finished


# --- item 4: grammars too costly to compile ----------------------------------------------

COSTLY_REGEX = "a{1000}{1000}"


def test_a_regex_too_costly_for_the_lexer_is_refused_at_the_call(engine: nb.Engine) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=COSTLY_REGEX))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex.*limit"):
        engine.generate("p", params)
    assert engine.num_unfinished_requests() == 0


def test_compiling_a_costly_regex_does_not_stall_another_stream(engine: nb.Engine) -> None:
    plain = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    alone = engine.generate("stream", plain).result(timeout=120).outputs[0].token_ids
    handle = engine.generate("stream", plain)
    seen: list[int] = []
    consumer = threading.Thread(
        target=lambda: seen.extend(len(o.outputs[0].token_ids) for o in handle), daemon=True
    )
    consumer.start()
    while not seen:  # the stream is under way
        consumer.join(0.01)
        assert consumer.is_alive() or seen
    before = seen[-1]
    costly = SamplingParams(structured_outputs=StructuredOutputsParams(regex=COSTLY_REGEX))
    with pytest.raises(ValueError, match="limit"):
        engine.generate("p", costly)
    during = seen[-1]
    consumer.join(timeout=120)
    assert not consumer.is_alive()
    # The compile ran on this thread while the core kept stepping the stream, which
    # finished as it does alone.
    assert during > before or during == len(alone), (before, during)
    assert handle.result().outputs[0].token_ids == alone


# --- item 5: long choice lists, deep schemas ---------------------------------------------


def test_3000_choices_work_and_the_output_is_one_of_them(engine: nb.Engine) -> None:
    choices = [f"option number {i}" for i in range(3000)]
    spec = StructuredOutputsParams(choice=choices)
    handles = [
        engine.generate("Pick:", SamplingParams(seed=s, max_tokens=30, structured_outputs=spec))
        for s in range(6)
    ]
    for h in handles:
        c = h.result(timeout=120).outputs[0]
        assert c.finish_reason == "stop" and c.text in choices, (c.finish_reason, c.text)


def test_choices_that_are_prefixes_of_each_other(engine: nb.Engine) -> None:
    choices = ["a", "ab", "abc", 'q"uote\\', "é😀", "new\nline"]
    spec = StructuredOutputsParams(choice=choices)
    texts = {
        engine.generate("x", SamplingParams(seed=s, max_tokens=10, structured_outputs=spec))
        .result(timeout=60)
        .outputs[0]
        .text
        for s in range(30)
    }
    assert texts <= set(choices) and len(texts) > 1


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("depth", [3000, 5000])
@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_nested_too_deep_is_a_value_error_naming_the_depth(
    depth: int, as_text: bool
) -> None:
    # The text is built by hand: json.dumps itself cannot encode it.
    text = '{"type": "array", "items": ' * (depth - 1) + '{"type": "integer"}' + "}" * (depth - 1)
    value = text if as_text else _nested(depth)
    with pytest.raises(ValueError, match=r"structured_outputs\.json is nested .*deep.*at most \d+"):
        StructuredOutputsParams(json=value)


def test_a_schema_within_the_depth_limit_works(engine: nb.Engine) -> None:
    from nbengine.structured_outputs import MAX_SCHEMA_DEPTH

    spec = StructuredOutputsParams(json=_nested(MAX_SCHEMA_DEPTH))
    out = engine.generate("x", SamplingParams(seed=0, max_tokens=8, structured_outputs=spec))
    assert out.result(timeout=60).outputs[0].finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match=f"at most {MAX_SCHEMA_DEPTH}"):
        StructuredOutputsParams(json=_nested(MAX_SCHEMA_DEPTH + 1))


def test_a_schema_that_contains_itself_is_refused() -> None:
    schema: dict = {"type": "object", "properties": {}}
    schema["properties"]["self"] = schema
    with pytest.raises((ValueError, TypeError), match=r"structured_outputs\.json"):
        StructuredOutputsParams(json=schema)
