"""Tool calls through the real ``openai`` client (docs/serving.md, "Tools"): named and
required tool choices always give calls whose arguments validate, streamed or not; auto
replies are parsed by the server's parser (the tiny model is made to write a call by a
scripted logits processor, tests/support/scripted.py); malformed calls come back as
content; tool results go back through the template; a client that leaves mid-call
aborts its request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from model import chat_templates as T  # tests/model/chat_templates.py

import nbengine as nb
from nbengine.frontend.chat import render_chat

from support.requests import wait_until
from support.scripted import eos_id, scripted

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "maxLength": 6}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "time", "parameters": TIME}},
]
SCHEMAS = {"weather": WEATHER, "time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
SEEDS = range(4)


@pytest.fixture(scope="module")
def tool_server(engine: nb.Engine) -> Iterator[Any]:
    """The engine served with Qwen2.5's template: it renders tools, and its
    ``<tool_call>`` format makes hermes the server's parser."""
    with engine.serve(port=0, model_name="tiny", chat_template=T.QWEN_2_5) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(tool_server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url, api_key="unused", max_retries=0, timeout=120)


def _streamed(chunks: Any) -> tuple[dict[int, dict[str, Any]], str, str | None, int]:
    """The calls (by index) and content a stream adds up to, its finish_reason, and how
    many chunks carried tool_calls."""
    calls: dict[int, dict[str, Any]] = {}
    content = ""
    finish = None
    with_calls = 0
    for chunk in chunks:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            with_calls += bool(ch.delta.tool_calls)
            for tc in ch.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert call["id"] is None, "an id is sent once, in the call's first entry"
                    call["id"] = tc.id
                    assert tc.type == "function" and tc.function.arguments == ""
                if tc.function.name:
                    call["name"] += tc.function.name
                call["arguments"] += tc.function.arguments or ""
    return calls, content, finish, with_calls


def _as_tuples(calls: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_gives_a_call_that_validates(
    client: openai.OpenAI, stream: bool
) -> None:
    for seed in SEEDS:
        kw = dict(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "weather"}},
            temperature=1.0,
            seed=seed,
            max_tokens=300,
        )
        if stream:
            calls, content, finish, with_calls = _streamed(
                client.chat.completions.create(stream=True, **kw)
            )
            assert content == "" and finish == "tool_calls"
            assert list(calls) == [0] and calls[0]["name"] == "weather"
            assert calls[0]["id"].startswith("call_")
            assert with_calls > 2  # the arguments arrive in pieces as they are written
            args = json.loads(calls[0]["arguments"])
        else:
            r = client.chat.completions.create(**kw)
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls"
            assert msg.content is None and len(msg.tool_calls) == 1
            assert msg.tool_calls[0].function.name == "weather"
            assert msg.tool_calls[0].id.startswith("call_")
            args = json.loads(msg.tool_calls[0].function.arguments)
        jsonschema.validate(args, WEATHER)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_gives_calls_that_validate(
    client: openai.OpenAI, stream: bool, parallel: bool
) -> None:
    for seed in SEEDS:
        kw = dict(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            temperature=1.0,
            seed=seed,
            max_tokens=400,
        )
        if stream:
            by_index, content, finish, _ = _streamed(
                client.chat.completions.create(stream=True, **kw)
            )
            assert content == "" and finish == "tool_calls"
            assert list(by_index) == list(range(len(by_index)))
            calls = [(c["name"], json.loads(c["arguments"])) for c in by_index.values()]
        else:
            r = client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "tool_calls"
            assert r.choices[0].message.content is None
            calls = _as_tuples(r.choices[0].message.tool_calls)
        assert len(calls) >= 1
        if not parallel:
            assert len(calls) == 1
        for name, args in calls:
            jsonschema.validate(args, SCHEMAS[name])


@pytest.fixture
def script(engine: nb.Engine, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``script(text)``: the engine's next replies write ``text`` and stop (the server
    starts each request from the engine's default sampling parameters)."""
    base = engine.get_default_sampling_params()

    def set_script(text: str, then: int | None = None) -> None:
        proc = scripted(engine.tokenizer, text, eos_id(engine.tokenizer) if then is None else then)
        monkeypatch.setattr(
            engine, "get_default_sampling_params", lambda: base.replace(logits_processors=[proc])
        )

    return set_script


CALL_TEXT = (
    'Checking.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 2, '
    '"metric": true}}\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": {"tz": "CET"}}'
    "\n</tool_call>"
)
WANT_CALLS = [("weather", {"city": "Oslo", "days": 2, "metric": True}), ("time", {"tz": "CET"})]


def test_auto_parses_the_models_own_calls_streamed_and_not(
    client: openai.OpenAI, script: Any
) -> None:
    script(CALL_TEXT)
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert _as_tuples(msg.tool_calls) == WANT_CALLS
    assert msg.content == "Checking."
    assert r.choices[0].finish_reason == "tool_calls"
    assert len({c.id for c in msg.tool_calls}) == 2
    calls, content, finish, _ = _streamed(client.chat.completions.create(stream=True, **kw))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == WANT_CALLS
    assert content == "Checking." and finish == "tool_calls"
    # The openai client's own stream accumulator puts the same calls together.
    with client.chat.completions.stream(**kw) as events:
        final = events.get_final_completion()
    assert _as_tuples(final.choices[0].message.tool_calls) == WANT_CALLS
    assert final.choices[0].message.content == "Checking."
    # parallel_tool_calls=false: the first call only.
    one = client.chat.completions.create(parallel_tool_calls=False, **kw)
    assert _as_tuples(one.choices[0].message.tool_calls) == WANT_CALLS[:1]


@pytest.mark.parametrize(
    "text",
    [
        'Hm.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"\n</tool_call>\n',
        ' <tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        'Hm. <tool_call>\n{"name": "weather", "arguments": {"city": "Os',  # never closed
    ],
)
def test_a_malformed_call_is_content_not_an_error(
    client: openai.OpenAI, script: Any, text: str
) -> None:
    script(text)
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == text.strip()
    assert r.choices[0].finish_reason == "stop"
    calls, content, finish, _ = _streamed(client.chat.completions.create(stream=True, **kw))
    assert calls == {} and content == text.strip() and finish == "stop"


def test_tool_choice_none_leaves_the_reply_as_content(client: openai.OpenAI, script: Any) -> None:
    script(CALL_TEXT)
    r = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=200
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == CALL_TEXT and r.choices[0].finish_reason == "stop"


def test_tool_results_go_back_through_the_template(
    client: openai.OpenAI, engine: nb.Engine
) -> None:
    args = {"city": "Oslo", "days": 2, "metric": True}
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": json.dumps(args)},
    }
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=3)
    # The template got the arguments as a dict (Hugging Face's convention), not as text.
    hf_call = {**call, "function": {"name": "weather", "arguments": args}}
    want = render_chat(
        engine.tokenizer,
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [hf_call]}, history[2]],
        chat_template=T.QWEN_2_5,
        tools=TOOLS,
    )
    assert '"arguments": {"city": "Oslo"' in want.text and "<tool_response>" in want.text
    assert r.usage.prompt_tokens == len(want.token_ids)


def test_a_client_leaving_mid_call_aborts_the_request(
    client: openai.OpenAI, engine: nb.Engine, script: Any
) -> None:
    # A named call whose argument never ends: {"tz": "aaaa...
    a = engine.tokenizer.encode("a", add_special_tokens=False)
    assert len(a) == 1
    script('{"tz": "', then=a[0])
    rid = "leave-mid-call"
    schema_tools = [
        {
            "type": "function",
            "function": {
                "name": "note",
                "parameters": {
                    "type": "object",
                    "properties": {"tz": {"type": "string"}},
                    "required": ["tz"],
                },
            },
        }
    ]
    stream = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=schema_tools,
        tool_choice={"type": "function", "function": {"name": "note"}},
        max_tokens=4000,
        stream=True,
        extra_headers={"X-Request-Id": rid},
    )
    got = []
    for chunk in stream:
        got.append(chunk)
        if len(got) == 5:
            break
    stream.close()
    assert any(c.choices and c.choices[0].delta.tool_calls for c in got)
    engine_id = f"server:{rid}"

    def final() -> str | None:
        stats = engine.request_stats()
        rows = stats[stats["request_id"] == engine_id]
        reason = rows.iloc[-1]["finish_reason"] if not rows.empty else None
        return reason if isinstance(reason, str) else None

    wait_until(lambda: final() is not None, what="the engine ends it")
    assert final() == "abort"
    stats = engine.request_stats()
    assert stats[stats["request_id"] == engine_id].iloc[-1]["output_tokens"] < 4000


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "time", "arguments": "{oops"},
                            }
                        ],
                    },
                ]
            },
            "messages",
        ),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(
    client: openai.OpenAI, body: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", **{"messages": ASK, "max_tokens": 2, **body})
    assert info.value.body["param"] == param


def test_auto_without_a_parser_is_400(server: Any) -> None:
    """The shared server's template shows no tool format: "auto" cannot be parsed."""
    plain = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        plain.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=2)
    assert info.value.body["param"] == "tool_choice"
    assert "tool_call_parser" in info.value.body["message"]
    # Named choices need no parser.
    r = plain.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "time"}},
    )
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), TIME)


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("llama3_json", '{"name": "time", "parameters": {"tz": "CET"}}'),
        ("mistral", '[TOOL_CALLS][{"name": "time", "arguments": {"tz": "CET"}}]'),
    ],
)
def test_the_parser_can_be_chosen(engine: nb.Engine, script: Any, parser: str, text: str) -> None:
    script(text)
    with engine.serve(port=0, model_name="tiny", tool_call_parser=parser) as srv:
        c = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=100)
    assert _as_tuples(r.choices[0].message.tool_calls) == [("time", {"tz": "CET"})]
    assert r.choices[0].finish_reason == "tool_calls"


def test_an_unknown_parser_is_refused_at_serve(engine: nb.Engine) -> None:
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        engine.serve(port=0, tool_call_parser="qwen")


def test_a_named_reply_with_no_text_is_no_call() -> None:
    """A named choice's reply is its arguments: none written (cut before its first
    token), no call, streamed or not."""
    from nbengine.outputs import CompletionOutput
    from nbengine.server.tool_calls import tool_setup

    setup = tool_setup(TOOLS, {"type": "function", "function": {"name": "time"}}, True, None)
    empty = CompletionOutput(0, "", [], finish_reason="abort")
    assert setup.message(empty) == ({"role": "assistant", "content": ""}, "abort")
    stream = setup.stream()
    assert stream.delta("", False) == {} and stream.delta("", True) == {}
    assert stream.finish_reason("abort") == "abort"
    got = stream.delta('{"tz"', False)["tool_calls"]
    assert got[0]["function"] == {"name": "time", "arguments": ""} and got[1]["function"] == {
        "arguments": '{"tz"'
    }
