"""Where each parameter comes from in a Hugging Face checkpoint, declared once per model.

A model states how its parameter names differ from the checkpoint's in one
``CheckpointLayout``: the prefix of the checkpoint's names (``model.``, GPT-2's
``transformer.``), the packed modules (one fused module of ours holding several of the
checkpoint's stacked along its rows: q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj``),
modules the checkpoint names otherwise, modules whose weight it stores transposed (GPT-2's
Conv1D), and the head tied to the embeddings. ``CheckpointModule``, the base of every
model, turns that into the loader's ``WeightMap`` (model/weights.py) by walking the
model's own parameters, so no parameter is listed by hand, and ties the head.

Rows: a parameter is read whole (its rows are its first dimension) unless its module is
packed; then each part fills the next rows, in the order declared. The parts' rows must
add up to the fused parameter's (checked when the map is built).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from nbengine.model.weights import WeightMap, WeightSource

# A packed module's parts: (the checkpoint's module name, its rows), first rows first.
PackedParts = Sequence[tuple[str, int]]


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    """How a model's parameter names map onto a Hugging Face checkpoint's tensor names.

    Module names in ``packed``, ``renamed`` and ``transposed`` are ours and local (the
    last part of a module's path: ``qkv_proj`` stands for every layer's); ``renamed``
    values may hold dots (GPT-2's ``attn_proj`` is ``attn.c_proj``).
    """

    prefix: str = "model."
    # Our fused module -> the checkpoint modules stacked in it (weight and bias alike).
    packed: Mapping[str, PackedParts] = field(default_factory=dict)
    renamed: Mapping[str, str] = field(default_factory=dict)
    # Our modules whose weight the checkpoint stores [in, out] (their bias is as ours).
    transposed: frozenset[str] = frozenset()
    # Top-level modules the checkpoint names without the prefix.
    unprefixed: frozenset[str] = frozenset({"lm_head"})
    # (head, embedding): the head's weight is the embedding's, absent from the checkpoint.
    tied: tuple[str, str] | None = None

    def checkpoint_module(self, module: str) -> str:
        """The checkpoint's name of our module path ``module`` (``layers.0.mlp.down_proj``)."""
        parent, _, local = module.rpartition(".")
        local = self.renamed.get(local, local)
        name = f"{parent}.{local}" if parent else local
        return name if module.split(".")[0] in self.unprefixed else self.prefix + name

    def sources(self, name: str, rows: int) -> list[WeightSource]:
        """Where our parameter ``name`` (``rows`` in its first dimension) is read from."""
        module, _, leaf = name.rpartition(".")
        parent, _, local = module.rpartition(".")
        parts = self.packed.get(local)
        if parts is None:
            transpose = leaf == "weight" and local in self.transposed
            return [WeightSource(f"{self.checkpoint_module(module)}.{leaf}", 0, rows, transpose)]
        if sum(n for _, n in parts) != rows:
            raise ValueError(
                f"{name}: the packed parts {[p for p, _ in parts]} hold "
                f"{sum(n for _, n in parts)} rows, the parameter {rows}"
            )
        out: list[WeightSource] = []
        offset = 0
        for part, n in parts:
            where = self.checkpoint_module(f"{parent}.{part}" if parent else part)
            out.append(WeightSource(f"{where}.{leaf}", offset, n))
            offset += n
        return out


class CheckpointModule(nn.Module):
    """A model whose weights come from a Hugging Face checkpoint laid out as
    ``checkpoint_layout`` says (set it in ``__init__`` before ``tie_weights``)."""

    checkpoint_layout: CheckpointLayout

    def tie_weights(self) -> None:
        """Share the embedding matrix with the head when the layout ties them."""
        tied = self.checkpoint_layout.tied
        if tied is not None:
            head, embedding = (self.get_submodule(m) for m in tied)
            head.weight = embedding.weight

    def hf_weight_map(self) -> WeightMap:
        """Our parameter name -> the checkpoint tensors (and row ranges) that make it up.

        Every parameter is listed once; a tied head shares the embedding's and is absent.
        """
        layout = self.checkpoint_layout
        return {
            name: layout.sources(name, param.shape[0]) for name, param in self.named_parameters()
        }
