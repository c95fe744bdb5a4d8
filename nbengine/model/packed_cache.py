"""bfloat16 linear weights packed for the native kernels, kept in the load cache.

Packing a model's linear layers into the kernels' VNNI layout (``NativeLinear``,
ops/linear.py) copies every weight once more after it is read: at the 1B shape most of a
bfloat16 load (docs/benchmarks.md, "Load time and memory"). The first load stores the
packed weights as a load cache entry (model/load_cache.py); a later load of the same
checkpoint maps that entry and gives each layer its view, so those layers' weights are
neither read from the checkpoint nor packed.

An entry's key adds to the checkpoint's identity what the layout depends on: the packing
(``PACKING``), the kernels' tile (``native.VNNI_TILE``) and the dtype. A oneDNN twin (CPUs
with AMX, ops/linear.py) is an opaque oneDNN tensor that cannot be stored: with twins a
hit still reads (or maps) those weights and reorders them, and skips only the packing.
A layer taken from an entry skips ``pack_linears``' check against ``F.linear``: the entry
was stored only when every layer packed and passed that check.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from nbengine.model.load_cache import LoadCache, cache_root
from nbengine.ops import native
from nbengine.ops.linear import NativeLinear

__all__ = ["PACKING", "PackedCache", "packed_targets"]

logger = logging.getLogger(__name__)

# The layout ops/native.py's pack_linear_weight writes; change it when that layout changes.
PACKING = "vnni-words-v1"


def packed_targets(model: nn.Module) -> list[tuple[str, int, int]]:
    """The layers ``pack_linears`` packs natively: module path, output and input features
    of each bfloat16 ``nn.Linear`` with an even number of inputs (the kernel's limit)."""
    return [
        (name, m.out_features, m.in_features)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 and m.in_features % 2 == 0
    ]


def _entry_name(module: str) -> str:
    return f"{module}.packed"


class PackedCache:
    """The packed-weights entry of one checkpoint (``files`` of ``path``) for ``model``."""

    def __init__(self, model: nn.Module, path: Path, files: list[Path]) -> None:
        options = {"packing": PACKING, "tile": native.VNNI_TILE, "dtype": str(torch.bfloat16)}
        self.cache = LoadCache(cache_root(), path, files, options)
        # Names and shapes only: holding the layers would keep their unpacked weights alive.
        self.targets = packed_targets(model)

    @property
    def enabled(self) -> bool:
        """False when ``NBENGINE_LOAD_CACHE=0`` turns the cache off."""
        return self.cache.root is not None

    def restore(self) -> dict[str, torch.Tensor] | None:
        """Module path -> its packed weight (a view of the mapped entry) for every target,
        or None on a miss."""
        kernels = native.kernels()
        if not self.enabled or not self.targets or kernels is None:
            return None
        wanted = {
            _entry_name(name): (torch.Size([native.packed_linear_numel(n, k)]), torch.bfloat16)
            for name, n, k in self.targets
        }
        views = self.cache.restore_tensors(wanted)
        if views is None:
            return None
        return {name: views[_entry_name(name)] for name, _, _ in self.targets}

    def install(self, model: nn.Module, packed: dict[str, torch.Tensor], twin: bool) -> int:
        """Replace each target of ``model`` by a ``NativeLinear`` over its weight in
        ``packed`` (``restore``'s), with ``twin`` a oneDNN twin made from its weight (then
        loaded); the targets' biases must be loaded. Returns how many."""
        kernels = native.kernels()
        assert kernels is not None, "restore found the kernels"
        for name, _, _ in self.targets:
            parent_name, _, local = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            lin = getattr(parent, local)
            layer = NativeLinear(lin, kernels, onednn_twin=twin, packed=packed[name])
            setattr(parent, local, layer)
        logger.info("%d packed bfloat16 linear layers from the load cache.", len(self.targets))
        return len(self.targets)

    def store(self, model: nn.Module) -> bool:
        """Store the packed weights of ``model`` after ``pack_linears``: only when every
        target became a ``NativeLinear`` (else a later load could not take them all; a
        oneDNN twin is not stored, a later load makes it again). The entry is written in
        the background (``load_cache.wait_for_stores``). Returns whether it stores one."""
        if not self.enabled:
            return False
        tensors: dict[str, torch.Tensor] = {}
        for name, _, _ in self.targets:
            layer = model.get_submodule(name)
            if not isinstance(layer, NativeLinear):
                logger.info("Not caching the packed weights: %s is not natively packed.", name)
                return False
            tensors[_entry_name(name)] = layer.packed_weight
        self.cache.store_tensors(tensors, background=True)
        return True
