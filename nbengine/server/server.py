"""``Server``: the OpenAI-compatible HTTP server of a running engine (docs/serving.md).

uvicorn runs the Starlette app on its own thread (``nbengine-server``) with its own
asyncio loop. It does not share the engine's loop (``nbengine-loop``): that loop owns the
frontend state and processes every output batch, and HTTP parsing, JSON encoding and
socket writes there would delay output processing for the notebook's requests too. The
server thread reaches the engine only through the public, thread-safe API
(``generate``/``chat`` return handles at once; ``async for`` on a handle resumes the
server's loop thread-safely), the same way a notebook cell does. docs/benchmarks.md
("Serving overhead") has the measured cost.

The socket is bound on the caller's thread before ``serve()`` returns, so a port in use
raises there, and ``port=0`` picks a free port (``server.url`` names it).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
from typing import Any

from nbengine.reasoning import get_reasoning_parser
from nbengine.server.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_TOKENS,
    ServerLimits,
    is_loopback,
)

__all__ = ["Server", "serve"]

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 30.0


class Server:
    """A running server: ``url``, ``stop()``, and a context manager that stops it."""

    def __init__(
        self,
        engine: Any,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
        *,
        model_name: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        stream_interval: int = 1,
        chat_template: str | None = None,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
        log_level: str = "warning",
        lora_modules: dict[str, str] | None = None,
    ) -> None:
        try:
            import uvicorn

            from nbengine.server.app import build_app
            from nbengine.server.connections import uvicorn_options
        except ImportError as exc:
            raise ImportError(
                f"engine.serve() needs the serve extra (pip install 'nbengine[serve]'): {exc}"
            ) from exc

        if not isinstance(host, str) or not host:
            raise TypeError(f"host must be a non-empty string, got {host!r}.")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}.")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be a non-empty string or None.")
        if api_key is None and not is_loopback(host):
            raise ValueError(
                f"Binding {host!r} exposes the engine beyond this machine: give an api_key "
                "(clients then send 'Authorization: Bearer <api_key>'), or bind 127.0.0.1."
            )
        for name, value in (
            ("max_request_bytes", max_request_bytes),
            ("max_tokens", max_tokens),
            ("stream_interval", stream_interval),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        parser = None if reasoning_parser is None else get_reasoning_parser(reasoning_parser)
        if not engine.is_alive:
            from nbengine.request import EngineDeadError

            raise EngineDeadError("The engine is not running; it cannot be served.")
        add_lora_modules(engine, lora_modules)
        self.engine = engine
        self.model_name = model_name or default_model_name(engine)
        self.app = build_app(
            engine,
            self.model_name,
            api_key,
            chat_template=chat_template,
            limits=ServerLimits(max_request_bytes, max_tokens, stream_interval),
            reasoning_parser=parser,
            tool_call_parser=tool_call_parser,
        )
        self._sock = _listen(host, port)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level=log_level,
            loop="asyncio",
            lifespan="off",
            timeout_graceful_shutdown=2,
            access_log=False,
            # Bounded per connection: idle ones closed, request heads limited.
            **uvicorn_options(),
        )
        self._uvicorn = uvicorn.Server(config)
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the server thread's, once it runs
        self._thread = threading.Thread(target=self._run, name="nbengine-server", daemon=True)
        self._thread.start()
        self._wait_started()

    @property
    def url(self) -> str:
        """The base URL of the OpenAI API (``http://host:port/v1``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by _wait_started or logged
            self._error = exc
            logger.exception("the nbengine server stopped with an error")

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._uvicorn.serve(sockets=[self._sock])

    def _wait_started(self) -> None:
        import time

        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"The server did not start: {self._error!r}")
            time.sleep(0.01)

    @property
    def running(self) -> bool:
        """True while the server thread serves."""
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving: live requests are aborted (confirmed) and answered 503 (a stream
        with a last error event, then ``[DONE]``), and the port is closed. Idempotent."""
        from nbengine.server.app import begin_stop, live_request_ids

        loop = self._loop
        if loop is not None and self._thread.is_alive():
            # Before uvicorn's shutdown, so the routes answer within its grace period
            # rather than being cancelled at its end (a 500 or a cut stream).
            try:
                loop.call_soon_threadsafe(begin_stop, self.app)
            except RuntimeError:  # the loop has closed: nothing is being served
                pass
        self._uvicorn.should_exit = True
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._uvicorn.force_exit = True
                self._thread.join(timeout)
        leftover = live_request_ids(self.app)
        if leftover and self.engine.is_alive:  # streams cut by the shutdown
            try:
                self.engine.abort(leftover, timeout=timeout)
            except Exception:
                logger.exception("aborting the server's requests at stop failed")
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"Server(url={self.url!r}, model={self.model_name!r}, {state})"


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port).

    Made with ``proto=IPPROTO_TCP`` (``socket.create_server`` leaves it 0): asyncio sets
    TCP_NODELAY only on accepted sockets of that protocol, and without it a small chunk
    written after another waits for the client's delayed ACK (about 40 ms on Linux).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        # Same class and errno (callers tell a port in use by errno.EADDRINUSE), but a
        # message that names the address: the OS's own names neither host nor port.
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        hint = (
            f"; port {port} is in use: pass another port, or port=0 for a free one"
            if exc.errno == errno.EADDRINUSE
            else ""
        )
        what = exc.strerror or exc
        raise type(exc)(exc.errno, f"Cannot listen on {where}: {what}{hint}.") from exc
    except BaseException:
        sock.close()
        raise
    return sock


def add_lora_modules(engine: Any, lora_modules: dict[str, str] | None) -> None:
    """Load ``{name: adapter path or Hub id}`` into ``engine`` (vLLM's ``--lora-modules``),
    each under the next free ``lora_int_id``; a client names one as its ``model``."""
    if not lora_modules:
        return
    if not isinstance(lora_modules, dict):
        raise TypeError(f"lora_modules must be a dict of name -> path, got {lora_modules!r}.")
    from nbengine.lora.request import LoRARequest

    next_id = max(engine.list_loras(), default=0) + 1
    for name, path in lora_modules.items():
        engine.add_lora(LoRARequest(name, next_id, path))
        next_id += 1


def default_model_name(engine: Any) -> str:
    """The name ``/v1/models`` lists: the ``model`` the engine was built with (a path or
    a Hub id, as vLLM names it), or ``"nbengine-default"`` for the shipped model."""
    model = engine.config.model.model
    return "nbengine-default" if model is None else str(model)


def serve(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    **kwargs: Any,
) -> Server:
    """``Engine.serve``: start a ``Server`` on ``engine`` and return it once it listens."""
    return Server(engine, host, port, api_key, **kwargs)
