"""The served engine through the real ``openai`` client: what an application sees."""

from __future__ import annotations

import pytest

import nbengine as nb

from support.requests import wait_until

openai = pytest.importorskip("openai")


def final_status(engine: nb.Engine, request_id: str) -> str | None:
    """The finish reason of the latest incarnation of ``request_id`` (None while live)."""
    stats = engine.request_stats()
    rows = stats[stats["request_id"] == request_id]
    reason = rows.iloc[-1]["finish_reason"] if not rows.empty else None
    return reason if isinstance(reason, str) else None  # NaN while it runs


CONV = [
    {"role": "system", "content": "You tell short stories."},
    {"role": "user", "content": "Once upon a time"},
]


@pytest.fixture(scope="module")
def client(server: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_matches_the_engine(client: openai.OpenAI, engine: nb.Engine) -> None:
    r = client.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    want = engine.generate(
        "Once upon a time", nb.SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    ).result(timeout=60)
    assert r.object == "text_completion" and r.model == "tiny"
    assert r.choices[0].text == want.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), 7)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_completion_of_token_ids_with_logprobs_and_n(
    client: openai.OpenAI, engine: nb.Engine
) -> None:
    ids = engine.tokenizer.encode("The quick brown fox")
    r = client.completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=4,
        n=3,
        seed=7,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(ids)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    # The seed makes the same request give the same samples.
    again = client.completions.create(
        model="tiny", prompt=ids, max_tokens=4, n=3, seed=7, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_stop_string_ends_the_completion(client: openai.OpenAI, engine: nb.Engine) -> None:
    free = (
        engine.generate(
            "Once upon a time", nb.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        )
        .result(timeout=60)
        .outputs[0]
        .text
    )
    stop = free[3:5]
    assert stop.strip()
    r = client.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[: free.index(stop)]


def test_chat_matches_engine_chat(client: openai.OpenAI, engine: nb.Engine) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=CONV,
        max_completion_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    want = engine.chat(
        CONV, nb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ).result(timeout=60)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), 6)


def test_chat_logprobs_and_vllm_extras(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=CONV,
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        top_p=0.9,
        extra_body={
            "top_k": 20,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "min_tokens": 5,
            "ignore_eos": True,
        },
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
    assert r.usage.completion_tokens == 5
    # Each top list is ordered, and the sampled token's logprob is a real log-probability.
    for t in content:
        assert t.logprob <= 0
        assert [e.logprob for e in t.top_logprobs] == sorted(
            (e.logprob for e in t.top_logprobs), reverse=True
        )


def test_streamed_completion_adds_up_to_the_full_one(client: openai.OpenAI) -> None:
    kw = dict(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_chat_adds_up_and_reports_usage(client: openai.OpenAI) -> None:
    kw = dict(
        model="tiny", messages=CONV, max_tokens=15, temperature=0, extra_body={"ignore_eos": True}
    )
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 15
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_closing_a_stream_aborts_its_request_and_frees_the_id(
    client: openai.OpenAI, engine: nb.Engine, route: str
) -> None:
    rid = f"close-me-{route}"
    kw = dict(
        model="tiny",
        max_tokens=4000,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": rid},
    )
    if route == "chat":
        stream = client.chat.completions.create(messages=CONV, **kw)
    else:
        stream = client.completions.create(prompt="Once upon a time", **kw)
    got = 0
    for _chunk in stream:
        got += 1
        if got == 4:
            break
    stream.close()  # the client hangs up mid-reply
    engine_id = f"server:{rid}"
    wait_until(lambda: final_status(engine, engine_id) is not None, what="the engine ends it")
    assert final_status(engine, engine_id) == "abort"
    stats = engine.request_stats()
    assert stats[stats["request_id"] == engine_id].iloc[-1]["output_tokens"] < 4000
    # The id is free at once: for the server's next request and for the notebook.
    r = client.completions.create(
        model="tiny",
        prompt="again",
        max_tokens=2,
        extra_headers={"X-Request-Id": rid},
        extra_body={"ignore_eos": True},
    )
    assert r.id == rid and r.usage.completion_tokens == 2
    out = engine.generate(
        "again", nb.SamplingParams(max_tokens=2, ignore_eos=True), request_id=engine_id
    ).result(timeout=60)
    assert len(out.outputs[0].token_ids) == 2


def test_an_id_in_use_is_refused(client: openai.OpenAI, engine: nb.Engine) -> None:
    h = engine.generate(
        "x", nb.SamplingParams(max_tokens=100_000, ignore_eos=True), request_id="server:busy"
    )
    try:
        with pytest.raises(openai.ConflictError):
            client.completions.create(
                model="tiny", prompt="x", max_tokens=2, extra_headers={"X-Request-Id": "busy"}
            )
    finally:
        h.cancel()


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"


def test_bad_parameter_is_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=CONV, temperature=-0.5)
    assert info.value.body["param"] == "temperature"
    assert "temperature" in info.value.body["message"]


def test_streamed_n_choices_each_add_up(client: openai.OpenAI) -> None:
    kw = dict(
        model="tiny", messages=CONV, max_tokens=6, n=2, seed=11, extra_body={"ignore_eos": True}
    )
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    texts = {0: "", 1: ""}
    finish = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 12 == full.usage.completion_tokens
