from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Tiny matmuls: one torch thread (tests/conftest.py, ``one_torch_thread``)."""
