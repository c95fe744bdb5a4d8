"""A model's chat template: Jinja rendering of a conversation, as Hugging Face does it.

The template comes from the model directory (docs/models.md, "Chat"):
``chat_template.jinja`` if present, else ``tokenizer_config.json``'s ``chat_template``
(a string, or a list of ``{"name", "template"}`` for models with several, such as a
``"tool_use"`` one). It is rendered with jinja2's ``ImmutableSandboxedEnvironment``
(templates are untrusted code from the Hub) with the helpers Hugging Face templates use:
``raise_exception``, ``strftime_now``, a ``tojson`` filter that does not escape HTML
(``ensure_ascii=False``, optional ``indent``), loop controls, and
``{% generation %}`` blocks. The template sees ``messages``, ``tools``,
``add_generation_prompt``, the tokenizer's named special tokens (``bos_token``,
``eos_token``, ...) and any ``chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``).

The rendered text is tokenized without adding special tokens again (the template writes
its own ``bos_token``), so the ids equal ``transformers``'
``apply_chat_template(..., tokenize=True)`` for the same files and messages.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "NoChatTemplateError"]

Message = Mapping[str, Any]

_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Names a message's reasoning may come under; templates read ``reasoning_content``
# (gpt-oss templates read ``thinking``). As transformers does, each is filled from the
# others.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A conversation the template cannot render (its ``raise_exception``, or bad input)."""


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template and none was passed."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for training
    masks in transformers; rendering just outputs the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"The chat template is not valid Jinja (line {exc.lineno}): {exc}"
        ) from exc


def _token_content(value: object) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"Cannot parse {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _plain(value: Any) -> Any:
    """A copy of ``value`` made of JSON types only: the template may not reach Python
    objects (their methods are outside what the sandbox can vet), nor change the caller's."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise TypeError(
        f"Chat messages, tools and template arguments must be JSON-like (str, numbers, "
        f"lists, dicts); got {type(value).__name__}."
    )


def _normalise_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            "messages must be a list of dicts like {'role': 'user', 'content': 'Hi'}, got "
            f"{type(messages).__name__}."
        )
    if not messages:
        raise ValueError("The conversation is empty; give at least one message.")
    out: list[dict[str, Any]] = []
    for msg in messages:
        if not isinstance(msg, Mapping):
            raise TypeError(
                f"Each chat message must be a dict with 'role' and 'content', got {msg!r}."
            )
        if "role" not in msg:
            raise ValueError(f"Chat message {dict(msg)!r} has no 'role'.")
        # Keys set to None are dropped (the OpenAI SDK sends content=None, tool_calls=None):
        # templates test whether a key is defined.
        plain = {k: v for k, v in _plain(msg).items() if v is not None}
        reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """The chat templates of one model and the special tokens its templates may use.

    ``templates`` maps a name to Jinja source (``"default"`` for a model's only template).
    """

    templates: dict[str, str] = field(default_factory=dict)
    special_tokens: dict[str, str] = field(default_factory=dict)
    source: str = ""  # where the templates came from, for messages

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate:
        """Read the chat template(s) and special tokens of the model directory ``path``."""
        path = Path(path)
        tok_cfg = _read_json(path / "tokenizer_config.json")
        specials_map = _read_json(path / "special_tokens_map.json")
        specials: dict[str, str] = {}
        for name in _SPECIAL_TOKEN_NAMES:
            value = _token_content(tok_cfg.get(name))
            if value is None and name not in tok_cfg:
                value = _token_content(specials_map.get(name))
            if value is not None:
                specials[name] = value
        templates: dict[str, str] = {}
        jinja_file = path / "chat_template.jinja"
        source = str(path)
        if jinja_file.is_file():  # as in transformers: the file wins over the config entry
            templates["default"] = jinja_file.read_text(encoding="utf-8")
            source = str(jinja_file)
        else:
            entry = tok_cfg.get("chat_template")
            if isinstance(entry, str):
                templates["default"] = entry
            elif isinstance(entry, list):
                for item in entry:
                    if isinstance(item, Mapping) and isinstance(item.get("template"), str):
                        templates[str(item.get("name", "default"))] = item["template"]
            source = str(path / "tokenizer_config.json")
        return cls(templates, specials, source)

    def select(self, chat_template: str | None = None, tools: object = None) -> str:
        """The Jinja source to render: ``chat_template`` (a template, or the name of one
        of the model's), else the model's own ("tool_use" when tools are given and the
        model has one, else "default")."""
        if chat_template is not None:
            if not isinstance(chat_template, str):
                raise TypeError(
                    f"chat_template must be a string, got {type(chat_template).__name__}."
                )
            return self.templates.get(chat_template, chat_template)
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if self.templates:
            raise NoChatTemplateError(
                f"The model has several chat templates and none is the default ({self.source}): "
                f"pass chat_template= one of {sorted(self.templates)}."
            )
        raise NoChatTemplateError(
            f"The model has no chat template (no chat_template.jinja, and no 'chat_template' "
            f"in tokenizer_config.json under {self.source}). Pass one as a Jinja string, e.g. "
            "engine.chat(messages, chat_template=\"{% for m in messages %}{{ m['role'] }}: "
            "{{ m['content'] }}\\n{% endfor %}{% if add_generation_prompt %}assistant: "
            '{% endif %}"), or use engine.generate() with a plain prompt.'
        )

    def render(
        self,
        messages: Sequence[Message],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The conversation as the model's prompt text.

        ``continue_final_message=True`` leaves the last message open (no end-of-turn
        after it) so the model continues it; it cannot be combined with
        ``add_generation_prompt``. Raises ``ChatTemplateError`` (a ``ValueError``) when
        the template rejects the conversation, ``NoChatTemplateError`` without a template.
        """
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "add_generation_prompt=True starts a new assistant turn and "
                "continue_final_message=True continues the last one: choose one (pass "
                "add_generation_prompt=False to continue the final message)."
            )
        if tools is not None and (
            isinstance(tools, (str, Mapping)) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise TypeError("tools must be a list of JSON-schema dicts.")
        source = self.select(chat_template, tools)
        chat = _normalise_messages(messages)
        final = ""
        if continue_final_message:
            content = chat[-1].get("content")
            if not isinstance(content, str):
                raise ValueError(
                    "continue_final_message=True needs a final message with text content."
                )
            final = content
            # Mark where the final message ends, then cut everything the template adds after it.
            chat[-1]["content"] = final + _CONTINUE_TAG
        variables = {**self.special_tokens, **_plain(dict(chat_template_kwargs or {}))}
        try:
            text = _compile(source).render(
                messages=chat,
                tools=_plain(list(tools)) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"The chat template rejected the conversation: {exc}") from exc
        except (TypeError, ValueError, AttributeError) as exc:  # e.g. str + list in the template
            hint = ""
            if any(not isinstance(m.get("content", ""), str) for m in chat):
                hint = (
                    " This template may expect every message's content as a string; "
                    "content given as a list of parts is passed to it unchanged."
                )
            raise ChatTemplateError(
                f"Rendering the chat template failed: {type(exc).__name__}: {exc}.{hint}"
            ) from exc
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise ChatTemplateError(
                    "continue_final_message=True, but the chat template does not write the final "
                    "message's text into the prompt."
                )
            at = text.rindex(tag)
            if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
                text = text[:at]
            else:  # the template trimmed the message's trailing space
                text = text[:at].rstrip()
        return text
