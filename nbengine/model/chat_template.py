"""A model's chat template: Jinja rendering of a conversation, as Hugging Face does it.

The template comes from the model directory (docs/models.md, "Chat"):
``chat_template.jinja`` if present, else ``tokenizer_config.json``'s ``chat_template``
(a string, or a list of ``{"name", "template"}`` for models with several, such as a
``"tool_use"`` one). It is rendered with jinja2's ``ImmutableSandboxedEnvironment``
(templates are untrusted code from the Hub) with the helpers Hugging Face templates use:
``raise_exception``, ``strftime_now``, a ``tojson`` filter that does not escape HTML
(``ensure_ascii=False``, optional ``indent``), loop controls, and
``{% generation %}`` blocks; every render is bounded in size, steps and time
(nbengine/model/template_sandbox.py). The template sees ``messages``, ``tools``,
``add_generation_prompt``, the tokenizer's named special tokens (``bos_token``,
``eos_token``, ...) and any ``chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``).

The arguments are validated before anything runs (errors name the argument, the
message and the field), and every failure of the template itself is a
``ChatTemplateError`` whose ``__cause__`` is the original exception.

The rendered text is tokenized without adding special tokens again (the template writes
its own ``bos_token``), so the ids equal ``transformers``'
``apply_chat_template(..., tokenize=True)`` for the same files and messages.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from nbengine.model.errors import ModelLoadError
from nbengine.model.files import open_regular, read_json_object
from nbengine.model.template_sandbox import (
    CONTAINER_COST,
    SEPARATOR_COST,
    RenderBoundError,
    RenderLimits,
    compile_template,
    render_bounded,
    scalar_cost,
)
from nbengine.validation import check_encodable

__all__ = ["ChatTemplate", "ChatTemplateError", "NoChatTemplateError", "RenderLimits"]

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
# Variables the template gets from chat()'s own arguments: chat_template_kwargs may not
# set them.
_RESERVED_VARIABLES = ("messages", "tools", "add_generation_prompt")
# Bounds on the inputs, checked while they are copied: nesting, and the number of values
# (a list that holds itself twice, 40 levels deep, is small in memory but 2**40 values
# when copied).
_MAX_NESTING = 128
_MAX_INPUT_VALUES = 1 << 20
_MAX_SOURCE_CHARS = 1 << 20  # the largest Hub chat templates are ~50 KB


class ChatTemplateError(ValueError):
    """A conversation the template cannot render: its ``raise_exception``, an error in the
    template (the original exception is the ``__cause__``), or a render bound reached."""


class NoChatTemplateError(ChatTemplateError):
    """The model has no chat template and none was passed."""


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    if len(source) > _MAX_SOURCE_CHARS:
        raise ChatTemplateError(
            f"The chat template has {len(source):,} characters, more than the bound of "
            f"{_MAX_SOURCE_CHARS:,}."
        )
    try:
        return compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"The chat template is not valid Jinja (line {exc.lineno}): {exc}"
        ) from exc
    except Exception as exc:  # e.g. RecursionError: nested too deeply to parse
        raise ChatTemplateError(
            f"The chat template cannot be compiled: {type(exc).__name__}: {exc}"
        ) from exc


def _token_content(value: object) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    """A model file's JSON object ({} if absent), read as the loader reads it: a FIFO or
    JSON nested too deep is refused at once (nbengine/model/files.py)."""
    try:
        return read_json_object(path)
    except ModelLoadError as exc:
        raise ChatTemplateError(str(exc)) from exc


def _read_text(path: Path) -> str:
    """A model's template file, refused at once unless it is a regular UTF-8 file."""
    try:
        with open_regular(path) as f:
            return f.read().decode("utf-8")
    except (ModelLoadError, OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"Cannot read {path}: {exc}") from exc


_HERE = object()  # the key of a value that is named by its parent alone


def _where(parent: str, key: Any) -> str:
    return parent if key is _HERE else f"{parent}[{key!r}]"


class _Copier:
    """Copies JSON-like user input (messages, tools, template arguments) into JSON types
    only: the template may not reach Python objects (their methods are outside what the
    sandbox can vet), nor change the caller's. Refuses, naming where: another type, a
    lone surrogate, a container that holds itself, nesting beyond ``_MAX_NESTING``, and
    more than ``_MAX_INPUT_VALUES`` values in all. Measures the copies as it makes them,
    for the render's size bound (``sizes``: by id, in the sandbox's units). Invariant:
    ``sizes`` names only copies that the render's variables hold (an id is only valid
    while its object lives): a copy that is replaced must be ``forget``-ed first."""

    def __init__(self) -> None:
        self.values = 0
        self.sizes: dict[int, int] = {}
        self._size = 0  # of everything copied so far
        self._on_path: dict[int, str] = {}  # containers being copied -> where they are
        self._owner_depth = 0

    def copy(self, value: Any, where: str, owner_depth: int = 0) -> Any:
        """A copy of ``value``; ``where`` names it in errors (``messages[0]``). A bound on
        size or nesting names the part ``owner_depth`` levels in (1 for a message: its
        field) that holds the excess."""
        self._owner_depth = owner_depth
        return self._copy(value, where, _HERE, where, 0)

    def _copy(self, value: Any, parent: str, key: Any, owner: str, depth: int) -> Any:
        # The value is ``parent[key]``; its name is only spelled out when needed. ASCII
        # strings, the bulk of any conversation, are copied inline by the container loops.
        kind = type(value)
        if kind is str:
            check_encodable(_where(parent, key), value)
            self._size += len(value) + 2 + SEPARATOR_COST  # scalar_cost, inlined
            return value
        if value is None or kind is int or kind is float or kind is bool:
            self._size += (scalar_cost(value) or 0) + SEPARATOR_COST
            return value
        where = _where(parent, key)
        if isinstance(value, str):  # subclasses of str, int and float become plain ones
            return self._copy(str.__str__(value), parent, key, owner, depth)
        if isinstance(value, int):
            return self._copy(int.__int__(value), parent, key, owner, depth)
        if isinstance(value, float):
            return self._copy(float.__float__(value), parent, key, owner, depth)
        if not isinstance(value, (Mapping, list, tuple)):
            raise TypeError(
                f"{where} must be JSON-like (str, numbers, lists, dicts); got "
                f"{type(value).__name__}."
            )
        if depth <= self._owner_depth:
            owner = where
        self.values += len(value)
        if self.values > _MAX_INPUT_VALUES:
            raise ValueError(
                f"{owner} holds more than {_MAX_INPUT_VALUES:,} values, the bound on the "
                "messages, tools and chat_template_kwargs of one chat together."
            )
        ident = id(value)
        if ident in self._on_path:
            raise ValueError(f"{self._on_path[ident]} contains itself (at {where}).")
        if depth >= _MAX_NESTING:
            raise ValueError(f"{owner} is nested more than {_MAX_NESTING} deep.")
        self._on_path[ident] = where
        start = self._size
        try:
            copy: dict[Any, Any] | list[Any]
            if isinstance(value, Mapping):
                copy = {}
                for k, v in value.items():
                    if type(k) is str and k.isascii():
                        self._size += len(k) + 2 + SEPARATOR_COST
                    else:
                        k = self._key(k, where)
                    if type(v) is str and v.isascii():
                        self._size += len(v) + 2 + SEPARATOR_COST
                        copy[k] = v
                    else:
                        copy[k] = self._copy(v, where, k, owner, depth + 1)
            else:
                copy = []
                for i, v in enumerate(value):
                    if type(v) is str and v.isascii():
                        self._size += len(v) + 2 + SEPARATOR_COST
                        copy.append(v)
                    else:
                        copy.append(self._copy(v, where, i, owner, depth + 1))
        finally:
            del self._on_path[ident]
        size = self._size - start + CONTAINER_COST
        self.sizes[id(copy)] = size
        self._size += CONTAINER_COST + SEPARATOR_COST
        return copy

    def forget(self, copy: object) -> None:
        """``copy`` (a container from ``copy``) will not be rendered: drop its size."""
        self.sizes.pop(id(copy), None)

    def replace(self, copy: object, subset: object) -> None:
        """``subset`` (a container with some of ``copy``'s items) is rendered in place
        of ``copy``: the size of ``copy`` bounds its size."""
        size = self.sizes.pop(id(copy), None)
        if size is not None:
            self.sizes[id(subset)] = size

    def _key(self, key: Any, where: str) -> Any:
        if isinstance(key, str):
            if not key.isascii():
                check_encodable(f"A key of {where}", key)
            key = str.__str__(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            key = int.__int__(key)
        elif isinstance(key, float):
            key = float.__float__(key)
        elif not (key is None or isinstance(key, bool)):
            raise TypeError(
                f"{where} has a key of type {type(key).__name__}; keys must be strings or numbers."
            )
        self._size += (scalar_cost(key) or 0) + SEPARATOR_COST
        return key


def _normalise_messages(messages: Sequence[Message], copier: _Copier) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            "messages must be a list of dicts like {'role': 'user', 'content': 'Hi'}, got "
            f"{type(messages).__name__}."
        )
    if not messages:
        raise ValueError("The conversation is empty; give at least one message.")
    out: list[dict[str, Any]] = []
    for index, msg in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(msg, Mapping):
            raise TypeError(
                f"{where} must be a dict with 'role' and 'content', got {type(msg).__name__}."
            )
        if "role" not in msg:
            raise ValueError(f"{where} has no 'role'.")
        if not isinstance(msg["role"], str):
            raise TypeError(f"{where}['role'] must be a string, got {type(msg['role']).__name__}.")
        # Keys set to None are dropped (the OpenAI SDK sends content=None, tool_calls=None):
        # templates test whether a key is defined.
        copied = copier.copy(msg, where, 1)
        plain = {k: v for k, v in copied.items() if v is not None}
        copier.replace(copied, plain)  # before copied is freed and its id reused
        reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:
            copier.forget(plain)
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


def _normalise_tools(tools: object, copier: _Copier) -> list[Any] | None:
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a list of JSON-schema dicts, got {type(tools).__name__}.")
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TypeError(f"tools[{index}] must be a dict, got {type(tool).__name__}.")
    plain: list[Any] = copier.copy(tools, "tools", 1)
    return plain


def _normalise_kwargs(kwargs: object, copier: _Copier) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(
            "chat_template_kwargs must be a dict of template variables, got "
            f"{type(kwargs).__name__}."
        )
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        if not isinstance(key, str):
            raise TypeError(f"chat_template_kwargs keys must be strings, got {key!r}.")
        check_encodable("A key of chat_template_kwargs", key)
        if key in _RESERVED_VARIABLES:
            raise ValueError(
                f"chat_template_kwargs may not set {key!r}: the template gets it from the "
                f"chat call's own {key}= argument."
            )
        out[key] = copier.copy(value, f"chat_template_kwargs[{key!r}]")
    return out


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}.")


def _failure(exc: Exception, chat: list[dict[str, Any]]) -> ChatTemplateError:
    """The ChatTemplateError for an exception raised while rendering."""
    if isinstance(exc, RenderBoundError):
        return ChatTemplateError(str(exc))
    if isinstance(exc, jinja2.TemplateError):  # raise_exception(...), undefined names
        return ChatTemplateError(f"The chat template rejected the conversation: {exc}")
    hint = ""
    if isinstance(exc, (TypeError, ValueError, AttributeError)) and any(
        not isinstance(m.get("content", ""), str) for m in chat
    ):  # e.g. str + list in the template
        hint = (
            " This template may expect every message's content as a string; "
            "content given as a list of parts is passed to it unchanged."
        )
    return ChatTemplateError(
        f"Rendering the chat template failed: {type(exc).__name__}: {exc}.{hint}"
    )


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """The chat templates of one model and the special tokens its templates may use.

    ``templates`` maps a name to Jinja source (``"default"`` for a model's only template);
    ``limits`` bounds each render (size, steps, time: docs/models.md, "Chat").
    """

    templates: dict[str, str] = field(default_factory=dict)
    special_tokens: dict[str, str] = field(default_factory=dict)
    source: str = ""  # where the templates came from, for messages
    limits: RenderLimits = field(default_factory=RenderLimits)

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
        if jinja_file.exists():  # as in transformers: the file wins over the config entry
            templates["default"] = _read_text(jinja_file)
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
        ``add_generation_prompt``. Bad arguments raise ``TypeError`` / ``ValueError``
        naming the argument (and the message and field); anything the template does
        wrong, including reaching a bound of ``limits``, raises ``ChatTemplateError`` (a
        ``ValueError``); a model without a template, ``NoChatTemplateError``.
        """
        _check_flag("add_generation_prompt", add_generation_prompt)
        _check_flag("continue_final_message", continue_final_message)
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "add_generation_prompt=True starts a new assistant turn and "
                "continue_final_message=True continues the last one: choose one (pass "
                "add_generation_prompt=False to continue the final message)."
            )
        copier = _Copier()
        chat = _normalise_messages(messages, copier)
        plain_tools = _normalise_tools(tools, copier)
        variables = _normalise_kwargs(chat_template_kwargs, copier)
        template = _compile(self.select(chat_template, plain_tools))
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
        context = {
            **self.special_tokens,
            "documents": None,
            **variables,
            "messages": chat,
            "tools": plain_tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = render_bounded(template, context, self.limits, copier.sizes)
        except Exception as exc:  # anything the template raised (a KeyboardInterrupt passes)
            raise _failure(exc, chat) from exc
        try:  # a template can write a lone surrogate ('\ud800'): no tokenizer takes it
            check_encodable("The chat template's output", text)
        except ValueError as exc:
            raise ChatTemplateError(str(exc)) from None
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
