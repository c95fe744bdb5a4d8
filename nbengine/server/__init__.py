"""An OpenAI-compatible HTTP server on a running engine: ``engine.serve()`` (docs/serving.md).

Needs the ``serve`` extra (``pip install 'nbengine[serve]'``: starlette and uvicorn);
importing this package does not, so ``nbengine --help`` works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nbengine.server.server import Server, serve

__all__ = ["Server", "serve"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from nbengine.server import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
