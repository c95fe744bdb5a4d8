"""engine.chat_ui(): send, stream, Stop (the confirmed abort), Regenerate, messages."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import nbengine as nb
from nbengine.dashboard.chat_panel import ChatPanel
from nbengine.request import RequestStatus
from nbengine.testing import QWEN_CHAT_TEMPLATE, TINY_LLAMA

from support.requests import wait_until

ENGINE_KW = dict(num_kv_blocks=1024, block_size=16, max_num_seqs=16, max_num_batched_tokens=256)

ENDLESS = nb.SamplingParams(ignore_eos=True)


@pytest.fixture(scope="module")
def chat_engine(tiny_model_factory: Callable[..., Path]) -> Iterator[nb.Engine]:
    path = tiny_model_factory(
        "qwen2", chat_template=QWEN_CHAT_TEMPLATE, **TINY_LLAMA, max_position_embeddings=8192
    )
    with nb.Engine(str(path), **ENGINE_KW) as eng:
        yield eng


def _idle(panel: ChatPanel) -> None:
    wait_until(lambda: not panel.send_button.disabled, what="the reply to end")


def test_send_streams_a_reply_that_joins_the_conversation(chat_engine: nb.Engine) -> None:
    panel = chat_engine.chat_ui(system_prompt="Be brief.", max_tokens=6, sampling_params=ENDLESS)
    panel.input.value = "Hello there"
    panel.send_button.click()
    h = panel.handle
    assert h is not None and h.request_id.startswith("chat:")
    assert panel.input.value == "" and panel.send_button.disabled
    out = h.result(timeout=60)
    _idle(panel)
    assert panel.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": out.outputs[0].text},
    ]
    assert 'finish: <span class="nbengine-chat-finish">length</span>' in panel._reply.stats.value
    assert ">6</span> tokens" in panel._reply.stats.value
    # The conversation continues in code with the same messages.
    again = chat_engine.chat(
        panel.messages + [{"role": "user", "content": "More"}],
        nb.SamplingParams(max_tokens=2, ignore_eos=True),
    )
    assert len(again.result(timeout=60).outputs[0].token_ids) == 2
    panel.close()


def test_stop_aborts_the_reply_and_the_next_message_works(chat_engine: nb.Engine) -> None:
    panel = ChatPanel(chat_engine, max_tokens=3000, sampling_params=ENDLESS)
    h = panel.send("Tell me a long story")
    wait_until(lambda: len(h.token_ids) > 3, what="some reply")
    assert not panel.stop_button.disabled
    panel.stop_button.click()
    out = h.result(timeout=60)
    assert out.status is RequestStatus.FINISHED_ABORTED
    assert out.outputs[0].finish_reason == "abort"
    _idle(panel)
    assert "abort" in panel._reply.stats.value
    assert panel.messages[-1] == {"role": "assistant", "content": out.outputs[0].text}
    assert panel.stop_button.disabled
    panel.max_tokens.value = 4
    h2 = panel.send("And then?")
    assert h2.result(timeout=60).outputs[0].finish_reason == "length"
    _idle(panel)
    assert [m["role"] for m in panel.messages] == ["user", "assistant", "user", "assistant"]
    panel.close()


def test_regenerate_replaces_the_last_reply(chat_engine: nb.Engine) -> None:
    panel = ChatPanel(
        chat_engine,
        max_tokens=5,
        temperature=1.0,
        sampling_params=nb.SamplingParams(ignore_eos=True, seed=3),
    )
    panel.send("Hi")
    panel.wait()
    assert [m["role"] for m in panel.messages] == ["user", "assistant"]
    shown = len(panel.history.children)
    h = panel.regenerate()
    h.result(timeout=60)
    _idle(panel)
    assert len(panel.history.children) == shown
    assert [m["role"] for m in panel.messages] == ["user", "assistant"]
    assert panel.messages[-1]["content"] == h.result().outputs[0].text
    panel.close()


def test_misuse_is_refused_and_leaves_no_state(chat_engine: nb.Engine, tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="temperature"):
        ChatPanel(chat_engine, temperature=-1)
    panel = ChatPanel(chat_engine, max_tokens=3000, sampling_params=ENDLESS)
    with pytest.raises(ValueError, match="empty"):
        panel.send("   ")
    with pytest.raises(RuntimeError, match="no reply"):
        panel.regenerate()
    h = panel.send("Hi")
    with pytest.raises(RuntimeError, match="streaming"):
        panel.send("again")
    panel.stop()
    h.result(timeout=60)
    _idle(panel)
    assert len(panel.messages) == 2
    panel.close()
    # A model without a chat template: the error shows in the panel, nothing is kept.
    with nb.Engine(str(tiny_model), **ENGINE_KW) as plain:
        p2 = plain.chat_ui()
        p2.input.value = "Hi"
        p2.send_button.click()
        assert "chat template" in p2.status.value
        assert p2.messages == [] and len(p2.history.children) == 0
        assert not p2.send_button.disabled
        p2.close()


def test_a_reply_with_tool_calls_shows_them(chat_engine: nb.Engine) -> None:
    from support.scripted import eos_id, scripted

    text = (
        'Checking.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    proc = scripted(chat_engine.tokenizer, text, eos_id(chat_engine.tokenizer))
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    panel = chat_engine.chat_ui(
        max_tokens=200,
        sampling_params=nb.SamplingParams(logits_processors=[proc]),
        tools=tools,
        tool_call_parser="hermes",
    )
    h = panel.send("Weather in Oslo?")
    h.result(timeout=60)
    panel.wait()
    assert panel._reply is not None
    assert panel._reply.text.value == "Checking."  # the call shows as a call, not as text
    assert "→ <b>weather</b>({&quot;city&quot;: &quot;Oslo&quot;})" in panel._reply.calls.value
    last = panel.messages[-1]
    assert last["role"] == "assistant" and last["content"] == "Checking."
    assert [c["function"] for c in last["tool_calls"]] == [
        {"name": "weather", "arguments": '{"city": "Oslo"}'}
    ]
    # The conversation, calls included, goes on through the template.
    nxt = chat_engine.chat(
        panel.messages + [{"role": "tool", "content": "21 C"}],
        nb.SamplingParams(max_tokens=2, ignore_eos=True),
    )
    assert len(nxt.result(timeout=60).outputs[0].token_ids) == 2
    panel.close()
