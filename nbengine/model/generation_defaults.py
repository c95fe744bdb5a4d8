"""The model's own sampling defaults, from its ``generation_config.json``.

Model authors put the sampling settings their model is meant to run with there
(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens). As vLLM and
transformers do, a request that gives no ``SamplingParams`` runs with them; fields the
file does not set keep ``SamplingParams``' own defaults. Invalid values are ignored
with a warning: a model directory's quirk must not make every call fail.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from nbengine.model.errors import ModelLoadError
from nbengine.model.files import is_regular_file, read_json
from nbengine.sampling_params import SamplingParams

__all__ = ["default_sampling_params"]

logger = logging.getLogger(__name__)

# generation_config.json field -> SamplingParams field
FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def default_sampling_params(model_dir: Path | None) -> SamplingParams:
    """``SamplingParams`` with the model's generation_config.json sampling fields applied."""
    if model_dir is None:
        return SamplingParams()
    path = model_dir / "generation_config.json"
    try:
        # A FIFO would block a plain read forever; model/files.py refuses it.
        cfg: Any = read_json(path) if is_regular_file(path) else None
    except ModelLoadError as exc:
        logger.warning("Ignoring %s: %s", path, exc)
        return SamplingParams()
    if not isinstance(cfg, dict):
        return SamplingParams()
    params = SamplingParams()
    for source, target in FIELDS.items():
        value = cfg.get(source)
        if value is None:
            continue
        try:
            params = params.replace(**{target: value})
        except (TypeError, ValueError) as exc:
            logger.warning("Ignoring %s=%r from %s: %s", source, value, path, exc)
    return params
