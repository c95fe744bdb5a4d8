from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # for nbe_driver


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # Tiny matmuls on a shared 2-core machine: OpenMP barriers between two threads cost
    # milliseconds when the other core is busy; one thread is faster and steadier.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
