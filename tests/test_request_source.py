"""The request-id convention behind the dashboard's "source" column (docs/api.md)."""

from __future__ import annotations

import pytest

from nbengine.request_source import request_source


@pytest.mark.parametrize(
    ("rid", "source"),
    [
        ("server:cmpl-1", "server"),
        ("server:a:b", "server"),
        ("my-app:42", "my-app"),
        ("42", "notebook"),
        ("dash-0", "notebook"),
        ("Server:x", "notebook"),
        ("server:", "notebook"),
        (":x", "notebook"),
        ("a-very-long-source-name:x", "notebook"),
    ],
)
def test_source_is_the_lowercase_prefix_before_a_colon(rid: str, source: str) -> None:
    assert request_source(rid) == source
