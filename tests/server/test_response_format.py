"""``response_format`` and vLLM's structured-output extras through the real openai client:
every reply matches its constraint, and a bad one is a 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

import nbengine as nb

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

CONV = [{"role": "user", "content": "Tell me about a person."}]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def bad_request(call: Any, **kw: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call(**kw)
    return info.value


def test_json_schema_reply_is_valid_in_every_seeded_sample(client: openai.OpenAI) -> None:
    for seed in range(5):
        r = client.chat.completions.create(
            model="tiny",
            messages=CONV,
            temperature=1.0,
            seed=seed,
            max_tokens=800,
            response_format=JSON_SCHEMA_FORMAT,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_json_schema_reply_is_valid(client: openai.OpenAI) -> None:
    chunks = client.chat.completions.create(
        model="tiny",
        messages=CONV,
        temperature=1.0,
        seed=11,
        max_tokens=800,
        n=2,
        stream=True,
        response_format=JSON_SCHEMA_FORMAT,
    )
    texts = ["", ""]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_reply_parses(client: openai.OpenAI, engine: nb.Engine) -> None:
    # Any object: nothing bounds its strings, so a random model is nudged (logit_bias)
    # towards the tokens that close them; the grammar still decides what is allowed.
    bias = {str(engine.tokenizer.encode(t)[-1]): 8.0 for t in ('"', "}")}
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny",
            messages=CONV,
            temperature=1.0,
            seed=seed,
            max_tokens=800,
            logit_bias=bias,
            response_format={"type": "json_object"},
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_text_format_is_unconstrained(client: openai.OpenAI, engine: nb.Engine) -> None:
    kw: dict[str, Any] = dict(model="tiny", messages=CONV, max_tokens=6, temperature=0)
    r = client.chat.completions.create(
        response_format={"type": "text"}, extra_body={"ignore_eos": True}, **kw
    )
    want = engine.chat(
        CONV, nb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ).result(timeout=60)
    assert r.choices[0].message.content == want.outputs[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_guided_choice_and_regex_on_completions(client: openai.OpenAI, stream: bool) -> None:
    choices = ["yes", "no", "maybe later"]
    pattern = r"[0-9]{3}-[a-z]{2}"
    for seed in range(4):
        kw: dict[str, Any] = dict(
            model="tiny", prompt="Answer:", temperature=1.0, seed=seed, max_tokens=40
        )
        for extra, check in (
            ({"guided_choice": choices}, lambda t: t in choices),
            ({"guided_regex": pattern}, lambda t: re.fullmatch(pattern, t)),
            ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
        ):
            if stream:
                parts = client.completions.create(stream=True, extra_body=extra, **kw)
                text = "".join(c.choices[0].text for c in parts if c.choices)
            else:
                text = client.completions.create(extra_body=extra, **kw).choices[0].text
            assert check(text), (extra, text)


def test_guided_json_grammar_and_structured_outputs_on_both_routes(
    client: openai.OpenAI,
) -> None:
    kw: dict[str, Any] = dict(model="tiny", temperature=1.0, seed=3, max_tokens=800)
    text = (
        client.completions.create(prompt="JSON:", extra_body={"guided_json": SCHEMA}, **kw)
        .choices[0]
        .text
    )
    jsonschema.validate(json.loads(text), SCHEMA)
    text = (
        client.completions.create(
            prompt="JSON:", extra_body={"guided_json": json.dumps(SCHEMA)}, **kw
        )
        .choices[0]
        .text
    )
    jsonschema.validate(json.loads(text), SCHEMA)
    for extra in (
        {"guided_grammar": 'root ::= "a" | "bc"'},
        {"structured_outputs": {"grammar": 'root ::= "a" | "bc"'}},
    ):
        r = client.chat.completions.create(messages=CONV, extra_body=extra, **kw)
        assert r.choices[0].message.content in ("a", "bc")
    r = client.chat.completions.create(
        messages=CONV,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        **kw,
    )
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert not re.search(r"\s", outside_strings), text


BAD_CHAT = [
    # (the body's extra fields, the param the 400 names)
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
        "response_format.json_schema.schema",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        "response_format.json_schema.name",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA, "bogus": 1},
            }
        },
        "response_format.json_schema.bogus",
    ),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    (
        {"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}},
        "response_format.json_schema",
    ),
    ({"response_format": "json"}, "response_format"),
    # Two constraints at once: the later in the order response_format, structured_outputs,
    # guided_json, guided_regex, guided_choice, guided_grammar is named.
    (
        {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
        "guided_regex",
    ),
    ({"guided_choice": ["a"], "guided_json": SCHEMA}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": {"type": "frobnicate"}}}, "structured_outputs.json"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    # Still unsupported: refused, not ignored.
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_CHAT)
def test_a_bad_constraint_is_400_naming_the_field(
    client: openai.OpenAI, engine: nb.Engine, extra: dict[str, Any], param: str
) -> None:
    err = bad_request(
        client.chat.completions.create,
        model="tiny",
        messages=CONV,
        max_tokens=5,
        extra_body=extra,
    )
    assert err.param == param, err.body
    assert param in err.body["message"], err.body
    assert isinstance(err.body, dict) and set(err.body) == {"message", "type", "param", "code"}
    assert err.body["type"] == "invalid_request_error"
    assert engine.num_unfinished_requests() == 0  # nothing was started


def test_bad_constraints_on_completions_name_the_field(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny", prompt="Hi", max_tokens=5)
    for extra, param in (
        ({"guided_regex": "(("}, "guided_regex"),
        ({"guided_json": {"type": "frobnicate"}}, "guided_json"),
        ({"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "guided_choice"),
        # response_format is a chat field: refused on /v1/completions, as before.
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ):
        err = bad_request(client.completions.create, extra_body=extra, **kw)
        assert err.param == param, err.body
    # The server serves on.
    r = client.completions.create(extra_body={"guided_choice": ["ok"]}, **kw)
    assert r.choices[0].text == "ok"
