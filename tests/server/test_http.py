"""The server at the HTTP level (httpx): malformed and hostile requests, the error shape,
concurrency, and its security rules."""

from __future__ import annotations

import asyncio
import json

import pytest

import nbengine as nb

from support.requests import wait_until

httpx = pytest.importorskip("httpx")


def final_status(engine: nb.Engine, request_id: str) -> str | None:
    """The finish reason of the latest incarnation of ``request_id`` (None while live)."""
    stats = engine.request_stats()
    rows = stats[stats["request_id"] == request_id]
    reason = rows.iloc[-1]["finish_reason"] if not rows.empty else None
    return reason if isinstance(reason, str) else None  # NaN while it runs


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


def test_malformed_json_is_400(server: object) -> None:
    r = httpx.post(
        server.url + "/completions",
        content=b'{"prompt": "a",',
        headers={"content-type": "application/json"},
    )
    assert "not valid JSON" in _error(r, 400)["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "5"),
        ("max_tokens", 2.5),
        ("temperature", "hot"),
        ("n", True),
        ("stream", "yes"),
        ("stop", 3),
        ("seed", [1]),
        ("top_k", 1.5),
        ("prompt", 12),
        ("logit_bias", {"1": "x"}),
    ],
)
def test_a_wrong_type_is_400_naming_the_field(server: object, field: str, value: object) -> None:
    body = {"prompt": "Once", "max_tokens": 2, field: value}
    err = _error(httpx.post(server.url + "/completions", json=body), 400)
    assert err["param"].split(".")[0] == field, err


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("top_p", 0),
        ("n", 0),
        ("max_tokens", 0),
        ("min_p", 2),
        ("repetition_penalty", 0),
        ("min_tokens", 5),
        ("logprobs", 50),
    ],
)
def test_a_value_out_of_range_is_400_naming_the_field(
    server: object, field: str, value: object
) -> None:
    body = {"prompt": "Once", "max_tokens": 2, field: value}
    if field == "max_tokens":
        body = {"prompt": "Once", field: value}
    err = _error(httpx.post(server.url + "/completions", json=body), 400)
    assert err["param"] == field and field in err["message"]


def test_unknown_fields_and_missing_ones_are_400(server: object) -> None:
    err = _error(
        httpx.post(
            server.url + "/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "audio": {"format": "wav"},
            },
        ),
        400,
    )
    assert err["param"] == "audio"
    err = _error(httpx.post(server.url + "/chat/completions", json={"max_tokens": 3}), 400)
    assert err["param"] == "messages"
    err = _error(httpx.post(server.url + "/completions", json=["prompt"]), 400)
    assert "JSON object" in err["message"]


def test_max_tokens_above_the_server_limit_is_400(engine: nb.Engine) -> None:
    with engine.serve(port=0, max_tokens=50) as srv:
        err = _error(
            httpx.post(
                srv.url + "/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 51},
            ),
            400,
        )
        assert err["param"] == "max_completion_tokens" and "50" in err["message"]


def test_an_oversized_body_is_413(engine: nb.Engine) -> None:
    with engine.serve(port=0, max_request_bytes=4096) as srv:
        big = json.dumps({"prompt": "a" * 5000, "max_tokens": 1}).encode()
        _error(httpx.post(srv.url + "/completions", content=big), 413)

        def chunks():  # no Content-Length: the limit applies while reading
            for i in range(0, len(big), 1000):
                yield big[i : i + 1000]

        err = _error(httpx.post(srv.url + "/completions", content=chunks()), 413)
        assert err["code"] == "request_too_large"


def test_unknown_routes_and_methods_answer_in_the_error_shape(server: object) -> None:
    _error(httpx.get(server.url + "/files"), 404)
    _error(httpx.get(server.url + "/completions"), 405)


def test_a_non_streaming_client_that_leaves_aborts_its_request(
    server: object, engine: nb.Engine
) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/completions",
            timeout=httpx.Timeout(5, read=0.5),
            headers={"X-Request-Id": "gone"},
            json={"prompt": "Once", "max_tokens": 4000, "ignore_eos": True},
        )
    wait_until(lambda: final_status(engine, "server:gone") is not None, what="the abort")
    assert final_status(engine, "server:gone") == "abort"


def test_64_concurrent_streams_get_exact_token_counts(server: object, engine: nb.Engine) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int, str | None]:
        want = 5 + i % 13
        body = {
            "model": "tiny",
            "prompt": f"Story {i}:",
            "max_tokens": want,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        texts, usage, finish = [], None, None
        async with client.stream("POST", server.url + "/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    texts.append(c["text"])
                    finish = c["finish_reason"] or finish
                usage = chunk.get("usage") or usage
        return want, usage["completion_tokens"], finish

    async def main() -> list[tuple[int, int, str | None]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert [(w, w, "length") for w, _, _ in results] == results


def test_a_key_is_required_when_set(engine: nb.Engine) -> None:
    with engine.serve(port=0, api_key="s3cret") as srv:
        body = {"prompt": "Once", "max_tokens": 2}
        assert (
            _error(httpx.post(srv.url + "/completions", json=body), 401)["code"]
            == "invalid_api_key"
        )
        _error(httpx.get(srv.url + "/models"), 401)
        _error(
            httpx.post(
                srv.url + "/completions", json=body, headers={"Authorization": "Bearer s3cres"}
            ),
            401,
        )
        _error(
            httpx.post(
                srv.url + "/completions", json=body, headers={"Authorization": "Basic s3cret"}
            ),
            401,
        )
        ok = httpx.post(
            srv.url + "/completions", json=body, headers={"Authorization": "Bearer s3cret"}
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20"])
def test_a_non_loopback_bind_without_a_key_is_refused(engine: nb.Engine, host: str) -> None:
    with pytest.raises(ValueError, match="api_key"):
        engine.serve(host=host, port=0)


def test_a_dead_engine_answers_503(chat_model: object) -> None:
    eng = nb.Engine(str(chat_model), num_kv_blocks=64, block_size=16)
    srv = eng.serve(port=0)
    try:
        assert httpx.get(srv.url.removesuffix("/v1") + "/health").status_code == 200
        eng.shutdown()
        err = _error(httpx.post(srv.url + "/completions", json={"prompt": "a"}), 503)
        assert err["code"] == "engine_dead"
        _error(httpx.get(srv.url.removesuffix("/v1") + "/health"), 503)
    finally:
        srv.stop()
        eng.shutdown()


def test_stopping_the_server_ends_open_streams(engine: nb.Engine) -> None:
    srv = engine.serve(port=0)
    with httpx.stream(
        "POST",
        srv.url + "/completions",
        timeout=60,
        headers={"X-Request-Id": "cut"},
        json={"prompt": "Once", "max_tokens": 4000, "ignore_eos": True, "stream": True},
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        srv.stop()
        assert not srv.running
    wait_until(lambda: final_status(engine, "server:cut") is not None, what="the abort")
    assert final_status(engine, "server:cut") == "abort"


def test_a_chat_template_given_to_the_server_replaces_the_models(engine: nb.Engine) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with engine.serve(port=0, chat_template=template) as srv:
        r = httpx.post(
            srv.url + "/chat/completions",
            timeout=60,
            json={
                "messages": [{"role": "user", "content": "Once upon a time"}],
                "max_tokens": 2,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        want = engine.tokenizer.encode("Once upon a time", add_special_tokens=False)
        assert r.json()["usage"]["prompt_tokens"] == len(want)


def test_engine_refusals_become_400s(server: object, engine: nb.Engine) -> None:
    vocab = engine.tokenizer.backend.get_vocab_size()
    err = _error(
        httpx.post(
            server.url + "/completions", json={"prompt": [1, 2, vocab + 5], "max_tokens": 2}
        ),
        400,
    )
    assert "vocabulary" in err["message"]
    err = _error(
        httpx.post(server.url + "/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 2}),
        400,
    )
    assert err["param"] == "prompt"
    err = _error(
        httpx.post(
            server.url + "/completions",
            headers={"X-Request-Id": "a b"},
            json={"prompt": "x", "max_tokens": 2},
        ),
        400,
    )
    assert err["param"] == "X-Request-Id"
