"""Where a request came from, read off its id: the dashboard's "source" column.

Convention (docs/api.md, "Request sources"): a request id of the form
``"<source>:<rest>"``, where ``<source>`` is a lowercase word (letters, digits, ``_``
or ``-``; at most 16 characters, starting with a letter), comes from ``<source>``. The
OpenAI server (docs/serving.md) names its requests ``"server:<id>"``; every other id
comes from the ``"notebook"``. Reading the source off the id keeps it with the request
wherever the id goes (events, request_stats, the dashboard) without a new field.
"""

from __future__ import annotations

import re

__all__ = ["DEFAULT_SOURCE", "request_source"]

DEFAULT_SOURCE = "notebook"
_SOURCE_RE = re.compile(r"^([a-z][a-z0-9_-]{0,15}):.")


def request_source(request_id: str) -> str:
    """The source of ``request_id``: its ``"<source>:"`` prefix, or ``"notebook"``."""
    m = _SOURCE_RE.match(request_id)
    return m.group(1) if m else DEFAULT_SOURCE
