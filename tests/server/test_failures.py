"""What a client sees when its request cannot be served (docs/serving.md, "Errors").

- The engine gone or the server stopping: 503, or mid-stream a last error event and then
  ``data: [DONE]`` (never a cut connection, never a 500).
- A prompt the KV cache can never hold: 400 naming the limit, the same streamed or not,
  while ``/health`` stays 200.
- Hostile JSON (nested 100,000 deep, odd digits, huge numbers, NaN): 400 naming the field.
- A model without a chat template: 400 saying how to give the server one.

No input here gives a 500.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import nbengine as nb
from nbengine.server.app import live_request_ids
from nbengine.testing import TINY_LLAMA

from support.requests import WAIT_S, wait_until

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

SMALL_ENGINE = dict(num_kv_blocks=1024, block_size=16, max_num_seqs=8)
LONG = {"prompt": "Once", "max_tokens": 8000, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Once upon a time"}]


def final_status(engine: nb.Engine, request_id: str) -> str | None:
    """The finish reason of the latest incarnation of ``request_id`` (None while live)."""
    stats = engine.request_stats()
    rows = stats[stats["request_id"] == request_id]
    reason = rows.iloc[-1]["finish_reason"] if not rows.empty else None
    return reason if isinstance(reason, str) else None  # NaN while it runs


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


def _events(lines: Iterator[str]) -> list[str]:
    """The ``data:`` payloads of an SSE stream, in order."""
    return [line[6:] for line in lines if line.startswith("data: ")]


def _post_in_thread(
    url: str, body: dict[str, Any], request_id: str
) -> Callable[[], httpx.Response]:
    """POST ``body`` on a thread; returns a function that joins it and gives the response."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["r"] = httpx.post(
                url, json=body, timeout=WAIT_S, headers={"X-Request-Id": request_id}
            )
        except BaseException as exc:  # reported by the join
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join() -> httpx.Response:
        t.join(WAIT_S)
        assert not t.is_alive(), "the request did not return"
        if "exc" in box:
            raise box["exc"]
        return box["r"]

    return join


# ------------------------------------------------------- the engine gone, the server stopping


def test_engine_shutdown_mid_stream_sends_an_error_event_then_done(chat_model: Path) -> None:
    eng = nb.Engine(str(chat_model), **SMALL_ENGINE)
    srv = eng.serve(port=0, max_tokens=8000)
    try:
        with httpx.stream(
            "POST", srv.url + "/completions", timeout=WAIT_S, json={**LONG, "stream": True}
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            eng.shutdown()
            events = _events(lines)  # the stream ends, it is not cut
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_dead" and "shut down" in err["message"], err
    finally:
        srv.stop()
        eng.shutdown()


def test_engine_shutdown_mid_chat_stream_raises_the_error_in_the_openai_client(
    chat_model: Path,
) -> None:
    eng = nb.Engine(str(chat_model), **SMALL_ENGINE)
    srv = eng.serve(port=0, max_tokens=8000)
    client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=WAIT_S)
    try:
        stream = client.chat.completions.create(
            model=srv.model_name,
            messages=CHAT,
            max_tokens=8000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)
        eng.shutdown()
        with pytest.raises(openai.APIError) as info:
            for _ in chunks:
                pass
        assert isinstance(info.value.body, dict), info.value  # an error event, not a cut
        assert info.value.body["code"] == "engine_dead"
    finally:
        srv.stop()
        eng.shutdown()


def test_engine_shutdown_during_a_non_streaming_request_is_503(chat_model: Path) -> None:
    eng = nb.Engine(str(chat_model), **SMALL_ENGINE)
    srv = eng.serve(port=0, max_tokens=8000)
    try:
        join = _post_in_thread(srv.url + "/completions", LONG, "waits")
        wait_until(lambda: live_request_ids(srv.app) == ["server:waits"], what="the request")
        eng.shutdown()
        err = _error(join(), 503)
        assert err["code"] == "engine_dead"
    finally:
        srv.stop()
        eng.shutdown()


def test_stopping_the_server_answers_a_waiting_request_503_and_aborts_it(
    engine: nb.Engine,
) -> None:
    srv = engine.serve(port=0, max_tokens=8000)
    join = _post_in_thread(srv.url + "/completions", LONG, "stopped")
    wait_until(lambda: live_request_ids(srv.app) == ["server:stopped"], what="the request")
    srv.stop()
    err = _error(join(), 503)
    assert err["code"] == "server_stopping", err
    wait_until(lambda: final_status(engine, "server:stopped") is not None, what="the abort")
    assert final_status(engine, "server:stopped") == "abort"


def test_stopping_the_server_ends_a_stream_with_an_error_event_then_done(
    engine: nb.Engine,
) -> None:
    srv = engine.serve(port=0, max_tokens=8000)
    with httpx.stream(
        "POST",
        srv.url + "/chat/completions",
        timeout=WAIT_S,
        headers={"X-Request-Id": "cut-chat"},
        json={"messages": CHAT, "max_tokens": 8000, "ignore_eos": True, "stream": True},
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        srv.stop()
        events = _events(lines)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "server_stopping"
    wait_until(lambda: final_status(engine, "server:cut-chat") is not None, what="the abort")
    assert final_status(engine, "server:cut-chat") == "abort"


# ----------------------------------------------------------- a prompt the KV cache cannot hold


@pytest.fixture(scope="module")
def small_pool(chat_model: Path) -> Iterator[Any]:
    """A server on an engine whose KV cache holds 64 tokens (4 blocks of 16)."""
    with nb.Engine(str(chat_model), num_kv_blocks=4, block_size=16) as eng:
        with eng.serve(port=0) as srv:
            yield srv


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_the_kv_cache_cannot_hold_is_400_on_both_paths(
    small_pool: Any, stream: bool
) -> None:
    r = httpx.post(
        small_pool.url + "/completions",
        timeout=WAIT_S,
        json={"prompt": list(range(1, 100)), "max_tokens": 2, "stream": stream},
    )
    err = _error(r, 400)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded", err
    assert "99 tokens" in err["message"] and "64 tokens" in err["message"], err
    r = httpx.post(
        small_pool.url + "/chat/completions",
        timeout=WAIT_S,
        json={"messages": [{"role": "user", "content": "word " * 100}], "stream": stream},
    )
    err = _error(r, 400)
    assert err["param"] == "messages" and "64 tokens" in err["message"], err
    assert httpx.get(small_pool.url.removesuffix("/v1") + "/health").status_code == 200
    # A prompt that fits is served.
    ok = httpx.post(
        small_pool.url + "/completions", timeout=WAIT_S, json={"prompt": [1, 2], "max_tokens": 2}
    )
    assert ok.status_code == 200, ok.text


def _one_request_fails(
    server: Any, request_id: str, stream: bool
) -> tuple[httpx.Response, dict[str, Any]]:
    """POST a completion; return the response and its error (the body's, or the stream's
    last event before [DONE])."""
    body = {"prompt": "Once", "max_tokens": 4, "stream": stream}
    r = httpx.post(
        server.url + "/completions",
        json=body,
        timeout=WAIT_S,
        headers={"X-Request-Id": request_id},
    )
    if not stream:
        return r, r.json()["error"]
    assert r.status_code == 200, r.text
    events = _events(iter(r.text.splitlines()))
    assert events[-1] == "[DONE]", events
    return r, json.loads(events[-2])["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_core_ignores_is_that_requests_400_not_engine_dead(
    server: Any, engine: nb.Engine, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """A request the core finishes FINISHED_IGNORED (it can never be scheduled: what a
    replica with a smaller pool does) is a 400 with the core's reason, streamed or not."""
    scheduler = engine._core.scheduler
    real = scheduler._why_never_fits

    def never_fits(request: Any) -> str | None:
        if request.request_id.startswith("server:ignored"):
            return "prompt of 2 tokens needs 9 KV blocks but the cache has only 1"
        return real(request)

    monkeypatch.setattr(scheduler, "_why_never_fits", never_fits)
    r, err = _one_request_fails(server, "ignored", stream)
    assert r.status_code == (200 if stream else 400), r.text
    assert err["code"] == "context_length_exceeded" and "KV blocks" in err["message"], err
    assert httpx.get(server.url.removesuffix("/v1") + "/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_that_fails_alone_gets_its_own_error_not_engine_dead(
    server: Any, engine: nb.Engine, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """A request the core refuses alone (FINISHED_ERROR, the engine serves on) gets its
    own message, streamed or not; the next request is served."""
    core = engine._core
    real = core.add_request

    def refuse(request: Any) -> None:
        if request.request_id.startswith("server:fails"):
            raise ValueError("this request was refused by the core")
        real(request)

    monkeypatch.setattr(core, "add_request", refuse)
    r, err = _one_request_fails(server, "fails", stream)
    assert r.status_code == (200 if stream else 500), r.text
    assert err["code"] == "request_failed" and "refused by the core" in err["message"], err
    assert engine.is_alive
    ok = httpx.post(server.url + "/completions", json={"prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


# ------------------------------------------------------------------------------ hostile JSON


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _post_raw(url: str, body: str) -> httpx.Response:
    return httpx.post(
        url, content=body.encode(), timeout=WAIT_S, headers={"content-type": "application/json"}
    )


@pytest.mark.parametrize("depth", [100_000, 500, 65])
def test_deeply_nested_json_is_400_naming_the_field(server: Any, depth: int) -> None:
    err = _error(_post_raw(server.url + "/completions", f'{{"prompt": {_nested(depth)}}}'), 400)
    assert err["param"] == "prompt" and "nested" in err["message"], err
    body = (
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
        f'"chat_template_kwargs": {{"x": {_nested(depth)}}}}}'
    )
    err = _error(_post_raw(server.url + "/chat/completions", body), 400)
    assert err["param"] == "chat_template_kwargs" and "nested" in err["message"], err


def test_json_nested_within_the_bound_is_served(server: Any) -> None:
    body = (
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
        f'"chat_template_kwargs": {{"x": {_nested(20)}}}}}'
    )
    r = _post_raw(server.url + "/chat/completions", body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("key", ["²", "٣", "9" * 5000, "-1", "1.5", " 7", "0x10", ""])
def test_a_logit_bias_key_that_is_not_a_token_id_is_400(server: Any, key: str) -> None:
    r = httpx.post(
        server.url + "/completions",
        timeout=WAIT_S,
        json={"prompt": "Once", "max_tokens": 2, "logit_bias": {key: 1.0}},
    )
    err = _error(r, 400)
    assert err["param"] == "logit_bias" and "token id" in err["message"], err
    assert len(err["message"]) < 300  # a 5000-digit key is not echoed whole


@pytest.mark.parametrize(
    ("field", "raw"),
    [
        ("max_tokens", "9" * 5000),
        ("seed", "-" + "9" * 5000),
        ("temperature", "NaN"),
        ("temperature", "Infinity"),
        ("top_p", "1e400"),
        ("logit_bias", '{"5": -Infinity}'),
    ],
)
def test_numbers_json_cannot_carry_are_400_naming_the_field(
    server: Any, field: str, raw: str
) -> None:
    body = f'{{"prompt": "Once", "max_tokens": 2, "{field}": {raw}}}'
    if field == "max_tokens":
        body = f'{{"prompt": "Once", "max_tokens": {raw}}}'
    err = _error(_post_raw(server.url + "/completions", body), 400)
    assert err["param"].split(".")[0] == field, err
    assert len(err["message"]) < 300, err


# ------------------------------------------------------------------ a model without a template


@pytest.fixture(scope="module")
def no_template_server(tiny_model_factory: Callable[..., Path]) -> Iterator[Any]:
    model = tiny_model_factory("qwen2", **TINY_LLAMA, max_position_embeddings=8192)
    with nb.Engine(str(model), num_kv_blocks=64, block_size=16) as eng:
        with eng.serve(port=0) as srv:
            yield srv


@pytest.mark.parametrize("stream", [False, True])
def test_a_model_without_a_chat_template_says_how_to_serve_one(
    no_template_server: Any, stream: bool
) -> None:
    r = httpx.post(
        no_template_server.url + "/chat/completions",
        timeout=WAIT_S,
        json={"messages": CHAT, "max_tokens": 2, "stream": stream},
    )
    err = _error(r, 400)
    assert err["code"] == "no_chat_template", err
    assert "--chat-template" in err["message"], err
    assert "engine.serve(chat_template=" in err["message"], err
    assert "engine.chat(" not in err["message"], err
    assert "tokenizer_config.json" not in err["message"], err  # no local path
    assert "/v1/completions" in err["message"], err


# ------------------------------------------------------------------------------ never a 500

HOSTILE: list[tuple[str, str]] = [
    ("deep prompt", f'{{"prompt": {_nested(100_000)}}}'),
    ("deep body", _nested(100_000)),
    ("deep object", '{"a":' * 100_000 + "1" + "}" * 100_000),
    ("deep kwargs", f'{{"chat_template_kwargs": {{"x": {_nested(900)}}}}}'),
    (
        "deep message field",
        f'{{"messages": [{{"role": "user", "content": "a", "x": {_nested(900)}}}]}}',
    ),
    ("superscript key", '{"logit_bias": {"²": 1}}'),
    ("arabic digit key", '{"logit_bias": {"٣": 1}}'),
    ("5000-digit key", '{"logit_bias": {"' + "9" * 5000 + '": 1}}'),
    ("5000-digit int", '{"max_tokens": ' + "9" * 5000 + "}"),
    ("5000-digit float", '{"temperature": ' + "9" * 5000 + ".5}"),
    ("huge exponent", '{"temperature": 1e999999}'),
    ("NaN", '{"temperature": NaN}'),
    ("Infinity in kwargs", '{"chat_template_kwargs": {"x": Infinity}}'),
    ("bool for int", '{"n": true}'),
    ("bool for float", '{"temperature": false}'),
    ("huge top_k", '{"top_k": 1' + "0" * 40 + "}"),
    ("huge stop id", '{"stop_token_ids": [1' + "0" * 40 + '], "min_tokens": 1}'),
    ("huge prompt id", '{"prompt": [1' + "0" * 40 + "]}"),
    (
        "lone surrogate",
        '{"prompt": "a\\ud800b", "messages": [{"role": "user", "content": "\\ud800"}]}',
    ),
    ("not utf-8", '{"prompt": "\udcff"}'),
]


@pytest.mark.parametrize("route", ["/completions", "/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("name", "fragment"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_no_hostile_body_gives_a_500(
    server: Any, route: str, stream: bool, name: str, fragment: str
) -> None:
    body = fragment
    if fragment.startswith("{"):  # add what the route needs, where the fragment lacks it
        base: dict[str, Any] = {"max_tokens": 2, "stream": stream}
        base.update({"prompt": "Once"} if route == "/completions" else {"messages": CHAT})
        extra = ", ".join(
            f'"{k}": {json.dumps(v)}' for k, v in base.items() if f'"{k}"' not in fragment
        )
        body = "{" + extra + (", " if extra and fragment != "{}" else "") + fragment[1:]
    raw = body.encode("utf-8", "surrogateescape")
    r = httpx.post(
        server.url + route,
        content=raw,
        timeout=WAIT_S,
        headers={"content-type": "application/json"},
    )
    assert r.status_code < 500, (name, r.status_code, r.text[:300])
    if r.status_code >= 400:
        _error(r, r.status_code)
