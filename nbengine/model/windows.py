"""Which attention layers of a model are sliding-window ones, read from config.json.

transformers' conventions, per architecture (``layer_types`` wins where the config has it):

- Mistral, Phi-3: every layer is windowed when ``sliding_window`` is set;
- Qwen2, Qwen3: with ``use_sliding_window``, layers from ``max_window_layers`` on;
- SmolLM3: with ``use_sliding_window``, the layers without rope (``no_rope_layers[i] == 0``);
- Gemma 2: every other layer, starting with the first; Gemma 3: every layer but each
  ``sliding_window_pattern``-th (default 6);
- Llama, GPT-2, OLMo 2: none.

A window ``w`` lets the query at position ``p`` see keys ``p - w + 1 .. p``.
"""

from __future__ import annotations

from typing import Any

from nbengine.validation import is_int


def layer_types(cfg: dict[str, Any], arch: str, num_layers: int) -> list[str]:
    """``"sliding_attention"`` or ``"full_attention"`` per layer."""
    full, sliding = "full_attention", "sliding_attention"
    given = cfg.get("layer_types")
    if isinstance(given, list) and len(given) == num_layers:
        return [str(t) for t in given]
    if arch == "Gemma2ForCausalLM":
        return [sliding if (i + 1) % 2 else full for i in range(num_layers)]
    if arch == "Gemma3ForCausalLM":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        return [sliding if (i + 1) % pattern else full for i in range(num_layers)]
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = int(cfg.get("max_window_layers", num_layers))
        return [sliding if i >= first else full for i in range(num_layers)]
    if arch == "SmolLM3ForCausalLM":
        rope = rope_layers(cfg, arch, num_layers)
        return [full if rope[i] else sliding for i in range(num_layers)]
    return (
        [sliding] * num_layers
        if arch in ("MistralForCausalLM", "Phi3ForCausalLM")
        else [full] * num_layers
    )


def layer_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    """The attention window of each layer (None: full attention)."""
    window = cfg.get("sliding_window")
    if not is_int(window) or window <= 0:
        return (None,) * num_layers
    # Qwen2/Qwen3/SmolLM3 configs carry a sliding_window they use only when told to.
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        return (None,) * num_layers
    return tuple(
        window if t == "sliding_attention" else None for t in layer_types(cfg, arch, num_layers)
    )


def rope_layers(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[bool, ...]:
    """Whether each layer applies rotary embeddings (SmolLM3 leaves some out)."""
    if arch != "SmolLM3ForCausalLM":
        return (True,) * num_layers
    flags = cfg.get("no_rope_layers")  # despite the name: 1 = this layer uses rope
    if isinstance(flags, list) and len(flags) == num_layers:
        return tuple(bool(f) for f in flags)
    interval = int(cfg.get("no_rope_layer_interval", 4))
    return tuple((i + 1) % interval != 0 for i in range(num_layers))


def kv_window(windows: tuple[int | None, ...]) -> int | None:
    """The window the KV cache may free blocks behind: the largest, if every layer has one."""
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)
