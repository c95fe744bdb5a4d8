"""The chat panel (``engine.chat_ui()``) in a real JupyterLab, driven in headless Chromium.

A person types a message, presses Send, sees the reply stream (its box following the
newest text), presses Stop mid-reply, sees the reply end as aborted, then sends the next
message and sees it answered. Screenshots go to artifacts/screenshots/chat/.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from harness import NotebookPage, notebook_in_lab, tiny_long_context_model

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


def _cells(model: Path) -> list[str]:
    return [
        "import nbengine as nb\n"
        f"engine = nb.Engine({str(model)!r}, num_kv_blocks=2048, block_size=16, "
        "max_num_seqs=8, max_num_batched_tokens=256)\n"
        # Replies run until Stop (no end-of-turn token ends them early).
        "panel = engine.chat_ui(system_prompt='You tell stories.', max_tokens=16000, "
        "sampling_params=nb.SamplingParams(ignore_eos=True))\n"
        "panel",
        "print('roles:', [m['role'] for m in panel.messages])\n"
        "print('finish:', panel.handle.result().outputs[0].finish_reason)\n"
        "engine.shutdown()",
    ]


_REPLY_JS = """(i) => {
    const cells = document.querySelectorAll(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell');
    const replies = cells[0].querySelectorAll('.nbengine-chat-reply');
    const last = replies[replies.length - 1];
    const box = last && last.querySelector('.nbengine-text-pre');
    if (!box) return null;
    return {n: replies.length, chars: box.textContent.length,
            atBottom: box.scrollHeight - box.scrollTop - box.clientHeight <= 8,
            scrolls: box.scrollHeight > box.clientHeight,
            finish: last.querySelector('.nbengine-chat-finish').textContent};
}"""


def _reply(p: NotebookPage) -> dict:
    r = p.page.evaluate(_REPLY_JS, 0)
    assert r is not None, "no reply in the panel"
    return dict(r)


def _wait(p: NotebookPage, cond, what: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        r = p.page.evaluate(_REPLY_JS, 0)
        if r is not None and cond(r):
            return dict(r)
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {r}")
        time.sleep(0.1)


def _type_and_send(p: NotebookPage, text: str) -> None:
    box = p.cell(0).locator(".nbengine-chat-input textarea").first
    box.click()
    box.fill("")
    p.page.keyboard.type(text)
    p.click(0, ".nbengine-chat-send")


def test_chat_panel_in_jupyterlab(tmp_path: Path) -> None:
    from nbengine.testing import QWEN_CHAT_TEMPLATE

    model = tiny_long_context_model(tmp_path / "chat", "qwen2", chat_template=QWEN_CHAT_TEMPLATE)
    with notebook_in_lab(tmp_path, "chat.ipynb", _cells(model), screenshots="chat") as p:
        _stages(p)


def _stages(p: NotebookPage) -> None:
    p.run_cell(0)
    p.wait_cell_done(0, timeout_s=120)
    p.wait_cell_text(0, ".nbengine-chat", "true", timeout_s=60)
    assert p.is_disabled(0, ".nbengine-chat-stop")

    # Type and send: the reply streams into the panel and its box follows the tail.
    _type_and_send(p, "Tell me a story about a fox")
    p.wait_cell_text(0, ".nbengine-chat-list", "t.includes('Tell me a story about a fox')")
    first = _wait(p, lambda r: r["chars"] > 20, "the reply to start")
    grown = _wait(
        p,
        lambda r: r["chars"] > first["chars"] + 200 and r["scrolls"],
        "the reply to grow past its box",
    )
    assert grown["atBottom"], grown  # the newest text is in view
    assert grown["finish"] == "…"
    assert p.is_disabled(0, ".nbengine-chat-send")
    p.screenshot("01-reply-streaming")

    # Stop mid-reply: the reply ends as aborted (the core confirmed the abort).
    p.click(0, ".nbengine-chat-stop")
    stopped = _wait(p, lambda r: r["finish"] == "abort", "the reply to end as aborted")
    time.sleep(0.5)  # the text no longer grows once aborted
    assert _reply(p)["chars"] == stopped["chars"]
    assert not p.is_disabled(0, ".nbengine-chat-send")
    p.screenshot("02-reply-stopped")

    # The next message works: a short reply, ended by max tokens.
    limit = p.cell(0).locator(".nbengine-chat-max-tokens input").first
    limit.fill("12")
    limit.press("Enter")
    _type_and_send(p, "What happened next?")
    second = _wait(
        p, lambda r: r["n"] == 2 and r["finish"] == "length", "the second reply to finish"
    )
    assert second["chars"] > 0
    p.screenshot("03-next-message")

    p.run_cell(1)
    p.wait_cell_done(1, timeout_s=60)
    out = p.cell_text(1, ".jp-OutputArea")
    assert "roles: ['system', 'user', 'assistant', 'user', 'assistant']" in out, out
    assert "finish: length" in out, out
