"""The argument checks every ``nbengine`` command shares (``nbengine/cli.py`` and the
``bench`` and ``serve`` subcommands, ``bench/cli.py`` and ``server/cli.py``), below all of
them so that none imports another's module for them (docs/architecture.md, "Layers")."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["CliError", "check_model_arg", "positive_int"]


class CliError(Exception):
    """A value the user gave cannot be used; the message is the whole explanation."""


def positive_int(text: str) -> int:
    """An argparse ``type`` for a whole number of at least 1 (every command's counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def check_model_arg(model: str | None, option: str = "--model") -> str | None:
    """The model a command was given, checked before anything loads; every command that
    takes a model (``demo``, ``generate``, ``bench``, ``serve``) resolves it here.

    An existing path must be a model directory (returned expanded); anything else must
    read as a Hugging Face Hub id ("org/name"), returned as given for ``nb.Engine`` to
    resolve (the Hub cache, else a download; docs/models.md). None (the shipped default
    model) stays None. Raises ``CliError`` naming ``option`` otherwise.
    """
    if model is None:
        return None
    from nbengine.model.hub import is_hub_repo_id

    p = Path(model).expanduser()
    if not p.exists():
        if is_hub_repo_id(model):
            return model
        raise CliError(
            f"{option} {model}: no such directory (and not a Hugging Face Hub id such as org/name)"
        )
    if not p.is_dir():
        raise CliError(f"{option} {model}: not a directory (give a Hugging Face model folder)")
    if not (p / "config.json").is_file():
        raise CliError(
            f"{option} {model}: not a model directory (it has no config.json; give a "
            "Hugging Face model folder with config.json, weights and a tokenizer)"
        )
    return str(p)
