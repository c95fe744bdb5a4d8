"""Where each parameter of our modules comes from in a Hugging Face checkpoint."""

from __future__ import annotations

from typing import NamedTuple


class WeightSource(NamedTuple):
    """Rows ``[offset, offset + rows)`` (dim 0) of a parameter come from HF tensor ``name``.

    ``transpose`` marks GPT-2's Conv1D tensors, stored ``[in, out]``: they are transposed
    to ``nn.Linear``'s ``[out, in]`` before the rows are placed.
    """

    name: str
    offset: int
    rows: int
    transpose: bool = False


WeightMap = dict[str, list[WeightSource]]
