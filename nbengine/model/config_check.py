"""Validate the fields of a model's config.json before anything is built from them.

A hand-edited or truncated config.json must fail with a ``ModelLoadError`` that names
the field and the file, never with a ZeroDivisionError, TypeError or a tensor shape
error from deep inside model construction (docs/errors.md, "Model directories").

Only fields the loader reads are checked, each where present (defaults apply to the
absent ones), by kind: counts and sizes are positive integers, epsilons and bases
positive finite numbers, flags booleans, optional structures dicts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from nbengine.model.errors import ModelLoadError
from nbengine.validation import is_int, is_number

__all__ = ["check_hf_config", "check_inside"]

POSITIVE_INTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    # GPT-2's names
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
)
OPTIONAL_POSITIVE_INTS = ("num_key_value_heads", "head_dim", "n_inner", "sliding_window")
POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_epsilon", "rope_theta")
BOOLS = (
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "scale_attn_weights",
)
OPTIONAL_DICTS = ("rope_scaling", "rope_parameters")
STRINGS = ("hidden_act", "activation_function")


def _fail(cfg_file: Path, name: str, value: Any, wanted: str) -> ModelLoadError:
    return ModelLoadError(f"{cfg_file}: {name} must be {wanted}, got {value!r}.")


def check_hf_config(cfg: dict[str, Any], path: Path) -> None:
    """Raise ``ModelLoadError`` naming the first field of ``cfg`` the loader cannot use."""
    cfg_file = path / "config.json"
    for name in POSITIVE_INTS + OPTIONAL_POSITIVE_INTS:
        if name not in cfg:
            continue
        value = cfg[name]
        if value is None and name in OPTIONAL_POSITIVE_INTS:
            continue
        if not is_int(value) or value < 1:
            raise _fail(cfg_file, name, value, "a positive integer")
    for name in POSITIVE_FLOATS:
        if name not in cfg:
            continue
        value = cfg[name]
        if not is_number(value) or not math.isfinite(value) or value <= 0:
            raise _fail(cfg_file, name, value, "a positive finite number")
    for name in BOOLS:
        if name in cfg and not isinstance(cfg[name], bool):
            raise _fail(cfg_file, name, cfg[name], "true or false")
    for name in OPTIONAL_DICTS:
        if cfg.get(name) is not None and not isinstance(cfg[name], dict):
            raise _fail(cfg_file, name, cfg[name], "an object (or null)")
    for name in STRINGS:
        if name in cfg and not isinstance(cfg[name], str):
            raise _fail(cfg_file, name, cfg[name], "a string")
    qcfg = cfg.get("quantization_config")
    if qcfg:
        method = qcfg.get("quant_method", "?") if isinstance(qcfg, dict) else qcfg
        raise ModelLoadError(
            f"{cfg_file}: quantization_config ({method!r}): pre-quantized checkpoints are not "
            'supported; load the unquantized checkpoint with quantization="int8" or '
            '"int4" (docs/quantization.md).'
        )
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    hidden = cfg.get("hidden_size", cfg.get("n_embd"))
    if (
        isinstance(heads, int)
        and isinstance(hidden, int)
        and cfg.get("head_dim") is None
        and hidden % heads
    ):
        raise ModelLoadError(
            f"{cfg_file}: hidden_size ({hidden}) must be a multiple of num_attention_heads "
            f"({heads}) when head_dim is not given."
        )
    kv_heads = cfg.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise ModelLoadError(
            f"{cfg_file}: num_attention_heads ({heads}) must be a multiple of "
            f"num_key_value_heads ({kv_heads})."
        )


def check_inside(path: Path, name: object, listed_in: Path) -> Path:
    """``path / name`` for a file name read from ``listed_in``; refuse names that are not
    plain relative paths inside ``path`` (absolute, ``..``, or through a link outside)."""
    if not isinstance(name, str) or not name:
        raise ModelLoadError(
            f"{listed_in} lists a weight file name that is not a string: {name!r}."
        )
    candidate = Path(name)
    if candidate.is_absolute() or ".." in candidate.parts:
        raise ModelLoadError(
            f"{listed_in} lists the weight file {name!r}, which is outside the model "
            "directory; only files inside it are read."
        )
    full = path / candidate
    root = path.resolve()
    roots = [root]
    if root.parent.name == "snapshots":
        # A Hugging Face Hub cache snapshot (model/hub.py): its files are links into the
        # repo's own blobs/ folder, snapshots/<commit>/<file> -> ../../blobs/<hash>.
        roots.append(root.parent.parent / "blobs")
    target = full.resolve()
    if not any(target.is_relative_to(r) for r in roots):
        raise ModelLoadError(
            f"{listed_in} lists the weight file {name!r}, which leads outside the model "
            "directory; only files inside it are read."
        )
    return full
