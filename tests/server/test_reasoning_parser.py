"""``engine.serve(reasoning_parser=...)``: think tags split into ``reasoning_content``,
through the real openai client, on model output forced with ``guided_choice``."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import nbengine as nb

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

CONV = [{"role": "user", "content": "What is two and two?"}]
THOUGHT = "<think>Two and two: four.</think>\n\nIt is 4."
# The template opens the thinking: the prompt ends with "<think>" (continue_final_message
# on an assistant message), and the model writes the rest.
OPENED = [*CONV, {"role": "assistant", "content": "<think>\n"}]
OPENED_KW: dict[str, Any] = {"add_generation_prompt": False, "continue_final_message": True}
AFTER_OPENED = "Two and two: four.</think>It is 4."


def forced(text: str, **extra: Any) -> dict[str, Any]:
    """Request options that make the tiny model write exactly ``text``."""
    return dict(temperature=1.0, max_tokens=200, extra_body={"guided_choice": [text], **extra})


def client_of(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def qwen3(engine: nb.Engine) -> Iterator[openai.OpenAI]:
    with engine.serve(port=0, model_name="tiny", reasoning_parser="qwen3") as srv:
        yield client_of(srv)


@pytest.fixture(scope="module")
def deepseek(engine: nb.Engine) -> Iterator[openai.OpenAI]:
    with engine.serve(port=0, model_name="tiny", reasoning_parser="deepseek_r1") as srv:
        yield client_of(srv)


def streamed(
    client: openai.OpenAI, messages: list[dict[str, str]], n: int = 1, **kw: Any
) -> list[tuple[str, str]]:
    """Per choice: the streamed reasoning and content, joined; every delta checked to
    carry no piece of a think tag."""
    parts: list[tuple[list[str], list[str]]] = [([], []) for _ in range(n)]
    chunks = client.chat.completions.create(model="tiny", messages=messages, n=n, stream=True, **kw)
    for chunk in chunks:
        for c in chunk.choices:
            reasoning = (c.delta.model_extra or {}).get("reasoning_content")
            for piece in (reasoning, c.delta.content):
                assert piece is None or ("<" not in piece and ">" not in piece), chunk
            parts[c.index][0].append(reasoning or "")
            parts[c.index][1].append(c.delta.content or "")
    return [("".join(r), "".join(c)) for r, c in parts]


def test_the_tags_are_split_across_chunks(engine: nb.Engine) -> None:
    # A premise of the streamed tests below: no think tag is one token of this tokenizer,
    # so each reaches the server in pieces.
    assert len(engine.tokenizer.encode("<think>")) > 1
    assert len(engine.tokenizer.encode("</think>")) > 1


def test_reasoning_content_is_split_from_the_content(qwen3: openai.OpenAI) -> None:
    r = qwen3.chat.completions.create(model="tiny", messages=CONV, **forced(THOUGHT))
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == "Two and two: four."
    assert message.content == "\n\nIt is 4."
    assert r.usage.completion_tokens > 0


def test_streamed_reasoning_adds_up_to_the_same_split(qwen3: openai.OpenAI) -> None:
    got = streamed(qwen3, CONV, n=2, **forced(THOUGHT))
    assert got == [("Two and two: four.", "\n\nIt is 4.")] * 2


def test_a_reply_without_think_tags_is_all_content(qwen3: openai.OpenAI) -> None:
    r = qwen3.chat.completions.create(model="tiny", messages=CONV, **forced("Just 4."))
    assert r.choices[0].message.content == "Just 4."
    assert r.choices[0].message.model_extra.get("reasoning_content") is None
    assert streamed(qwen3, CONV, **forced("Just 4.")) == [("", "Just 4.")]


def test_a_template_that_opened_the_thinking(qwen3: openai.OpenAI) -> None:
    r = qwen3.chat.completions.create(
        model="tiny", messages=OPENED, **forced(AFTER_OPENED, **OPENED_KW)
    )
    assert r.choices[0].message.model_extra["reasoning_content"] == "Two and two: four."
    assert r.choices[0].message.content == "It is 4."
    got = streamed(qwen3, OPENED, **forced(AFTER_OPENED, **OPENED_KW))
    assert got == [("Two and two: four.", "It is 4.")]


def test_deepseek_r1_starts_inside_the_thinking(deepseek: openai.OpenAI) -> None:
    r = deepseek.chat.completions.create(model="tiny", messages=CONV, **forced(AFTER_OPENED))
    assert r.choices[0].message.model_extra["reasoning_content"] == "Two and two: four."
    assert r.choices[0].message.content == "It is 4."
    assert streamed(deepseek, CONV, **forced(AFTER_OPENED)) == [("Two and two: four.", "It is 4.")]


def test_thinking_cut_by_max_tokens_is_all_reasoning(qwen3: openai.OpenAI) -> None:
    kw = forced(THOUGHT)
    kw["max_tokens"] = len("<think>Two")  # at least one character per token
    r = qwen3.chat.completions.create(model="tiny", messages=CONV, **kw)
    assert r.choices[0].finish_reason == "length"
    reasoning = r.choices[0].message.model_extra["reasoning_content"]
    assert reasoning and "Two and two: four.".startswith(reasoning)
    assert r.choices[0].message.content is None


def test_reasoning_is_off_by_default(server: Any) -> None:
    client = client_of(server)
    r = client.chat.completions.create(model="tiny", messages=CONV, **forced(THOUGHT))
    assert r.choices[0].message.content == THOUGHT
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    chunks = list(
        client.chat.completions.create(model="tiny", messages=CONV, stream=True, **forced(THOUGHT))
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == THOUGHT
    assert all(
        "reasoning_content" not in (c.delta.model_extra or {}) for ch in chunks for c in ch.choices
    )


def test_an_unknown_reasoning_parser_is_refused(engine: nb.Engine) -> None:
    with pytest.raises(ValueError, match=r"reasoning_parser must be one of \['deepseek_r1'"):
        engine.serve(port=0, reasoning_parser="qwen4")


def test_serve_command_takes_a_reasoning_parser(chat_model: Path) -> None:
    bad = subprocess.run(
        [sys.executable, "-m", "nbengine", "serve", "--reasoning-parser", "qwen4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--reasoning-parser" in bad.stderr, bad.stderr
    proc = subprocess.Popen(
        [sys.executable, "-m", "nbengine", "serve", str(chat_model), "--port", "0"]
        + ["--served-model-name", "tiny", "--reasoning-parser", "qwen3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # printed once the server listens
        assert line.startswith("nbengine: serving"), line + proc.stderr.read()
        url = line.rsplit(" ", 1)[1].strip()
        body = {"model": "tiny", "messages": CONV, **forced(THOUGHT)}
        body.update(body.pop("extra_body"))
        r = httpx.post(url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == (
            "Two and two: four.",
            "\n\nIt is 4.",
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
