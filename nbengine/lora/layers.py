"""``LoRALayers``: adapters mapped onto a loaded model, and the per-row delta of a step.

Every linear layer of the model that a PEFT adapter may target (all but the head) gets
a thin forward hook: its base forward (``nn.Linear``, a packed native layer, or a
quantized one: ops/linear.py, ops/quant.py) runs unchanged, then the step's rows gain
their adapters' deltas in two float32 matmuls for the whole batch, whatever the number
of adapters in it (the shrink and expand of Punica / S-LoRA, done densely):

    xa = x @ A_all^T          A_all: every loaded adapter's A, stacked  [cols, in]
    xa *= mask                mask[row, col] = 1 where col belongs to row's adapter
    out += xa @ B_all^T       B_all: their B's side by side, scale in    [out, cols]

so each row gets exactly its own adapter's delta (the other adapters' columns are
multiplied by exact zeros) and base-model rows get none. The mask is built once per
step per column layout (``begin_step``). With ranks r of at most a few dozen, ``cols``
is small beside ``out``, so the two products cost a small fraction of the layer's own.
A step without adapter rows costs one ``None`` check per layer.

Fused layers: a module of ours may hold several of the checkpoint's (q/k/v in
``qkv_proj``, gate/up in ``gate_up_proj``; model/weight_map.py's ``CheckpointLayout``
says which rows each fills). An adapter's factors of its parts are stacked: its ``A``s
one above the other, its ``B`` block-diagonal (zero outside each part's rows and rank
columns), so the fused output gets exactly each part's own delta.

Threads: the hooks run on the core thread; ``add``/``remove`` run there too (between
steps, as UTILITY calls), so no lock is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from nbengine.lora.adapter import AdapterWeights

__all__ = ["LoRALayers"]


class _Source(Protocol):
    name: str
    offset: int
    rows: int


class _Layout(Protocol):
    def sources(self, name: str, rows: int) -> Sequence[_Source]: ...


@dataclass(slots=True)
class _Target:
    """One linear layer of ours and the checkpoint modules it holds."""

    path: str  # our module path
    in_features: int
    out_features: int
    # checkpoint module name -> (first row, rows) in this layer's output
    parts: dict[str, tuple[int, int]]
    # adapter id -> (A [R, in], B [out, R]) on the model's device, scale in B
    factors: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Every adapter's factors side by side (A_all, B_all) and the adapter id of each
    # column (as a tuple: the key of the step's mask); rebuilt by add / remove.
    stacked: tuple[torch.Tensor, torch.Tensor, tuple[int, ...], torch.Tensor] | None = None

    def restack(self, device: torch.device) -> None:
        if not self.factors:
            self.stacked = None
            return
        ids = sorted(self.factors)
        a_all = torch.cat([self.factors[i][0] for i in ids], dim=0).contiguous()
        b_all = torch.cat([self.factors[i][1] for i in ids], dim=1).contiguous()
        cols = tuple(i for i in ids for _ in range(self.factors[i][0].shape[0]))
        col_ids = torch.tensor(cols, dtype=torch.int64, device=device)
        self.stacked = (a_all.to(device), b_all.to(device), cols, col_ids)


class LoRALayers:
    """The adapters loaded into one model (by ``lora_int_id``) and the hooks applying them."""

    def __init__(self, model: nn.Module, device: str | torch.device = "cpu") -> None:
        layout: _Layout | None = getattr(model, "checkpoint_layout", None)
        if layout is None:
            raise TypeError(f"{type(model).__name__} declares no checkpoint_layout.")
        self.device = torch.device(device)
        # The step's per-row adapter ids (None: no adapter rows) and its masks by layout.
        self._row_ids: torch.Tensor | None = None
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}
        self._targets: list[_Target] = []
        self._by_module: dict[str, _Target] = {}
        self.adapters: dict[int, AdapterWeights] = {}
        for path, module in model.named_modules():
            in_f, out_f = (
                getattr(module, "in_features", None),
                getattr(module, "out_features", None),
            )
            if not isinstance(in_f, int) or not isinstance(out_f, int) or path == "lm_head":
                continue
            parts = {
                s.name.removesuffix(".weight"): (s.offset, s.rows)
                for s in layout.sources(f"{path}.weight", out_f)
            }
            target = _Target(path, in_f, out_f, parts)
            self._targets.append(target)
            for name in parts:
                self._by_module[name] = target
            self._install(module, target)

    @property
    def supported_modules(self) -> list[str]:
        """The checkpoint's local module names an adapter may target (``q_proj``, ...)."""
        return sorted({name.rpartition(".")[2] for name in self._by_module})

    # ------------------------------------------------------------------ adapters
    def add(self, adapter: AdapterWeights) -> None:
        """Map ``adapter`` onto the model (replacing one of the same id).

        Raises ValueError naming ``target_modules`` (a module this model has no layer
        for, or cannot adapt) or the base model (a shape that does not match); nothing
        changes then.
        """
        per_target: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
        for name, (a, b) in adapter.modules.items():
            target = self._by_module.get(name)
            local = name.rpartition(".")[2]
            if target is None:
                if local in self.supported_modules:
                    raise ValueError(
                        f"LoRA adapter {adapter.source}: base model: it adapts {name}, which "
                        "this model does not have (was it trained on another base model?)."
                    )
                raise ValueError(
                    f"LoRA adapter {adapter.source}: target_modules: {local!r} ({name}) cannot "
                    f"be adapted here; this model's LoRA targets are {self.supported_modules}."
                )
            offset, rows = target.parts[name]
            if a.shape[1] != target.in_features or b.shape[0] != rows:
                raise ValueError(
                    f"LoRA adapter {adapter.source}: base model: {name} has lora_A "
                    f"{list(a.shape)} and lora_B {list(b.shape)}, but the model's layer takes "
                    f"{target.in_features} inputs to {rows} outputs (was it trained on another "
                    "base model?)."
                )
            per_target.setdefault(target.path, []).append((offset, rows, a, b))
        by_path = {t.path: t for t in self._targets}
        for t in self._targets:
            t.factors.pop(adapter.int_id, None)
        for path, parts in per_target.items():
            target = by_path[path]
            target.factors[adapter.int_id] = self._stack(target, parts, adapter.scale)
        for t in self._targets:
            t.restack(self.device)
        self.adapters[adapter.int_id] = adapter

    def _stack(
        self,
        target: _Target,
        parts: list[tuple[int, int, torch.Tensor, torch.Tensor]],
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's stacked ``A`` and block-diagonal ``B`` (module docstring)."""
        rank = sum(a.shape[0] for _, _, a, _ in parts)
        big_a = torch.cat([a for _, _, a, _ in parts], dim=0)
        big_b = torch.zeros(target.out_features, rank, dtype=torch.float32)
        col = 0
        for offset, rows, a, b in parts:
            big_b[offset : offset + rows, col : col + a.shape[0]] = b * scale
            col += a.shape[0]
        return big_a.contiguous(), big_b.contiguous()

    def remove(self, int_id: int) -> bool:
        """Drop adapter ``int_id``; False if it was not loaded."""
        if self.adapters.pop(int_id, None) is None:
            return False
        for t in self._targets:
            if t.factors.pop(int_id, None) is not None:
                t.restack(self.device)
        return True

    # ------------------------------------------------------------------ steps
    def begin_step(self, spans: Sequence[tuple[int, int]]) -> bool:
        """Note the step's rows' adapters; ``spans`` is ``(adapter id, rows)`` per chunk
        in row order (id 0: the base model). True when any row has an adapter."""
        self._masks = {}
        if not any(int_id for int_id, _ in spans):
            self._row_ids = None
            return False
        ids = [int_id for int_id, n in spans for _ in range(n)]
        self._row_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return True

    def end_step(self) -> None:
        """Forget the step's rows (every later forward runs the base model only)."""
        self._row_ids = None
        self._masks = {}

    def _mask(self, cols: tuple[int, ...], col_ids: torch.Tensor) -> torch.Tensor:
        """``[rows, cols]`` float32: 1 where the column belongs to the row's adapter."""
        mask = self._masks.get(cols)
        if mask is None:
            assert self._row_ids is not None
            mask = (self._row_ids[:, None] == col_ids[None, :]).to(torch.float32)
            self._masks[cols] = mask
        return mask

    # ------------------------------------------------------------------ the hook
    def _install(self, module: nn.Module, target: _Target) -> None:
        base: Callable[..., torch.Tensor] = module.forward
        layers = self

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = base(x, *args, **kwargs)
            stacked = target.stacked
            if layers._row_ids is None or stacked is None:
                return out
            a_all, b_all, cols, col_ids = stacked
            x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
            xa = x2.float() @ a_all.t()
            xa *= layers._mask(cols, col_ids)
            out2 += (xa @ b_all.t()).to(out2.dtype)
            return out

        # An instance attribute: module.forward(x) and module(x) both reach it, and the
        # module stays what it was for everything that inspects it (the decode plan).
        module.forward = forward
