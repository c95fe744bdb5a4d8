"""The OpenAI-compatible wire format: request models, validation, response bodies.

Requests are parsed with pydantic in strict mode (a string where a number belongs is a
400 naming the field, never a silent coercion) and turned into ``SamplingParams``
whose own validation (``nbengine/sampling_params.py``) names the field of any value out
of range. Every error leaves as OpenAI's JSON error shape::

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Bodies are decoded by ``decode_json``, which refuses what Python's decoder would accept
but the rest of the server cannot take: nesting deeper than ``MAX_JSON_DEPTH``, integers
longer than ``MAX_JSON_INT_DIGITS`` digits, ``NaN``/``Infinity`` and numbers beyond a
float's range, each a 400 naming the field.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from nbengine.outputs import CompletionOutput
from nbengine.sampling_params import RequestOutputKind, SamplingParams
from nbengine.server.limits import MAX_JSON_DEPTH, MAX_JSON_INT_DIGITS

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "ProtocolError",
    "decode_json",
    "parse_request",
    "to_sampling_params",
]

_FIELD_RE = re.compile(r"^([a-z_]+) ")
# A token id as logit_bias keys write it: ASCII digits only (str.isdigit() also takes
# '²' and '٣', which int() then refuses or reads as another number).
_TOKEN_ID_RE = re.compile(r"[0-9]{1,18}")
# What the nesting scan looks at: a whole JSON string (brackets inside it do not count),
# a bracket, or the colon after an object's key.
_JSON_TOKEN_RE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:]')
_LONG_DIGITS_RE = re.compile(rf"[0-9]{{{MAX_JSON_INT_DIGITS + 1},}}")


class ProtocolError(Exception):
    """An error to answer with OpenAI's error shape and ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Strict(BaseModel):
    # Unknown fields are refused (400 naming them): a field we would silently ignore
    # (audio, prediction, ...) would return something other than what was asked.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(_Strict):
    """The sampling fields both routes share (OpenAI's, then vLLM's extras)."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[StrictStr, float] | None = None
    user: StrictStr | None = None  # accepted and ignored, as OpenAI's own routes do
    # vLLM's extra sampling parameters.
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # vLLM's structured-output extras, read by nbengine/server/response_format.py.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt (text or token ids)."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class ChatMessage(BaseModel):
    """One message; content is text or a list of ``{"type": "text", "text": ...}`` parts."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: a conversation rendered by the chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None  # read by response_format.py
    # Tool calls (nbengine/server/tool_calls.py checks them).
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True


def short(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to about ``limit`` characters for an error message."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class _Refused:
    """A JSON number the decoder met and refused; reported with its field afterwards."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why


def decode_json(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The request body decoded as JSON, or a ProtocolError(400) naming the field at fault.

    Python's decoder recurses once per level (RecursionError on deep input), converts
    integers of any length (in quadratic time, up to ``sys.get_int_max_str_digits()``),
    and accepts ``NaN``, ``Infinity`` and ``1e999`` (infinite). Each is refused here.
    """
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")
    except UnicodeDecodeError as exc:
        raise ProtocolError(400, f"The request body is not valid JSON: {exc}.") from None
    if text.count("[") + text.count("{") > max_depth:  # else it cannot nest that deep
        too_deep, field = _nesting_above(text, max_depth)
        if too_deep:
            where = f"{field}: the value" if field is not None else "The request body"
            raise ProtocolError(
                400,
                f"{where} is nested more than {max_depth} levels deep (arrays and objects).",
                param=field,
            )
    refused: list[_Refused] = []

    def refuse(why: str) -> _Refused:
        refused.append(_Refused(why))
        return refused[-1]

    def number(literal: str) -> float | _Refused:
        value = float(literal)
        if math.isfinite(value):
            return value
        return refuse(f"{short(literal)} is beyond the range of a float")

    def integer(literal: str) -> int | _Refused:
        digits = len(literal.lstrip("-"))
        if digits > MAX_JSON_INT_DIGITS:
            return refuse(
                f"an integer of {digits} digits is refused (at most {MAX_JSON_INT_DIGITS})"
            )
        return int(literal)

    def constant(name: str) -> _Refused:
        return refuse(f"{name} is not a JSON number")

    # Integers go through `integer` only when the text has a long run of digits: a
    # Python call per number would slow down prompts of token ids.
    long_digits = _LONG_DIGITS_RE.search(text) is not None
    try:
        value = json.loads(
            text,
            parse_float=number,
            parse_int=integer if long_digits else None,
            parse_constant=constant,
        )
    except RecursionError:  # not reached after the scan above; kept as a guard
        raise ProtocolError(
            400, f"The request body is nested more than {max_depth} levels deep."
        ) from None
    except ValueError as exc:
        raise ProtocolError(400, f"The request body is not valid JSON: {exc}.") from None
    if refused:
        path, why = _find_refused(value)
        raise ProtocolError(400, f"{path}: {why}." if path else f"{why}.", param=path)
    return value


def _nesting_above(text: str, limit: int) -> tuple[bool, str | None]:
    """(True, the top-level key it is under) if ``text`` nests deeper than ``limit``.

    A scan of strings and brackets, without recursion; ``text`` need not be valid JSON
    (the decoder judges that).
    """
    depth = 0
    last: str | None = None  # the last string: an object's key when a colon follows
    key: str | None = None
    for m in _JSON_TOKEN_RE.finditer(text):
        token = m.group()
        c = token[0]
        if c == '"':
            last = token
        elif c == ":":
            if depth == 1:
                key = last
        elif c in "[{":
            depth += 1
            if depth > limit:
                return True, _unquote(key) if key is not None else None
        else:
            depth -= 1
    return False, None


def _unquote(token: str) -> str:
    try:
        value = json.loads(token)
    except ValueError:
        value = token[1:-1]
    return value if len(value) <= 60 else value[:60] + "..."


def _find_refused(value: Any) -> tuple[str | None, str]:
    """The dotted path of the first ``_Refused`` in a decoded body, and why."""
    if isinstance(value, _Refused):
        return None, value.why
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(child, _Refused):
                return ".".join((*path, str(key))), child.why
            if isinstance(child, (dict, list)):
                stack.append((child, (*path, str(key))))
    return None, "a number in the body is refused"


def parse_request(cls: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body as ``cls``; a ProtocolError(400) names the field."""
    if not isinstance(body, dict):
        raise ProtocolError(
            400, f"The request body must be a JSON object, got {type(body).__name__}."
        )
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"])[:200] or None
        raise ProtocolError(400, f"{param}: {err['msg']}", param=param) from None


def field_of(message: str) -> str | None:
    m = _FIELD_RE.match(message)
    return m.group(1) if m else None


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    defaults: SamplingParams,
    max_tokens_limit: int,
    stream_interval: int = 1,
) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``req`` (ProtocolError 400 naming the field).

    Unset fields take the model's defaults (``defaults``: generation_config.json), as
    vLLM's server does; ``max_tokens`` defaults to 16 for completions (OpenAI's default)
    and to ``max_tokens_limit`` for chat, and may not exceed ``max_tokens_limit``.
    """
    chat = isinstance(req, ChatCompletionRequest)
    max_tokens = req.max_tokens
    name = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = max_tokens_limit if chat else min(16, max_tokens_limit)
    elif max_tokens > max_tokens_limit:
        raise ProtocolError(
            400,
            f"{name} must be at most {max_tokens_limit} on this server, got {max_tokens}.",
            param=name,
        )
    if isinstance(req, ChatCompletionRequest):  # that is, chat
        logprobs = req.top_logprobs or 0 if req.logprobs else None
        if req.top_logprobs is not None and not req.logprobs:
            raise ProtocolError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise ProtocolError(
                400,
                f"top_logprobs must be in [0, 20], got {req.top_logprobs}.",
                param="top_logprobs",
            )
    else:
        logprobs = req.logprobs
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise ProtocolError(
                400, f"logprobs must be in [0, 20], got {logprobs}.", param="logprobs"
            )
        if req.suffix is not None:
            raise ProtocolError(400, "suffix is not supported.", param="suffix")
        if req.echo:
            raise ProtocolError(400, "echo is not supported.", param="echo")
        if req.best_of is not None and req.best_of != req.n:
            raise ProtocolError(400, "best_of other than n is not supported.", param="best_of")
    bias: dict[int, float] | None = None
    if req.logit_bias is not None:
        bias = {}
        for tok, value in req.logit_bias.items():
            if not _TOKEN_ID_RE.fullmatch(tok):
                raise ProtocolError(
                    400,
                    'logit_bias keys must be token ids in decimal digits (such as "50256"), '
                    f"got {short(tok)}.",
                    param="logit_bias",
                )
            bias[int(tok)] = value
    fields: dict[str, Any] = dict(
        n=req.n,
        max_tokens=max_tokens,
        stop=req.stop,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=bias,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        logprobs=logprobs,
        output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
        stream_interval=stream_interval if req.stream else 1,
    )
    for opt in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, opt)
        if value is not None:
            fields[opt] = value
    try:
        return defaults.replace(**fields)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        param = field_of(message)
        if param == "max_tokens" and name != "max_tokens":
            message, param = message.replace("max_tokens", name, 1), name
        raise ProtocolError(400, message, param=param) from None


def chat_content(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template takes it: text parts joined into one string."""
    out = message.model_dump(exclude_none=False)
    content = message.content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ProtocolError(
                    400, "Only text content parts are supported.", param=f"messages.content.{i}"
                )
            texts.append(part["text"])
        out["content"] = "".join(texts)
    elif content is None:
        out["content"] = ""
    return out


# ------------------------------------------------------------------ responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_str(tokenizer: Any, token_id: int, lp: Any) -> str:
    text = getattr(lp, "decoded_token", None)
    if text is None:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
    return text


def completion_logprobs(
    tokenizer: Any, comp: CompletionOutput, offset: int
) -> dict[str, Any] | None:
    """The legacy completions ``logprobs`` object for ``comp``'s tokens (or None)."""
    if comp.logprobs is None:
        return None
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    for tok, pos in zip(comp.token_ids, comp.logprobs):
        chosen = pos.get(tok)
        text = _token_str(tokenizer, tok, chosen)
        tokens.append(text)
        token_logprobs.append(chosen.logprob if chosen is not None else float("nan"))
        top.append({_token_str(tokenizer, t, lp): lp.logprob for t, lp in pos.items()})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Any, comp: CompletionOutput, top_n: int) -> dict[str, Any] | None:
    """The chat ``logprobs`` object (``{"content": [...]}``) for ``comp``'s tokens."""
    if comp.logprobs is None:
        return None
    content = []
    for tok, pos in zip(comp.token_ids, comp.logprobs):
        chosen = pos.get(tok)
        text = _token_str(tokenizer, tok, chosen)
        ranked = sorted(pos.items(), key=lambda kv: (kv[1].rank or 0, -kv[1].logprob))
        top = [
            _entry(_token_str(tokenizer, t, lp), lp.logprob)
            for t, lp in ranked
            if t != tok or (lp.rank or 0) <= top_n
        ][:top_n]
        content.append(
            {
                **_entry(text, chosen.logprob if chosen is not None else float("nan")),
                "top_logprobs": top,
            }
        )
    return {"content": content}


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def now() -> int:
    """``created``: whole seconds since the epoch."""
    return int(time.time())
