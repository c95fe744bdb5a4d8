"""``nbengine serve MODEL``: the OpenAI-compatible server as a command, for scripts.

It starts an engine on MODEL, serves it (``Engine.serve``), prints one line with the
URL once it listens, and runs until Ctrl-C or SIGTERM, then stops the server (open
streams end, their requests are aborted with confirmation) and shuts the engine down.
MODEL is resolved as every command resolves one (``nbengine.cli_args.check_model_arg``), and
a port in use is refused in one line before the model loads.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from nbengine.tool_parsers import PARSERS

__all__ = ["add_serve_parser", "run_serve"]

API_KEY_ENV = "NBENGINE_API_KEY"


def add_serve_parser(
    sub: Any,
    parents: list[argparse.ArgumentParser],
    formatter_class: type,
    help_text: str = "serve a model over an OpenAI-compatible HTTP API",
) -> None:
    """Add the ``serve`` subcommand to ``sub`` (argparse subparsers); ``help_text`` is its
    line in ``nbengine --help``."""
    from nbengine.reasoning import REASONING_PARSERS
    from nbengine.server.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TOKENS

    p = sub.add_parser(
        "serve",
        parents=parents,
        formatter_class=formatter_class,
        help=help_text,
        description="Start an engine on MODEL and serve it at http://HOST:PORT/v1 "
        "(/v1/models, /v1/completions, /v1/chat/completions; docs/serving.md). "
        "Runs until Ctrl-C. A HOST other than loopback requires an API key. "
        'Needs the serve extra: pip install "nbengine[serve]".',
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Hugging Face model directory or Hub id (default: the shipped model)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=_port, default=8000, help="port to bind (0: a free one)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"clients must send 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: MODEL as given)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="the most tokens one request may ask for",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="the largest request body accepted",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="streams send a chunk every N tokens after the first",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (a file, or the template itself) replacing the model's own",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split <think> ... </think> from chat replies into reasoning_content",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(PARSERS),
        help="how tool_choice 'auto' replies are parsed into tool calls (default: from "
        "the chat template's format)",
    )
    p.add_argument("--dtype", default="auto", help="model dtype (auto, bfloat16, float32)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the most requests per batch")
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories or Hub ids) a client names as its model",
    )
    p.add_argument("--max-loras", type=int, default=None, help="most adapters in one step")
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535 (0: a free one), got {value}")
    return value


def _listen_error(exc: OSError, host: str, port: int) -> Exception:
    """The one line ``nbengine serve`` prints for a failed bind of (host, port)."""
    from nbengine.cli_args import CliError

    if exc.errno == errno.EADDRINUSE:
        return CliError(f"port {port} is in use on {host}: pass --port N (or 0 for a free one)")
    return CliError(f"cannot listen on {host} port {port}: {exc.strerror or exc}")


def _check_port(host: str, port: int) -> None:
    """Bind (host, port) once and let go, so that a port in use is refused before the
    model loads (the server binds it again; one taken in between fails there, the same
    way)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise _listen_error(exc, host, port) from None


def run_serve(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Run ``nbengine serve``; returns the exit status. ``stop`` ends it (tests)."""
    import nbengine as nb
    from nbengine.cli_args import check_model_arg

    model = check_model_arg(args.model, "MODEL")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    engine_kw: dict[str, Any] = {"dtype": args.dtype}
    if args.max_model_len is not None:
        engine_kw["max_model_len"] = args.max_model_len
    if args.max_num_seqs is not None:
        engine_kw["max_num_seqs"] = args.max_num_seqs
    lora_modules = _lora_modules(args.lora_modules)
    if lora_modules:
        engine_kw["enable_lora"] = True
        engine_kw["max_loras"] = args.max_loras or len(lora_modules)
        if args.max_lora_rank is not None:
            engine_kw["max_lora_rank"] = args.max_lora_rank
    from nbengine.server.limits import is_loopback
    from nbengine.server.server import Server

    if api_key is None and not is_loopback(args.host):  # refuse before loading a model
        raise ValueError(f"binding {args.host!r} needs --api-key (or ${API_KEY_ENV}).")
    _check_port(args.host, args.port)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with nb.Engine(model, **engine_kw) as engine:
        try:
            server = Server(
                engine,
                args.host,
                args.port,
                api_key,
                model_name=args.served_model_name,
                max_tokens=args.max_tokens,
                max_request_bytes=args.max_request_bytes,
                stream_interval=args.stream_interval,
                chat_template=_template(args.chat_template),
                lora_modules=lora_modules,
                reasoning_parser=args.reasoning_parser,
                tool_call_parser=args.tool_call_parser,
            )
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise _listen_error(exc, args.host, args.port) from exc
        with server:
            print(f"nbengine: serving {server.model_name!r} at {server.url}", flush=True)
            try:
                while not stop.wait(0.5):
                    pass
            except KeyboardInterrupt:
                pass
            print("nbengine: stopping", file=sys.stderr, flush=True)
    return 0


def _template(value: str | None) -> str | None:
    """``--chat-template``: the text of a file, or the value itself."""
    if value is not None and Path(value).expanduser().is_file():
        return Path(value).expanduser().read_text(encoding="utf-8")
    return value


def _lora_modules(values: list[str] | None) -> dict[str, str]:
    """``--lora-modules name=path ...`` as a dict (vLLM's form)."""
    from nbengine.cli_args import CliError

    out: dict[str, str] = {}
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise CliError(f"--lora-modules: expected NAME=PATH, got {value!r}")
        if name in out:
            raise CliError(f"--lora-modules: {name!r} is given twice")
        out[name] = path
    return out
