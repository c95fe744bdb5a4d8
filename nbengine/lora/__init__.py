"""LoRA adapters per request (docs/lora.md).

- ``request``: ``LoRARequest``, the public handle of one adapter (vLLM's name and fields);
- ``adapter``: reading and checking a PEFT adapter (a directory, or a PEFT model in memory)
  into ``AdapterWeights``, named by the checkpoint's module names;
- ``layers``: ``LoRALayers``, the adapters mapped onto a loaded model's (possibly fused,
  packed or quantized) linear layers, and the per-step delta ``x @ A^T @ B^T * scale``
  applied to each row under its own adapter.

The package sits below ``model`` and ``frontend`` (docs/architecture.md, "Layers"): it
imports only ``validation`` and torch, and reads the model's ``CheckpointLayout`` by
protocol.
"""

from nbengine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
