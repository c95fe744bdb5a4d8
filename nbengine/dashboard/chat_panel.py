"""``engine.chat_ui()``: a chat panel widget on a running engine.

Parts: a system prompt field, temperature and max-tokens controls, the message list,
an input box with Send, Stop and Regenerate buttons, and a status line. Each reply
streams into a ``StreamingText`` (it follows the newest text while the reader stays at
the bottom), and the message list itself stays at its newest message. Under each reply:
its tokens, tokens/s and finish reason. With ``tools``, a reply's tool calls
(``engine.chat``'s parsed ``tool_calls``) show under its text as ``name(arguments)``,
and the turn joins ``messages`` with its ``tool_calls`` (OpenAI's shape).

``panel.messages`` is the conversation as a list of ``{"role", "content"}`` dicts (the
system prompt first, when set): continue it in code with ``engine.chat(panel.messages)``
or ``panel.send("...")``.

Threads (docs/architecture.md, widgets): the widgets are created on the caller's
thread; a ``UIUpdater`` of the panel's own (``nbengine-chat-ui``) refreshes the reply
that streams, about 10 times a second; button callbacks write traits under the same
lock. Only the engine's public API is used: ``engine.chat`` starts a reply (the request
id ``"chat:<n>-<hex>"`` shows as source "chat" in the dashboard, nbengine/request_source.py)
and Stop is ``handle.cancel(wait=False)``: the confirmed abort of docs/lifecycle.md,
scheduled without blocking the button; the reply shows ``finish: abort`` once the core
has confirmed it.
"""

from __future__ import annotations

import html
import itertools
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from nbengine.dashboard.stream_text import StreamingText
from nbengine.dashboard.traits import TraitWriter
from nbengine.dashboard.updater import UIUpdater
from nbengine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from nbengine.frontend.engine import Engine
    from nbengine.frontend.handles import RequestHandle
    from nbengine.tool_parsers import ToolCall

__all__ = ["ChatPanel"]

_ids = itertools.count(1)

_LIST_HEIGHT = "420px"


def _stats_html(tokens: int, rate: float | None, finish: str | None) -> str:
    rate_s = "–" if rate is None else f"{rate:.1f}"
    finish_s = "…" if finish is None else html.escape(finish)
    return (
        f'<span style="font-family:monospace;font-size:11px;color:#666">'
        f'<span class="nbengine-chat-tokens">{tokens}</span> tokens · '
        f'<span class="nbengine-chat-rate">{rate_s}</span> tok/s · finish: '
        f'<span class="nbengine-chat-finish">{finish_s}</span></span>'
    )


def _tool_calls_html(calls: list[ToolCall]) -> str:
    """A reply's tool calls, one line each: ``→ name({"arg": ...})``."""
    rows = "".join(
        '<div class="nbengine-chat-tool-call" style="font-family:monospace;font-size:12px;'
        f'background:#f3f0e8;border-radius:4px;padding:2px 6px;margin:2px 0">→ '
        f"<b>{html.escape(c.name)}</b>({html.escape(c.arguments)})</div>"
        for c in calls
    )
    return rows


def _user_html(text: str) -> str:
    return (
        '<div style="white-space:pre-wrap;background:#eef3fb;border-radius:6px;'
        f'padding:4px 8px"><b>you</b><br>{html.escape(text)}</div>'
    )


class _Reply:
    """One assistant message: a label, the streaming text and its stats line."""

    def __init__(self) -> None:
        self.text = StreamingText("")
        self.text.add_class("nbengine-chat-text")
        self.stats = widgets.HTML(_stats_html(0, None, None))
        self.stats.add_class("nbengine-chat-stats")
        self.calls = widgets.HTML("")  # the reply's tool calls, once it has ended
        self.calls.add_class("nbengine-chat-tool-calls")
        self.box = widgets.VBox(
            [widgets.HTML("<b>assistant</b>"), self.text, self.calls, self.stats]
        )
        self.box.add_class("nbengine-chat-reply")


class ChatPanel(widgets.VBox):
    """A chat with ``engine`` (see the module docstring). ``messages`` seeds the
    conversation (without the system prompt, which ``system_prompt`` sets);
    ``sampling_params`` gives what the controls do not (seed, top_p, stop, ...; the
    engine's defaults otherwise): temperature and max tokens come from the controls;
    ``chat_template`` replaces the model's own, ``tools`` and ``tool_call_parser`` go
    to every reply (``engine.chat``'s arguments)."""

    def __init__(
        self,
        engine: Engine,
        *,
        system_prompt: str = "",
        temperature: float = 0.7,
        max_tokens: int = 256,
        messages: list[dict[str, str]] | None = None,
        sampling_params: SamplingParams | None = None,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_call_parser: str | None = None,
    ) -> None:
        if not isinstance(system_prompt, str):
            raise TypeError(f"system_prompt must be a str, got {type(system_prompt).__name__}.")
        # The same checks (and messages) as the SamplingParams the panel will build.
        SamplingParams(temperature=temperature, max_tokens=max_tokens)
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams or None.")
        # What the controls do not set (seed, top_p, stop, ...): the engine's defaults.
        self._base = sampling_params or engine.get_default_sampling_params()
        self.engine = engine
        self.chat_template = chat_template
        self.tools = tools
        self.tool_call_parser = tool_call_parser
        self._recorded: RequestHandle | None = None  # the last reply added to the turns
        self.handle: RequestHandle | None = None  # the reply streaming now (or the last one)
        self._turns: list[dict[str, Any]] = []
        self._reply: _Reply | None = None
        self._trait_writer = TraitWriter()  # writes a trait only when its value changed
        self._updater = UIUpdater(name="nbengine-chat-ui", alive=lambda: engine.is_alive)
        self.lock = self._updater.lock

        self.system = widgets.Textarea(
            value=system_prompt,
            placeholder="System prompt",
            description="system",
            rows=2,
            layout=widgets.Layout(width="100%"),
        )
        self.system.add_class("nbengine-chat-system")
        self.temperature = widgets.FloatSlider(
            value=temperature,
            min=0.0,
            max=2.0,
            step=0.05,
            description="temperature",
            style={"description_width": "initial"},
        )
        self.max_tokens = widgets.BoundedIntText(
            value=max_tokens,
            min=1,
            max=1_000_000,
            description="max tokens",
            layout=widgets.Layout(width="220px"),
        )
        self.max_tokens.add_class("nbengine-chat-max-tokens")
        self.history = widgets.VBox([])
        self.history.add_class("nbengine-chat-log")
        # column-reverse: the browser keeps a scroll box laid out this way anchored at
        # its bottom while the content grows, so the list follows its newest message.
        self.scroller = widgets.Box(
            [self.history],
            layout=widgets.Layout(
                display="flex",
                flex_flow="column-reverse",
                overflow_y="auto",
                max_height=_LIST_HEIGHT,
                border="1px solid #ddd",
                padding="4px",
            ),
        )
        self.scroller.add_class("nbengine-chat-list")
        # continuous_update=False: the text reaches the kernel once, when the box loses
        # focus, which pressing Send does before its click. Per-keystroke updates are
        # throttled by the front end, and a click could overtake the last of them: a
        # fast typist's message arrived cut short on a loaded machine.
        self.input = widgets.Textarea(
            placeholder="Message",
            rows=2,
            continuous_update=False,
            layout=widgets.Layout(width="100%"),
        )
        self.input.add_class("nbengine-chat-input")
        self.send_button = widgets.Button(
            description="Send", icon="paper-plane", button_style="primary"
        )
        self.send_button.add_class("nbengine-chat-send")
        self.stop_button = widgets.Button(
            description="Stop", icon="stop", button_style="danger", disabled=True
        )
        self.stop_button.add_class("nbengine-chat-stop")
        self.regenerate_button = widgets.Button(
            description="Regenerate", icon="refresh", disabled=True
        )
        self.regenerate_button.add_class("nbengine-chat-regenerate")
        self.status = widgets.HTML("")
        self.status.add_class("nbengine-chat-status")
        super().__init__(
            [
                self.system,
                widgets.HBox([self.temperature, self.max_tokens]),
                self.scroller,
                self.input,
                widgets.HBox(
                    [self.send_button, self.stop_button, self.regenerate_button, self.status],
                    layout=widgets.Layout(align_items="center"),
                ),
            ]
        )
        self.add_class("nbengine-chat")
        self.send_button.on_click(lambda _b: self._on_send())
        self.stop_button.on_click(lambda _b: self.stop())
        self.regenerate_button.on_click(lambda _b: self._guard(self.regenerate))
        for m in messages or []:
            self._append_message(dict(m))

    # ------------------------------------------------------------------ public

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation so far, a new list: the system prompt (when set), then every
        user message and every finished reply (a stopped one with the text it had)."""
        with self.lock:
            head = (
                [{"role": "system", "content": self.system.value}]
                if self.system.value.strip()
                else []
            )
            return head + [dict(m) for m in self._turns]

    @property
    def streaming(self) -> bool:
        """True while a reply streams."""
        return self.handle is not None and not self.handle.done()

    def send(self, text: str | None = None) -> RequestHandle:
        """Send ``text`` (or the input box's text) as the user's message and start the
        reply; return its handle. RuntimeError while a reply streams."""
        if text is None:
            text = self.input.value
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}.")
        if not text.strip():
            raise ValueError("The message is empty.")
        with self.lock:
            if self.streaming:
                raise RuntimeError("A reply is streaming; Stop it first.")
            self._turns.append({"role": "user", "content": text})
            before = self.history.children
            self.history.children = (*before, widgets.HTML(_user_html(text)))
            try:
                handle = self._start_reply()
            except BaseException:
                self._turns.pop()  # nothing was sent: leave no state behind
                self.history.children = before
                raise
            self._set(self.input, "value", "")
        return handle

    def wait(self, timeout: float | None = 60.0) -> None:
        """Block until the current reply has ended and joined ``messages`` (for code that
        continues the conversation: a cell after ``send``). TimeoutError after ``timeout``."""
        import time

        handle = self.handle
        if handle is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        handle.result(timeout=timeout)
        while self._recorded is not handle:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("The reply ended but the panel did not record it in time.")
            time.sleep(0.01)

    def stop(self) -> None:
        """Abort the streaming reply (the confirmed abort; never blocks). The reply ends
        with ``finish: abort`` once the core has released it."""
        with self.lock:
            handle = self.handle
            if handle is None or handle.done():
                return
            self._set(self.stop_button, "disabled", True)
            self._set(self.status, "value", "stopping…")
        handle.cancel(wait=False)

    def regenerate(self) -> RequestHandle:
        """Drop the last reply and answer the last user message again."""
        with self.lock:
            if self.streaming:
                raise RuntimeError("A reply is streaming; Stop it first.")
            if not self._turns or self._turns[-1]["role"] != "assistant":
                raise RuntimeError("There is no reply to regenerate.")
            dropped = self._turns.pop()
            before = self.history.children
            self.history.children = before[:-1]  # the old reply's box
            try:
                handle = self._start_reply()
            except BaseException:
                self._turns.append(dropped)
                self.history.children = before
                raise
        return handle

    def close(self) -> None:
        """Stop the reply and the panel's updater, then close the widgets."""
        if hasattr(self, "_updater"):  # not a panel whose __init__ failed
            self.stop()
            self._updater.stop()
        super().close()

    def __repr__(self) -> str:
        return f"ChatPanel({len(self._turns)} messages)"

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any] | None:
        data = super()._repr_mimebundle_(**kwargs)
        if data is not None:
            data["text/plain"] = "ChatPanel()"
        return data

    # ----------------------------------------------------------------- private

    def _guard(self, fn: Any) -> None:
        """Run a button's action; show its error in the status line instead of raising
        into the kernel's callback machinery."""
        try:
            fn()
        except Exception as exc:
            with self.lock:
                self._set(
                    self.status,
                    "value",
                    f'<span style="color:#c62828">{html.escape(str(exc))}</span>',
                )

    def _on_send(self) -> None:
        if self.input.value.strip():
            self._guard(self.send)

    def _params(self) -> SamplingParams:
        # FINAL_ONLY: the panel reads the handle's view (refreshed on every token update),
        # not the stream.
        return self._base.replace(
            temperature=float(self.temperature.value),
            max_tokens=int(self.max_tokens.value),
            n=1,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _start_reply(self) -> RequestHandle:
        """Caller holds the lock: start the reply to the conversation so far."""
        params = self._params()
        rid = f"chat:{next(_ids)}-{uuid.uuid4().hex[:6]}"
        handle = self.engine.chat(
            self.messages,
            params,
            request_id=rid,
            chat_template=self.chat_template,
            tools=self.tools,
            tool_call_parser=self.tool_call_parser,
        )
        self.handle = handle
        reply = _Reply()
        self._reply = reply
        self.history.children = (*self.history.children, reply.box)
        for button, disabled in (
            (self.send_button, True),
            (self.stop_button, False),
            (self.regenerate_button, True),
        ):
            self._set(button, "disabled", disabled)
        self._set(self.status, "value", "replying…")
        self._updater.add(_ReplyView(handle, reply, self._set, self._finish))
        return handle

    def _append_message(self, m: dict[str, str]) -> None:
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError("messages must be {'role': str, 'content': str} dicts.")
        self._turns.append({"role": role, "content": content})
        if role == "assistant":
            reply = _Reply()
            reply.text.value = content
            reply.stats.value = ""
            self.history.children = (*self.history.children, reply.box)
        else:
            self.history.children = (*self.history.children, widgets.HTML(_user_html(content)))

    def _set(self, w: widgets.Widget, name: str, value: Any) -> None:
        self._trait_writer.set(w, name, value)

    def _finish(
        self, handle: RequestHandle, text: str, finish: str | None, calls: list[ToolCall]
    ) -> None:
        """Updater thread, lock held: the reply ended; it joins the conversation."""
        if handle is not self.handle:
            return
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            turn["tool_calls"] = [c.to_openai() for c in calls]
        self._turns.append(turn)
        self._recorded = handle
        for button, disabled in (
            (self.send_button, False),
            (self.stop_button, True),
            (self.regenerate_button, False),
        ):
            self._set(button, "disabled", disabled)
        self._set(
            self.status,
            "value",
            "" if finish != "error" else '<span style="color:#c62828">the reply failed</span>',
        )


class _ReplyView:
    """Keeps one reply's text and stats up to date; refreshed by the panel's updater."""

    def __init__(
        self,
        handle: RequestHandle,
        reply: _Reply,
        set_trait: Callable[[widgets.Widget, str, Any], None],
        finish: Callable[[RequestHandle, str, str | None, list[ToolCall]], None],
    ) -> None:
        # The panel's own trait writer and end-of-reply step (it passes bound methods).
        self.set_trait = set_trait
        self.finish = finish
        self.handle = handle
        self.reply = reply

    def refresh(self) -> bool:
        """Show the reply's latest view (one delivery: its text, count and finish)."""
        view = self.handle.view
        n = view.num_output_tokens
        first, last = view.first_token_time, view.last_token_time
        rate = (
            (n - 1) / (last - first)
            if (first is not None and last is not None and n > 1 and last > first)
            else None
        )
        finish: str | None = None
        if view.finished:
            comps = view.completions
            finish = (comps[0].finish_reason if comps else None) or "error"
        text = view.text
        calls: list[ToolCall] = []
        final = self.handle.final_output if view.finished else None
        if final is not None and final.outputs and final.outputs[0].tool_calls:
            calls = final.outputs[0].tool_calls
            text = final.outputs[0].content or ""  # the call text shows as the calls
            self.set_trait(self.reply.calls, "value", _tool_calls_html(calls))
        self.set_trait(self.reply.text, "value", text)
        self.set_trait(self.reply.stats, "value", _stats_html(n, rate, finish))
        if view.finished:
            self.finish(self.handle, text, finish, calls)
            return True
        return False
