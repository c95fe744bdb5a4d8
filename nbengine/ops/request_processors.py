"""Per-request logits processing beyond penalties: vLLM's ``allowed_token_ids``,
``bad_words`` and per-request ``logits_processors``.

Applied by the sampler (ops/sampling.py) to the rows of requests that set one of them,
after the structured-output mask and before ``min_tokens``, ``logit_bias`` and the
penalties. A batch in which no request sets them never reaches this module (the
sampler's fast path is unchanged).

Cost: ``allowed_token_ids`` and ``bad_words`` are one indexed write per row and step.
A logits processor is a Python call per request per step on the engine core's thread,
holding the whole step (every other request waits for it): keep it cheap, vectorised,
and free of I/O. Each call also copies the row (the processor's private copy) and
checks the result; a step with processors checks once, for all their rows, that a token
is left to sample (on a device, one wait for the device per such step).

A processor fails its own request alone (finish_reason "error"), never the engine:
whatever it raises (any ``BaseException``), or a result that is not a usable row
(docs/errors.md, "Logits processors"). The one exception is a ``KeyboardInterrupt`` on
the main thread, which may be the user's Ctrl-C and propagates.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from nbengine.sampling_params import LogitsProcessor, processor_arity

if TYPE_CHECKING:
    # ops reads what the core's Request holds; it never imports the core at run time
    from nbengine.core.request import Request

logger = logging.getLogger(__name__)


def needs_request_processing(req: Request) -> bool:
    """True when ``req`` sets allowed_token_ids, bad_words or logits_processors."""
    p = req.sampling_params
    return bool(p.allowed_token_ids or p.bad_words_token_ids or p.logits_processors)


def banned_by_bad_words(bad_words: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The tokens that would complete one of ``bad_words`` after ``output_ids``.

    A one-token word is always banned; a longer one only when the output ends with all
    of it but its last token (vLLM's rule: only generated tokens count, not the prompt).
    """
    banned: list[int] = []
    n_out = len(output_ids)
    for word in bad_words:
        k = len(word) - 1
        if k > n_out:
            continue
        if k == 0 or list(output_ids[n_out - k :]) == list(word[:k]):
            banned.append(word[-1])
    return banned


def apply_request_processors(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    """Apply each request's allowed_token_ids, bad_words and logits processors, in place."""
    vocab = logits.shape[1]
    processed: list[int] = []
    for i, req in enumerate(requests):
        p = req.sampling_params
        if p.allowed_token_ids:
            keep = torch.full((vocab,), True, device=logits.device)
            keep[[t for t in p.allowed_token_ids if t < vocab]] = False
            logits[i].masked_fill_(keep, float("-inf"))
        if p.bad_words_token_ids:
            banned = [
                t
                for t in banned_by_bad_words(p.bad_words_token_ids, req.output_token_ids)
                if t < vocab
            ]
            if banned:
                logits[i, banned] = float("-inf")
        if p.logits_processors and req.error is None:
            if _run_processors(logits, i, req):
                processed.append(i)
    if processed:
        _fail_rows_without_a_token(logits, processed, requests)


def _run_processors(logits: torch.Tensor, i: int, req: Request) -> bool:
    """Run ``req``'s processors on a private copy of row ``i``; on success copy the result
    into the row and return True. Any failure (an exception of any kind, or a result
    that is not a usable row) sets ``req.error`` and leaves the row as it was.

    Invariant: nothing a processor does reaches the batch's other rows. It gets its own
    copy of the row (an in-place resize, ``set_`` or ``as_strided`` write stays in that
    copy), and its result is checked fully before the one copy into ``logits[i]``.
    """
    row = logits[i].clone()
    out_ids = list(req.output_token_ids)
    fn: LogitsProcessor | None = None  # the one running, for the message
    try:
        for fn in req.sampling_params.logits_processors or ():
            if processor_arity(fn) == 3:
                res = fn(list(req.prompt_token_ids), out_ids, row)
            else:
                res = fn(out_ids, row)
            problem = _unusable(res, logits)
            if problem is not None:
                req.error = f"logits processor {_processor_name(fn)} returned {problem}"
                logger.warning("request %s: %s", req.request_id, req.error)
                return False
            row = res.detach().to(logits.dtype)
        logits[i].copy_(row)
        return True
    except BaseException as exc:  # fails this request only (docs/errors.md)
        if _may_be_a_users_interrupt(exc):
            raise
        req.error = f"logits processor {_processor_name(fn)} raised {_describe(exc)}"
        if isinstance(exc, KeyboardInterrupt):
            req.error += " (on the engine core's thread: not a kernel interrupt)"
        logger.warning("request %s: %s", req.request_id, req.error)
        return False


def _may_be_a_users_interrupt(exc: BaseException) -> bool:
    """True for a KeyboardInterrupt on the main thread, which may be the user's Ctrl-C
    (Python delivers SIGINT only there) and is never swallowed. On any other thread, the
    engine core's included, it was raised by the processor itself (docs/errors.md,
    "Logits processors")."""
    return isinstance(exc, KeyboardInterrupt) and (
        threading.current_thread() is threading.main_thread()
    )


def _unusable(res: object, logits: torch.Tensor) -> str | None:
    """Why ``res`` cannot replace a row of ``logits`` (None: it can). Reads only
    attributes of plain tensors, so no code of the processor's runs here."""
    if type(res) not in (torch.Tensor, torch.nn.Parameter):
        if issubclass(type(res), torch.Tensor):
            return f"a {type(res).__qualname__} (a torch.Tensor subclass); return a plain tensor"
        return f"{type(res).__qualname__}, not a torch.Tensor"
    assert isinstance(res, torch.Tensor)
    shape = (logits.shape[1],)
    if res.layout != torch.strided or res.is_nested:
        return f"a tensor of layout {res.layout}; return a dense (torch.strided) tensor"
    if res.device != logits.device:
        return f"a tensor on device {res.device}; the logits are on {logits.device}"
    if not res.dtype.is_floating_point:
        return f"a tensor of dtype {res.dtype}; return a real floating-point tensor"
    if tuple(res.shape) != shape:
        return f"a tensor of shape {tuple(res.shape)}; the logits row has shape {shape}"
    needed = (res.storage_offset() + (shape[0] - 1) * res.stride(0) + 1) * res.element_size()
    if shape[0] and res.untyped_storage().nbytes() < needed:
        return (
            f"a tensor whose storage holds {res.untyped_storage().nbytes()} bytes, "
            f"fewer than its shape needs ({needed}); was it resized in place?"
        )
    return None


def _fail_rows_without_a_token(
    logits: torch.Tensor, rows: list[int], requests: Sequence[Request]
) -> None:
    """Fail the requests whose processors left no token that can be sampled (every logit
    -inf or NaN): sampling would otherwise pick an arbitrary id. One check for all rows
    (on a device, one wait for it per step that runs processors)."""
    index = torch.tensor(rows, device=logits.device)
    alive = (logits.index_select(0, index) > float("-inf")).any(dim=1).tolist()
    for i, ok in zip(rows, alive):
        if not ok:
            req = requests[i]
            fns = req.sampling_params.logits_processors or []
            names = ", ".join(_processor_name(f) for f in fns)
            req.error = (
                f"logits processor{'s' if len(fns) > 1 else ''} {names} left no token "
                "that can be sampled (every logit is -inf or NaN)"
            )
            logger.warning("request %s: %s", req.request_id, req.error)


_NAMED_CALLABLES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def _processor_name(fn: object) -> str:
    """A name for ``fn`` in messages, read without calling into it (no ``repr``, no
    ``isinstance``, which may read a ``__class__`` the processor defines)."""
    try:
        target: Any = fn.func if type(fn) is functools.partial else fn
        if issubclass(type(target), _NAMED_CALLABLES):
            return str(target.__qualname__)
        return f"{type(target).__qualname__} object"
    except BaseException as err:  # a name must not escape the guard it reports on
        if _may_be_a_users_interrupt(err):
            raise
        return "(unnamed)"


def _describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, whatever its ``__str__`` does."""
    try:
        text = str(exc)
    except BaseException as err:  # a broken __str__ must not escape the guard
        if _may_be_a_users_interrupt(err):
            raise
        text = "(its message could not be read)"
    return f"{type(exc).__qualname__}: {text}" if text else type(exc).__qualname__
