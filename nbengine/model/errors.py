"""Errors raised while loading a model directory."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model directory cannot be loaded; the message names the problem and the path."""
