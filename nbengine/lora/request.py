"""``LoRARequest``: which adapter a request runs under (vLLM's name and fields)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nbengine.validation import is_int

__all__ = ["LoRARequest"]

# Ids handed to adapters made with ``from_peft`` without one: far above what a user picks.
_AUTO_IDS = itertools.count(1_000_001)


@dataclass(frozen=True, slots=True, eq=False)
class LoRARequest:
    """A LoRA adapter for ``generate(..., lora_request=...)`` (docs/lora.md).

    ``lora_name`` names it (the dashboard, ``request_stats()``, the server's ``model``);
    ``lora_int_id`` (>= 1) identifies it inside the engine; ``lora_path`` is a PEFT
    directory (``adapter_config.json`` + ``adapter_model.safetensors``) or the Hub id of
    one. ``LoRARequest.from_peft(model, name)`` takes an adapter from a PEFT model in
    memory instead (no save needed).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str | Path | None = None
    # from_peft: the adapter's config dict and state dict (float32 CPU copies).
    peft_config: dict[str, Any] | None = field(default=None, repr=False)
    peft_tensors: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise TypeError(f"lora_name must be a non-empty string, got {self.lora_name!r}.")
        if not is_int(self.lora_int_id):
            raise TypeError(f"lora_int_id must be an int, got {self.lora_int_id!r}.")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1, got {self.lora_int_id}.")
        in_memory = self.peft_tensors is not None
        if self.lora_path is None and not in_memory:
            raise ValueError(
                "lora_path is required: a PEFT adapter directory or a Hub id "
                "(or use LoRARequest.from_peft(model, name) for a PEFT model in memory)."
            )
        if self.lora_path is not None and not isinstance(self.lora_path, (str, Path)):
            raise TypeError(f"lora_path must be a str or Path, got {self.lora_path!r}.")

    @property
    def in_memory(self) -> bool:
        """True for an adapter taken from a PEFT model object (``from_peft``)."""
        return self.peft_tensors is not None

    @classmethod
    def from_peft(
        cls,
        model: Any,
        lora_name: str,
        lora_int_id: int | None = None,
        adapter_name: str | None = None,
    ) -> LoRARequest:
        """The LoRA adapter ``adapter_name`` (default: the active one) of a PEFT model.

        The weights are copied now (float32, CPU): training the model further changes
        nothing here; call ``from_peft`` again (with a new ``lora_int_id``) for the new
        weights. ``lora_int_id`` None picks a fresh id above 1,000,000.
        """
        peft_configs = getattr(model, "peft_config", None)
        if not isinstance(peft_configs, dict) or not peft_configs:
            raise TypeError(
                "model must be a PEFT model (peft.get_peft_model(...)), got "
                f"{type(model).__name__}."
            )
        name = adapter_name if adapter_name is not None else getattr(model, "active_adapter", None)
        if not isinstance(name, str) or name not in peft_configs:
            raise ValueError(
                f"adapter_name {name!r} is not one of the model's adapters {sorted(peft_configs)}."
            )
        from peft import get_peft_model_state_dict

        config = peft_configs[name].to_dict()
        targets = config.get("target_modules")
        if isinstance(targets, (set, frozenset)):
            config["target_modules"] = sorted(targets)
        state = get_peft_model_state_dict(model, adapter_name=name)
        tensors = {k: v.detach().to("cpu", torch.float32).clone() for k, v in state.items()}
        return cls(
            lora_name,
            next(_AUTO_IDS) if lora_int_id is None else lora_int_id,
            None,
            peft_config=config,
            peft_tensors=tensors,
        )

    def describe(self) -> str:
        """Where the adapter comes from, for messages."""
        return "a PEFT model in memory" if self.lora_path is None else str(self.lora_path)
