"""An OpenAI-compatible HTTP server on a running engine: ``engine.serve()`` (docs/serving.md).

Needs the ``serve`` extra (``pip install 'nbengine[serve]'``: starlette and uvicorn).
"""

from nbengine.server.server import Server, serve

__all__ = ["Server", "serve"]
