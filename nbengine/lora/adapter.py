"""Reading and checking a PEFT LoRA adapter (docs/lora.md, "Adapters").

An adapter is ``adapter_config.json`` + ``adapter_model.safetensors`` (or the same two
taken from a PEFT model in memory). Each targeted module ``M`` of the base model holds
``base_model.model.M.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``;
its output gains ``B @ A @ x * scale`` with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``). Everything here is checked against the
adapter itself and the engine's limits; the match with the base model's modules and
shapes is checked when the adapter is mapped onto it (``nbengine.lora.layers``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nbengine.lora.request import LoRARequest
from nbengine.validation import is_int, is_number

__all__ = ["ADAPTER_FILES", "AdapterWeights", "read_adapter"]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""The files of a PEFT adapter directory that nbengine reads (the Hub download too)."""

_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


@dataclass(frozen=True, slots=True, eq=False)
class AdapterWeights:
    """One adapter, checked, in float32 on the CPU.

    ``modules`` maps each targeted module's checkpoint name (``model.layers.0.self_attn
    .q_proj``) to its ``(A [r, in], B [out, r])``; ``scale`` multiplies ``B @ A``.
    """

    name: str
    int_id: int
    rank: int
    scale: float
    target_modules: tuple[str, ...]
    modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    source: str  # where it came from, for messages


def read_adapter(
    request: LoRARequest, directory: Path | None, max_lora_rank: int
) -> AdapterWeights:
    """The adapter of ``request``: from ``directory`` (its files) or from memory.

    Raises ValueError naming the field (``r``, ``peft_type``, ``target_modules``, ...) for
    an adapter nbengine cannot apply, and ``FileNotFoundError`` for a missing file.
    """
    where = request.describe()
    if request.peft_tensors is not None:
        config: Any = request.peft_config or {}
        tensors: Mapping[str, torch.Tensor] = request.peft_tensors
    else:
        assert directory is not None, "a directory for an adapter read from files"
        config, tensors = _read_files(directory)
        where = str(directory)
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {where}: adapter_config.json must hold a JSON object.")
    rank, scale = _check_config(config, where, max_lora_rank)
    modules = _pair_tensors(tensors, where, rank)
    targets = config.get("target_modules")
    listed = (targets,) if isinstance(targets, str) else tuple(map(str, targets or ()))
    return AdapterWeights(
        request.lora_name, request.lora_int_id, rank, scale, listed, modules, where
    )


def _read_files(directory: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    if not directory.is_dir():
        raise FileNotFoundError(f"lora_path: {directory} is not a directory.")
    missing = [f for f in ADAPTER_FILES if not (directory / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"lora_path: {directory} has no {' or '.join(missing)} (a PEFT adapter directory "
            "holds adapter_config.json and adapter_model.safetensors)."
        )
    try:
        config = json.loads((directory / ADAPTER_FILES[0]).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"LoRA adapter {directory}: unreadable adapter_config.json: {exc}"
        ) from exc
    return config, load_file(str(directory / ADAPTER_FILES[1]))


def _check_config(config: dict[str, Any], where: str, max_lora_rank: int) -> tuple[int, float]:
    """The rank and scale, after refusing every option nbengine does not apply."""

    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"LoRA adapter {where}: {field} {why}")

    peft_type = config.get("peft_type", "LORA")
    peft_type = getattr(peft_type, "value", peft_type)  # PEFT's enum, in memory
    if str(peft_type).upper() != "LORA":
        raise bad("peft_type", f"is {peft_type!r}; only LORA adapters are supported.")
    r = config.get("r")
    if not is_int(r) or r < 1:
        raise bad("r", f"must be a positive int, got {r!r}.")
    if r > max_lora_rank:
        raise bad("r", f"is {r}, more than the engine's max_lora_rank={max_lora_rank}.")
    alpha = config.get("lora_alpha", r)
    if not is_number(alpha) or not math.isfinite(alpha):
        raise bad("lora_alpha", f"must be a finite number, got {alpha!r}.")
    for field, value in (
        ("use_dora", config.get("use_dora")),
        ("modules_to_save", config.get("modules_to_save")),
        ("rank_pattern", config.get("rank_pattern")),
        ("alpha_pattern", config.get("alpha_pattern")),
        ("layer_replication", config.get("layer_replication")),
    ):
        if value:
            raise bad(field, f"is {value!r}; nbengine applies plain LoRA only (docs/lora.md).")
    bias = config.get("bias", "none")
    if bias != "none":
        raise bad("bias", f"is {bias!r}; only adapters trained with bias='none' are supported.")
    rs = config.get("use_rslora", False)
    return r, float(alpha) / (math.sqrt(r) if rs else r)


def _pair_tensors(
    tensors: Mapping[str, torch.Tensor], where: str, rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Checkpoint module name -> (A, B), float32; every tensor must belong to a pair."""
    a_of: dict[str, torch.Tensor] = {}
    b_of: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        name = key.removeprefix(_PREFIX)
        if name.endswith(_A):
            a_of[name.removesuffix(_A)] = value
        elif name.endswith(_B):
            b_of[name.removesuffix(_B)] = value
        else:
            raise ValueError(
                f"LoRA adapter {where}: target_modules: tensor {key!r} is not a LoRA A/B "
                "weight of a linear layer (embeddings, biases and DoRA are not supported)."
            )
    if not a_of:
        raise ValueError(f"LoRA adapter {where}: target_modules: the adapter has no LoRA weights.")
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in sorted(a_of.keys() | b_of.keys()):
        a, b = a_of.get(name), b_of.get(name)
        if a is None or b is None:
            raise ValueError(f"LoRA adapter {where}: {name} has only one of lora_A / lora_B.")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"LoRA adapter {where}: r is {rank}, but {name} has lora_A "
                f"{list(a.shape)} and lora_B {list(b.shape)} "
                f"(expected [{rank}, in], [out, {rank}])."
            )
        out[name] = (a.detach().to("cpu", torch.float32), b.detach().to("cpu", torch.float32))
    return out
