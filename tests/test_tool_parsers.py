"""The tool-call parsers on literal model outputs (nbengine/tool_parsers.py): calls and
content of a finished reply, the same when streamed in any chunking, and malformed calls
returned as content."""

from __future__ import annotations

import json
import random

import pytest

from nbengine.tool_parsers import (
    JsonToolCallsParser,
    ToolCallStream,
    ToolParser,
    default_parser,
    get_parser,
    tool_choice_schema,
)

W = {"city": "Paris", "unit": "C"}
T = {"tz": "Europe/Paris"}

# (parser, text, [(name, args)], content)
CASES = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "weather", "arguments": '
        + json.dumps(W)
        + "}\n</tool_call>",
        [("weather", W)],
        "Let me check.",
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "weather", "arguments": ' + json.dumps(W) + "}\n</tool_call>\n"
        '<tool_call>\n{"name": "time", "arguments": ' + json.dumps(T) + "}\n</tool_call>",
        [("weather", W), ("time", T)],
        None,
    ),
    (
        "hermes",
        "No tools needed: 2 < 3 and <b>bold</b>.",
        [],
        "No tools needed: 2 < 3 and <b>bold</b>.",
    ),
    # A block left open at the end still counts when its body is a call (vLLM's rule).
    ("hermes", '<tool_call>\n{"name": "time", "arguments": {}}', [("time", {})], None),
    (
        "hermes",
        '<tool_call>{"name": "time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>',
        [("time", {"tz": "UTC"})],
        None,
    ),
    (
        "llama3_json",
        '{"name": "weather", "parameters": ' + json.dumps(W) + "}",
        [("weather", W)],
        None,
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "weather", "parameters": '
        + json.dumps(W)
        + '}; {"name": "time", "parameters": '
        + json.dumps(T)
        + "}",
        [("weather", W), ("time", T)],
        None,
    ),
    (
        "llama3_json",
        "The weather in Paris is {usually} fine.",
        [],
        "The weather in Paris is {usually} fine.",
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "weather", "arguments": '
        + json.dumps(W)
        + '}, {"name": "time", "arguments": '
        + json.dumps(T)
        + "}]",
        [("weather", W), ("time", T)],
        "Sure.",
    ),
    (
        "mistral",
        "[TOOL_CALLS]weather[ARGS]" + json.dumps(W) + "[TOOL_CALLS]time[ARGS]" + json.dumps(T),
        [("weather", W), ("time", T)],
        None,
    ),
    ("mistral", "[TOOL_CALLS]time[CALL_ID]a1b2c3d4e[ARGS]{}", [("time", {})], None),
    (
        "mistral",
        "Plain [text] with brackets [ARGS] only.",
        [],
        "Plain [text] with brackets [ARGS] only.",
    ),
]

# Calls complete before a part that is not one are kept; the rest is content.
PARTLY = [
    ("mistral", '[TOOL_CALLS][{"name": "time", "arguments": {}}, 5]', [("time", {})], ", 5]"),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "time", "arguments": {}}, {"name": "w',
        [("time", {})],
        ', {"name": "w',
    ),
    ("llama3_json", '{"name": "time", "parameters": {}}; oops', [("time", {})], "; oops"),
    (
        "hermes",
        '<tool_call>{"name": "time"}</tool_call><tool_call>{oops}</tool_call>',
        [("time", {})],
        "<tool_call>{oops}</tool_call>",
    ),
]

MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}\n</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>'),  # not an object
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": '),  # cut off
    ("llama3_json", '{"name": "weather", "parameters": {"city": "Par'),
    ("llama3_json", '{"nom": "weather"}'),
    ("mistral", '[TOOL_CALLS][{"name": "weather", "arguments": 5}]'),
    ("mistral", "[TOOL_CALLS]weather[ARGS]{oops}"),
    ("mistral", "[TOOL_CALLS] what?"),
]


def _calls(parser: ToolParser, text: str) -> tuple[list[tuple[str, object]], str | None]:
    got = parser.extract(text)
    return [(c.name, c.args) for c in got.tool_calls], got.content


def _streamed(parser: ToolParser, text: str, rng: random.Random | None) -> tuple[list, str | None]:
    stream = ToolCallStream(parser)
    pieces: list[str] = []
    calls = []
    i = 0
    while i < len(text):
        step = 1 if rng is None else rng.randint(1, 7)
        d = stream.feed(text[i : i + step])
        pieces.append(d.content)
        calls += d.tool_calls
        i += step
    d = stream.feed("", final=True)
    pieces.append(d.content)
    calls += d.tool_calls
    return [(c.name, c.args) for c in calls], "".join(pieces) or None


@pytest.mark.parametrize(("name", "text", "calls", "content"), CASES + PARTLY)
def test_a_finished_reply_splits_into_calls_and_content(
    name: str, text: str, calls: list, content: str | None
) -> None:
    assert _calls(get_parser(name), text) == (calls, content)


@pytest.mark.parametrize(
    ("name", "text", "calls", "content"), CASES + PARTLY + [(n, t, [], t) for n, t in MALFORMED]
)
def test_streaming_in_any_chunking_gives_the_finished_replys_calls(
    name: str, text: str, calls: list, content: str | None
) -> None:
    parser = get_parser(name)
    want = _calls(parser, text)
    assert _streamed(parser, text, None) == want  # a character at a time
    for seed in range(5):
        assert _streamed(parser, text, random.Random(seed)) == want


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_a_malformed_call_is_content(name: str, text: str) -> None:
    assert _calls(get_parser(name), text) == ([], text.strip())


def test_streamed_calls_come_out_as_soon_as_they_are_complete() -> None:
    stream = ToolCallStream(get_parser("hermes"))
    first = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    assert stream.feed(first[:-1]).tool_calls == []
    got = stream.feed(first[-1:] + "\n<tool_call>{")
    assert [c.name for c in got.tool_calls] == ["a"] and got.content == ""
    assert got.tool_calls[0].id.startswith("call_")


def test_the_required_grammar_reply_parses() -> None:
    text = (
        '[{"name": "weather", "arguments": {"city": "Paris"}}, {"name": "time", "arguments": {}}]'
    )
    assert _calls(JsonToolCallsParser(parallel=True), text) == (
        [("weather", {"city": "Paris"}), ("time", {})],
        None,
    )
    assert _calls(JsonToolCallsParser(parallel=False), '{"name": "time", "arguments": {}}') == (
        [("time", {})],
        None,
    )
    assert _streamed(JsonToolCallsParser(True), text, random.Random(1))[0] == [
        ("weather", {"city": "Paris"}),
        ("time", {}),
    ]


def test_default_parser_from_the_template() -> None:
    from model import chat_templates as T  # tests/model/chat_templates.py: real templates

    assert default_parser(T.QWEN_2_5) == "hermes"
    assert default_parser(T.QWEN_3) == "hermes"
    assert default_parser(T.LLAMA_3_2) == "llama3_json"
    assert default_parser("{{ '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"
    assert default_parser(T.MISTRAL) is None  # v0.1 has no tool format
    assert default_parser(T.GEMMA) is None
    assert default_parser(None) is None


def test_unknown_parser_is_a_value_error_naming_the_choices() -> None:
    with pytest.raises(
        ValueError, match=r"tool_call_parser must be one of \['hermes', 'llama3_json', 'mistral'\]"
    ):
        get_parser("qwen")


def test_tool_choice_schema_names_an_unknown_function() -> None:
    with pytest.raises(ValueError, match="'nope'"):
        tool_choice_schema([{"name": "a"}], "nope", True)


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_streaming_equals_the_finished_reply_on_cut_and_garbled_texts(name: str) -> None:
    """The invariant behind streaming (nbengine/tool_parsers.py): for any text, cut
    anywhere and followed by anything, the stream adds up to ``extract``."""
    parser = get_parser(name)
    rng = random.Random(7)
    texts = [t for n, t, _c, _x in CASES + PARTLY if n == name] + [
        t for n, t in MALFORMED if n == name
    ]
    noise = [*'{}[]",:; <>/\\ab\n', "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]"]
    noise += ["<|python_tag|>", '{"name": "f"}', '{"name": "g", "arguments": {}}', "g[ARGS]{}"]
    for text in texts:
        for cut in range(0, len(text) + 1, 3):
            tail = "".join(rng.choice(noise) for _ in range(rng.randint(0, 12)))
            garbled = text[:cut] + tail
            assert _streamed(parser, garbled, rng) == _calls(parser, garbled), garbled
