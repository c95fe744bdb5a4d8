"""The HTTP routes of the OpenAI-compatible server (Starlette ASGI app), docs/serving.md.

Only the engine's public API is used: ``engine.generate`` / ``engine.chat`` return a
handle, ``async for`` streams it on the server's own event loop, and ``handle.cancel_async``
aborts it with the core's confirmation (docs/lifecycle.md, "The invariant").

Each request's engine id is ``"server:" + <id>``, where ``<id>`` is the client's
``X-Request-Id`` header or a fresh ``cmpl-...``/``chatcmpl-...`` id; the ``server:``
prefix is the source the dashboard shows (``nbengine/request_source.py``).

A request that cannot finish is answered, never cut: with the engine gone
(``EngineDeadError``) or the server stopping (``begin_stop``: the request is aborted with
confirmation), a non-streaming request gets a 503 and a stream a last error event, then
``data: [DONE]``. A request that fails on its own while the engine serves on gets its
own error (docs/serving.md, "Errors").
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from nbengine.frontend.handles import RequestHandle
from nbengine.model.chat_template import NoChatTemplateError
from nbengine.outputs import CompletionOutput, RequestOutput
from nbengine.reasoning import ReasoningParser, ReasoningStream
from nbengine.request import EngineDeadError, RequestIdInUseError, RequestStatus
from nbengine.server import protocol as P
from nbengine.server import response_format as RF
from nbengine.server import tool_calls as TC
from nbengine.server.limits import ServerLimits

__all__ = ["ServerLimits", "begin_stop", "build_app", "live_request_ids"]

logger = logging.getLogger(__name__)

SOURCE_PREFIX = "server:"
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_CONTENT_LENGTH_RE = re.compile(r"[0-9]{1,18}")  # ASCII digits: isdigit() also takes '²'
_PROMPT_TOO_LONG_RE = re.compile(r"^The prompt has \d+ tokens, more than ")


def _error(exc: P.ProtocolError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _engine_dead(message: str) -> P.ProtocolError:
    return P.ProtocolError(503, message, type="server_error", code="engine_dead")


def _server_stopping() -> P.ProtocolError:
    return P.ProtocolError(
        503,
        "The server is shutting down; the request was aborted.",
        type="server_error",
        code="server_stopping",
    )


def _no_chat_template(exc: NoChatTemplateError) -> P.ProtocolError:
    """The engine's message is advice for Python callers (and names a local path); an
    HTTP client needs the server's: how the server is given a template."""
    names = re.search(r"one of (\[.*?\])", str(exc))
    if names:  # several named templates, none the default
        what = f"The served model has several chat templates {names.group(1)} and no default"
        which = " (FILE_OR_TEXT may be one of those names)"
    else:
        what, which = "The served model has no chat template", ""
    return P.ProtocolError(
        400,
        f"{what}, so this server cannot render chat messages. Start the server with a "
        f"chat template: nbengine serve MODEL --chat-template FILE_OR_TEXT{which}, or "
        "engine.serve(chat_template=...) with the Jinja source in Python. Or send a "
        "plain prompt to /v1/completions.",
        code="no_chat_template",
    )


class _ServerState:
    """What the routes share: the engine, the served name, the key, the live handles."""

    def __init__(
        self, engine: Any, model_name: str, api_key: str | None, limits: ServerLimits
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key.encode("utf-8") if api_key is not None else None
        self.limits = limits
        self.live: set[RequestHandle] = set()  # handles started and not yet finished
        # Set once by begin_stop(), on the server's loop: the server is shutting down.
        self.stopping = False
        self._stop_event: anyio.Event | None = None  # made on the server's loop, lazily

    def begin_stop(self) -> None:
        """The server is stopping: refuse new requests, end the live ones with a 503 (or
        a stream's error event) after aborting them. Call on the server's loop."""
        self.stopping = True
        if self._stop_event is not None:
            self._stop_event.set()

    async def wait_stop(self) -> None:
        """Return once ``begin_stop`` has been called (on the server's loop)."""
        if self._stop_event is None:
            self._stop_event = anyio.Event()
            if self.stopping:
                self._stop_event.set()
        await self._stop_event.wait()

    # ---------------------------------------------------------------- checks

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode("utf-8") if scheme.lower() == "bearer" else b""
        # Constant time: the comparison does not stop at the first differing byte.
        if not hmac.compare_digest(given, self.api_key):
            raise P.ProtocolError(
                401,
                "Incorrect or missing API key (Authorization: Bearer ...).",
                code="invalid_api_key",
            )

    def check_alive(self) -> None:
        if self.stopping:
            raise P.ProtocolError(
                503, "The server is shutting down.", type="server_error", code="server_stopping"
            )
        if not self.engine.is_alive:
            raise _engine_dead("The engine is not running.")

    def check_model(self, model: str | None) -> Any:
        """The LoRA adapter named by ``model`` (docs/lora.md), None for the base model."""
        if model is None or model == self.model_name:
            return None
        lora = self.engine.lora_by_name(model) if hasattr(self.engine, "lora_by_name") else None
        if lora is None:
            raise P.ProtocolError(
                404,
                f"The model {model!r} does not exist; this server serves {self.model_name!r}.",
                param="model",
                code="model_not_found",
            )
        return lora

    async def read_json(self, request: Request) -> Any:
        limit = self.limits.max_request_bytes
        declared = request.headers.get("content-length")
        if (
            declared is not None
            and _CONTENT_LENGTH_RE.fullmatch(declared)
            and int(declared) > limit
        ):
            raise P.ProtocolError(
                413, f"The request body exceeds {limit} bytes.", code="request_too_large"
            )
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise P.ProtocolError(
                    413, f"The request body exceeds {limit} bytes.", code="request_too_large"
                )
        return P.decode_json(bytes(body))

    def request_id(self, request: Request, prefix: str) -> tuple[str, str]:
        """(the id shown to the client, the engine's request id)."""
        given = request.headers.get("x-request-id")
        if given is None:
            rid = f"{prefix}-{uuid.uuid4().hex}"
        elif not _REQUEST_ID_RE.match(given):
            raise P.ProtocolError(
                400,
                "X-Request-Id must be 1-128 characters of letters, digits and . _ : -",
                param="X-Request-Id",
            )
        else:
            rid = given
        return rid, SOURCE_PREFIX + rid

    def start(self, start: Callable[[], RequestHandle], prompt_field: str) -> RequestHandle:
        """Run ``engine.generate``/``chat`` mapping its errors to HTTP errors; an error
        about the prompt names ``prompt_field`` (``prompt`` or ``messages``)."""
        try:
            handle = start()
        except RequestIdInUseError as exc:
            raise P.ProtocolError(
                409, str(exc), param="X-Request-Id", code="request_id_in_use"
            ) from None
        except EngineDeadError as exc:
            raise _engine_dead(str(exc)) from None
        except NoChatTemplateError as exc:
            raise _no_chat_template(exc) from None
        except (ValueError, TypeError) as exc:
            raise _refusal(str(exc), prompt_field) from None
        self.live.add(handle)
        return handle


def _refusal(message: str, prompt_field: str) -> P.ProtocolError:
    """A 400 for the engine's refusal ``message``, naming the field it is about."""
    param = P.field_of(message)
    code = None
    if param is None and message.startswith(("The prompt", "Prompt ")):
        param = prompt_field
    if _PROMPT_TOO_LONG_RE.match(message):  # max_model_len, the KV pool, the step budget
        code = "context_length_exceeded"  # OpenAI's code for a prompt that does not fit
    return P.ProtocolError(400, message, param=param, code=code)


def _failure(
    state: _ServerState, handle: RequestHandle, out: RequestOutput
) -> P.ProtocolError | None:
    """Why the finished ``out`` is not a result to send, or None if it is one.

    Aborted by the server's stop: 503. Refused by the core (FINISHED_IGNORED; generate()
    refuses such prompts first): 400. Failed on its own while the engine serves on
    (FINISHED_ERROR): 500 with its message (never "engine dead").
    """
    status = out.status
    if status is RequestStatus.FINISHED_ABORTED and state.stopping:
        return _server_stopping()
    final = handle.final_output
    error = out.error or (final.error if final is not None else None)
    if status is RequestStatus.FINISHED_IGNORED:
        return P.ProtocolError(
            400, error or "The request cannot be scheduled.", code="context_length_exceeded"
        )
    if status is RequestStatus.FINISHED_ERROR or error is not None:
        if not state.engine.is_alive:
            return _engine_dead(error or "The engine is not running.")
        return P.ProtocolError(
            500, error or "The request failed.", type="server_error", code="request_failed"
        )
    return None


# ------------------------------------------------------------------- streaming


class _EventStream(Response):
    """A server-sent-event response that aborts its request (confirmed) when the client
    leaves: a task watches ``receive`` for ``http.disconnect`` while chunks are sent."""

    media_type = "text/event-stream"

    def __init__(
        self, state: _ServerState, handle: RequestHandle, events: AsyncIterator[str]
    ) -> None:
        # Not Response.__init__: it would declare a Content-Length for the empty body.
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self._state = state
        self._handle = handle
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handle = self._handle
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()  # the client left: stop streaming

                tg.start_soon(watch)
                tg.start_soon(_abort_on_stop, self._state, handle)
                await send(
                    {
                        "type": "http.response.start",
                        "status": self.status_code,
                        "headers": self.raw_headers,
                    }
                )
                async for event in self._events:
                    await send(
                        {
                            "type": "http.response.body",
                            "body": event.encode("utf-8"),
                            "more_body": True,
                        }
                    )
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except OSError:  # the connection broke while sending
            pass
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()  # type: ignore[attr-defined]
            await _finish(self._state, handle)


async def _abort_on_stop(state: _ServerState, handle: RequestHandle) -> None:
    """When the server begins to stop, abort ``handle`` (confirmed): its consumer then
    sees the aborted final output and answers 503 / a last error event."""
    await state.wait_stop()
    try:
        await handle.cancel_async()
    except EngineDeadError:
        pass  # the consumer sees the engine's end itself


async def _finish(state: _ServerState, handle: RequestHandle) -> None:
    """Abort ``handle`` unless it finished, awaiting the core's confirmation (shielded from
    the cancellation that brought us here), so its id is free when this returns."""
    try:
        if not handle.done():
            with anyio.CancelScope(shield=True):
                await handle.cancel_async()
    except EngineDeadError:
        pass
    finally:
        state.live.discard(handle)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _await_final(
    state: _ServerState, request: Request, handle: RequestHandle
) -> RequestOutput | P.ProtocolError | None:
    """The final output; the error to answer when it cannot finish (engine gone, server
    stopping, the request failed); or None if the client disconnected first (the request
    was then aborted with confirmation)."""
    box: list[RequestOutput] = []
    dead: EngineDeadError | None = None
    try:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            tg.start_soon(_abort_on_stop, state, handle)
            # FINAL_ONLY: the one stream output is the final one; iterating (rather than
            # `await handle`) ends it cleanly when this scope is cancelled.
            try:
                async for out in handle:
                    box.append(out)
            except EngineDeadError as exc:
                dead = exc
            tg.cancel_scope.cancel()
    finally:
        await _finish(state, handle)
    if dead is not None:
        return _engine_dead(str(dead))
    if not box or not box[-1].finished:
        return None
    return _failure(state, handle, box[-1]) or box[-1]


async def _final_response(
    state: _ServerState,
    request: Request,
    handle: RequestHandle,
    head: dict[str, Any],
    choice: Callable[[CompletionOutput], dict[str, Any]],
) -> Response:
    """A non-streaming route's answer: the final output's choices (each written by the
    route's ``choice``) and usage; the error when it cannot finish; 499 when the client
    left first."""
    final = await _await_final(state, request, handle)
    if final is None:
        return Response(status_code=499)
    if isinstance(final, P.ProtocolError):
        return _error(final)
    choices = [choice(c) for c in final.outputs]
    n_out = sum(len(c.token_ids) for c in final.outputs)
    return JSONResponse(
        {**head, "choices": choices, "usage": P.usage(len(final.prompt_token_ids), n_out)}
    )


# ---------------------------------------------------------------------- routes


def build_app(
    engine: Any,
    model_name: str,
    api_key: str | None = None,
    *,
    chat_template: str | None = None,
    limits: ServerLimits | None = None,
    reasoning_parser: ReasoningParser | None = None,
    tool_call_parser: str | None = None,
) -> Starlette:
    """The ASGI app serving ``engine`` as ``model_name`` (see the module docstring).
    ``chat_template`` (Jinja source or a template name) replaces the model's own for
    /v1/chat/completions, as vLLM's ``--chat-template`` does; ``reasoning_parser`` splits
    chat replies into ``reasoning_content`` and ``content`` (nbengine/reasoning.py);
    ``tool_call_parser`` parses tool_choice "auto" replies (default: from the template;
    tool_calls.py). The reasoning is split first: only the content is parsed for calls."""
    state = _ServerState(engine, model_name, api_key, limits or ServerLimits())
    tokenizer = engine.tokenizer
    tool_parser = TC.server_parser(tokenizer, chat_template, tool_call_parser)

    async def models(request: Request) -> Response:
        try:
            state.check_key(request)
        except P.ProtocolError as exc:
            return _error(exc)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_name,
                        "object": "model",
                        "created": P.now(),
                        "owned_by": "nbengine",
                        "max_model_len": getattr(engine, "max_model_len", None),
                    }
                ]
                + [  # LoRA adapters, as vLLM lists them
                    {
                        "id": r.lora_name,
                        "object": "model",
                        "created": P.now(),
                        "owned_by": "nbengine",
                        "parent": model_name,
                        "root": str(r.lora_path),
                    }
                    for r in getattr(engine, "lora_requests", list)()
                ],
            }
        )

    async def health(request: Request) -> Response:
        if engine.is_alive:
            return Response(status_code=200)
        return _error(_engine_dead("The engine is not running."))

    async def completions(request: Request) -> Response:
        constraint: RF.Constraint | None = None
        try:
            state.check_key(request)
            req = P.parse_request(P.CompletionRequest, await state.read_json(request))
            lora = state.check_model(req.model)
            state.check_alive()
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                if len(prompt) != 1:
                    raise P.ProtocolError(
                        400,
                        "prompt: one prompt per request (send one request per prompt).",
                        param="prompt",
                    )
                prompt = prompt[0]
            params = P.to_sampling_params(
                req,
                defaults=engine.get_default_sampling_params(),
                max_tokens_limit=state.limits.max_tokens,
                stream_interval=state.limits.stream_interval,
            )
            constraint = RF.constraint_of(req)
            params = RF.constrained(params, constraint)
            rid, engine_id = state.request_id(request, "cmpl")
            handle = state.start(
                lambda: engine.generate(prompt, params, request_id=engine_id, lora_request=lora),
                "prompt",
            )
        except P.ProtocolError as exc:
            return _error(RF.name_field(exc, constraint))
        created = P.now()
        served = model_name if lora is None else lora.lora_name
        head = {"id": rid, "object": "text_completion", "created": created, "model": served}
        if req.stream:
            return _EventStream(
                state,
                handle,
                _events(
                    state, handle, head, _CompletionChunks(head, tokenizer), req.stream_options
                ),
            )

        def choice(c: CompletionOutput) -> dict[str, Any]:
            return {
                "index": c.index,
                "text": c.text,
                "logprobs": P.completion_logprobs(tokenizer, c, 0),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }

        return await _final_response(state, request, handle, head, choice)

    async def chat_completions(request: Request) -> Response:
        constraint: RF.Constraint | None = None
        try:
            state.check_key(request)
            req = P.parse_request(P.ChatCompletionRequest, await state.read_json(request))
            lora = state.check_model(req.model)
            state.check_alive()
            params = P.to_sampling_params(
                req,
                defaults=engine.get_default_sampling_params(),
                max_tokens_limit=state.limits.max_tokens,
                stream_interval=state.limits.stream_interval,
            )
            constraint = RF.constraint_of(req)
            params = RF.constrained(params, constraint)
            tool = TC.tool_setup(req.tools, req.tool_choice, req.parallel_tool_calls, tool_parser)
            params = tool.sampling(params)
            messages = TC.tool_messages([P.chat_content(m) for m in req.messages])
            rid, engine_id = state.request_id(request, "chatcmpl")
            handle = state.start(
                lambda: engine.chat(
                    messages,
                    params,
                    request_id=engine_id,
                    chat_template=chat_template,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    chat_template_kwargs=req.chat_template_kwargs,
                    lora_request=lora,
                    tools=tool.template_tools,
                    tool_call_parser="none",  # the server parses (tool_calls.py)
                ),
                "messages",
            )
        except P.ProtocolError as exc:
            return _error(RF.name_field(exc, constraint))
        top_n = req.top_logprobs or 0
        served = model_name if lora is None else lora.lora_name
        head = {"id": rid, "object": "chat.completion", "created": P.now(), "model": served}
        if req.stream:
            chunk_head = {**head, "object": "chat.completion.chunk"}
            want_logprobs = handle.sampling_params.logprobs is not None
            n = handle.sampling_params.n
            splits = None
            if reasoning_parser is not None:  # one splitter per choice
                splits = [reasoning_parser.stream(handle.prompt) for _ in range(n)]
            render = _ChatChunks(chunk_head, tokenizer, top_n, n, want_logprobs, splits, tool)
            return _EventStream(
                state, handle, _events(state, handle, chunk_head, render, req.stream_options)
            )

        def choice(c: CompletionOutput) -> dict[str, Any]:
            if reasoning_parser is None:
                message, finish_reason = tool.message(c)
            else:  # the thinking first; only the content may hold tool calls
                reasoning, content = reasoning_parser.split(c.text, handle.prompt)
                message, finish_reason = tool.message(c, text=content or "")
                message["content"] = message["content"] or None
                message["reasoning_content"] = reasoning
            return {
                "index": c.index,
                "message": message,
                "logprobs": P.chat_logprobs(tokenizer, c, top_n) if req.logprobs else None,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            }

        return await _final_response(state, request, handle, head, choice)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        message = getattr(exc, "detail", None) or "Error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(status)
        return _error(P.ProtocolError(status, str(message), code=code))

    app = Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
    )
    app.state.nbengine = state
    return app


def live_request_ids(app: Starlette) -> list[str]:
    """The engine ids of the requests ``app`` started that have not finished."""
    state: _ServerState = app.state.nbengine
    return [h.request_id for h in list(state.live) if not h.done()]


def begin_stop(app: Starlette) -> None:
    """Tell ``app``'s routes that the server is stopping (call on the server's loop):
    new requests get 503, live ones are aborted and answered 503 / a last error event."""
    state: _ServerState = app.state.nbengine
    state.begin_stop()


# ------------------------------------------------------------------ event bodies


_dumps = json.JSONEncoder(separators=(",", ":")).encode


def _prefix(head: dict[str, Any]) -> str:
    """The JSON of a chunk up to its first choice: ``{"id":...,"choices":[``."""
    return _dumps(head)[:-1] + ',"choices":['


def _plain(out: RequestOutput, want_logprobs: bool) -> bool:
    """True for an output that is one unfinished choice without logprobs (most chunks),
    which the streams write from a template rather than through a dict."""
    return (
        not out.finished
        and out.error is None
        and len(out.outputs) == 1
        and not want_logprobs
        and out.outputs[0].finish_reason is None
    )


def _usage_state(stream_options: P.StreamOptions | None) -> bool:
    return stream_options is not None and stream_options.include_usage


def _error_event(exc: P.ProtocolError) -> str:
    """A stream's last event before ``[DONE]``: the error, in OpenAI's shape."""
    return _sse(exc.body())


class _Outputs:
    """``handle``'s stream outputs; when the request cannot finish (the engine gone, the
    server stopping, the request failed), a ProtocolError instead of its last output.

    An iterator object rather than an async generator: a stream left early (the client
    gone) holds no suspended frame to finalize; ``_finish`` aborts the request.
    """

    def __init__(self, state: _ServerState, handle: RequestHandle) -> None:
        self._state = state
        self._handle = handle
        self._stream = aiter(handle)
        self._done = False

    def __aiter__(self) -> _Outputs:
        return self

    async def __anext__(self) -> RequestOutput | P.ProtocolError:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await anext(self._stream)
        except EngineDeadError as exc:
            self._done = True
            return _engine_dead(str(exc))
        failure = _failure(self._state, self._handle, out) if out.finished else None
        if failure is None:
            return out
        self._done = True
        return failure


class _ChunkRenderer(Protocol):
    """How one streaming route writes its chunks (``_events`` writes the rest: the usage
    chunk, the error event and ``[DONE]``, the same for every route)."""

    def opening(self) -> list[str]:
        """The events sent before the first output."""
        ...

    def plain(self, c: CompletionOutput) -> str | None:
        """The event of the common chunk (``_plain``), written from a template; None:
        nothing to send for it."""
        ...

    def choice(self, c: CompletionOutput) -> dict[str, Any]:
        """One choice of a chunk written through a dict (logprobs, finish, n > 1)."""
        ...


class _CompletionChunks:
    """``/v1/completions`` chunks: ``text`` and its logprobs, offsets counted per choice."""

    def __init__(self, head: dict[str, Any], tokenizer: Any) -> None:
        self._prefix = _prefix(head)
        self._tokenizer = tokenizer
        self._offsets: dict[int, int] = {}  # text already sent, per choice index

    def opening(self) -> list[str]:
        return []

    def plain(self, c: CompletionOutput) -> str | None:
        if not c.text and not c.token_ids:
            return None
        return (
            f'data: {self._prefix}{{"index":{c.index},"text":{_dumps(c.text)},'
            '"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        )

    def choice(self, c: CompletionOutput) -> dict[str, Any]:
        offset = self._offsets.get(c.index, 0)
        lp = P.completion_logprobs(self._tokenizer, c, offset)
        self._offsets[c.index] = offset + len(c.text)
        return {
            "index": c.index,
            "text": c.text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }


class _ChatChunks:
    """``/v1/chat/completions`` chunks: the assistant role first, then content deltas
    (with a reasoning parser, ``reasoning_content`` and ``content`` deltas)."""

    def __init__(
        self,
        head: dict[str, Any],
        tokenizer: Any,
        top_n: int,
        n: int,
        want_logprobs: bool,
        reasoning: list[ReasoningStream] | None = None,
        tool: TC.ToolSetup | None = None,
    ) -> None:
        self._head = head
        self._reasoning = reasoning  # a splitter per choice index, or None
        self._prefix = _prefix(head)
        self._tokenizer = tokenizer
        self._top_n = top_n
        self._n = n
        self._want_logprobs = want_logprobs
        # With tool calls parsed: each choice's deltas go through its ChoiceStream.
        self._tool = tool if tool is not None and tool.parses else None
        self._tool_streams: dict[int, TC.ChoiceStream] = {}

    def _tool_stream(self, index: int) -> TC.ChoiceStream:
        assert self._tool is not None
        stream = self._tool_streams.get(index)
        if stream is None:
            stream = self._tool_streams[index] = self._tool.stream()
        return stream

    def opening(self) -> list[str]:
        # The role first, one chunk per choice, as OpenAI sends it.
        return [
            _sse(
                {
                    **self._head,
                    "choices": [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                }
            )
            for i in range(self._n)
        ]

    def plain(self, c: CompletionOutput) -> str | None:
        if self._tool is not None or self._reasoning is not None:
            delta = self._delta(c)
            if not delta:  # all of it held back: it may be part of a tag or a call
                return None
            return (
                f'data: {self._prefix}{{"index":{c.index},"delta":{_dumps(delta)},'
                '"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            )
        if not c.text:
            return None
        return (
            f'data: {self._prefix}{{"index":{c.index},"delta":{{"content":'
            f'{_dumps(c.text)}}},"logprobs":null,"finish_reason":null,'
            '"stop_reason":null}]}\n\n'
        )

    def choice(self, c: CompletionOutput) -> dict[str, Any]:
        lp = P.chat_logprobs(self._tokenizer, c, self._top_n) if self._want_logprobs else None
        delta = self._delta(c)
        finish_reason = c.finish_reason
        if self._tool is not None:
            finish_reason = self._tool_stream(c.index).finish_reason(finish_reason)
        return {
            "index": c.index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish_reason,
            "stop_reason": c.stop_reason,
        }

    def _delta(self, c: CompletionOutput) -> dict[str, Any]:
        """The ``delta`` of ``c``'s new text. With a reasoning parser it is split into
        ``reasoning_content`` and content first (text that may begin a tag waits for the
        next chunk, and is released by the choice's last one); with tool calls parsed, the
        content then goes through the choice's ``ChoiceStream`` (content and
        ``tool_calls`` entries)."""
        final = c.finish_reason is not None
        text = c.text
        delta: dict[str, Any] = {}
        if self._reasoning is not None:
            reasoning, text = self._reasoning[c.index].feed(c.text, final=final)
            if reasoning:
                delta["reasoning_content"] = reasoning
        if self._tool is not None:
            delta.update(self._tool_stream(c.index).delta(text, final))
        elif text:
            delta["content"] = text
        return delta


async def _events(
    state: _ServerState,
    handle: RequestHandle,
    head: dict[str, Any],
    render: _ChunkRenderer,
    stream_options: P.StreamOptions | None,
) -> AsyncIterator[str]:
    """A streaming route's server-sent events: ``render``'s opening and chunks, the usage
    chunk when asked for, an error event where the request cannot finish, ``[DONE]``."""
    n_out = 0
    want_logprobs = handle.sampling_params.logprobs is not None
    for event in render.opening():
        yield event
    async for out in _Outputs(state, handle):
        if isinstance(out, P.ProtocolError):
            yield _error_event(out)
            break
        if _plain(out, want_logprobs):  # the common chunk: one choice, text only
            c = out.outputs[0]
            n_out += len(c.token_ids)
            chunk = render.plain(c)
            if chunk is not None:
                yield chunk
            continue
        choices = []
        for c in out.outputs:
            n_out += len(c.token_ids)
            if not c.text and not c.token_ids and c.finish_reason is None:
                continue
            choices.append(render.choice(c))
        if choices:
            yield _sse({**head, "choices": choices})
        if out.finished and _usage_state(stream_options):
            yield _sse(
                {**head, "choices": [], "usage": P.usage(len(handle.prompt_token_ids), n_out)}
            )
    yield "data: [DONE]\n\n"
