"""``LoRALayers``: adapters mapped onto a loaded model, and the per-row delta of a step.

Every linear layer of the model that a PEFT adapter may target (all but the head) gets
a thin forward hook: its base forward (``nn.Linear``, a packed native layer, or a
quantized one: ops/linear.py, ops/quant.py) runs unchanged, then the step's rows that
have an adapter gain its delta, grouped by adapter (the shrink and expand of Punica /
S-LoRA as two batched matmuls):

    xs  = x[rows of adapters 1..k, padded to G rows each]      [k, G, in]
    out[rows] += (xs @ A_k) @ B_k        A: [k, in, R], B: [k, R, out], scale in B

so each row is multiplied by its own adapter's factors only, base-model rows are not
touched, and a layer costs one gather, two ``bmm`` and one ``index_add_`` whatever the
number of adapters in the step. Padding rows (groups of unequal size) are zeroed after
the gather, so they add exact zeros. The grouping is built once per step per set of
adapters a layer has (``begin_step``); a step without adapter rows costs one ``None``
check per layer. The factors are kept in float32 and used in the activations' dtype
(cast once per adapter set): bfloat16 on a bfloat16 or quantized bfloat16 base, where
torch's bfloat16 matmul accumulates in float32; float32 on a float32 base.

Fused layers: a module of ours may hold several of the checkpoint's (q/k/v in
``qkv_proj``, gate/up in ``gate_up_proj``; model/weight_map.py's ``CheckpointLayout``
says which rows each fills). An adapter's factors of its parts are stacked: its ``A``s
one above the other, its ``B`` block-diagonal (zero outside each part's rows and rank
columns), so the fused output gets exactly each part's own delta. Adapters of lower
rank in a layer are zero-padded to the layer's largest (exact zeros).

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
from nbengine.ops import native

__all__ = ["NATIVE_MAX_ROWS", "LoRALayers"]

# Steps with up to this many adapter rows take the native kernel on a bfloat16 base (one
# call per hooked linear); above it, the batched matmuls (module docstring, "Native").
NATIVE_MAX_ROWS = 128


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
    # The factors of every adapter this layer has, batched for ``bmm`` (see ``batched``);
    # rebuilt lazily after add / remove.
    _batched: dict[torch.dtype, _Batched] = field(default_factory=dict)
    # The same for the native kernel: A as [n, R, in], B as [n, R, out], float32.
    _native: _Batched | None = None

    def changed(self) -> None:
        """Forget the batched factors (an adapter of this layer was added or removed)."""
        self._batched = {}
        self._native = None

    def native(self) -> _Batched | None:
        """This layer's factors as the native kernel reads them (``nb_lora_bf16``): float32,
        ``a`` ``[n, R, in]`` and ``b`` ``[n, R, out]``, contiguous; None without adapters."""
        if self._native is None:
            got = self.batched(torch.float32, torch.device("cpu"))
            if got is None:
                return None
            self._native = _Batched(got.ids, got.a.transpose(1, 2).contiguous(), got.b)
        return self._native

    def batched(self, dtype: torch.dtype, device: torch.device) -> _Batched | None:
        """This layer's adapters' factors as ``[n, in, R]`` and ``[n, R, out]`` in ``dtype``
        (zero-padded to the largest rank R), and the adapter id of each slot; None when
        no adapter targets this layer."""
        if not self.factors:
            return None
        got = self._batched.get(dtype)
        if got is None:
            ids = tuple(sorted(self.factors))
            rank = max(self.factors[i][0].shape[0] for i in ids)
            a = torch.zeros(len(ids), self.in_features, rank, dtype=torch.float32)
            b = torch.zeros(len(ids), rank, self.out_features, dtype=torch.float32)
            for slot, i in enumerate(ids):
                fa, fb = self.factors[i]
                a[slot, :, : fa.shape[0]] = fa.t()
                b[slot, : fb.shape[1], :] = fb.t()
            got = _Batched(ids, a.to(device, dtype), b.to(device, dtype))
            self._batched[dtype] = got
        return got


@dataclass(slots=True, frozen=True)
class _Batched:
    ids: tuple[int, ...]  # adapter id of each slot
    a: torch.Tensor  # [slots, in, R]
    b: torch.Tensor  # [slots, R, out]


@dataclass(slots=True, frozen=True)
class _Groups:
    """The step's rows of the adapters one layer has, grouped for ``bmm``."""

    slots: torch.Tensor | None  # slot of each group in _Batched (None: every slot in order)
    gather: torch.Tensor  # [k * G] row of each grouped position (padding: a group's row)
    pad: torch.Tensor | None  # positions that are padding (zeroed after the gather)
    k: int
    g: int


class LoRALayers:
    """The adapters loaded into one model (by ``lora_int_id``) and the hooks applying them."""

    def __init__(self, model: nn.Module, device: str | torch.device = "cpu") -> None:
        layout: _Layout | None = getattr(model, "checkpoint_layout", None)
        if layout is None:
            raise TypeError(f"{type(model).__name__} declares no checkpoint_layout.")
        self.device = torch.device(device)
        # The step's rows of each adapter (None: no adapter rows) and its groupings by
        # the adapter set of a layer (begin_step, _groups).
        self._rows: dict[int, list[int]] | None = None
        self._grouped: dict[tuple[int, ...], _Groups | None] = {}
        # The native path of the step (begin_step): the step's row count when it may run
        # (CPU, at most NATIVE_MAX_ROWS adapter rows), else 0; and each adapter set's slot
        # per row (int32, -1: base row), built once per step (_slots).
        self._native_rows = 0
        self._native_threads = 1
        self._slots_of: dict[tuple[int, ...], torch.Tensor] = {}
        # The native kernels, looked up on the first bfloat16 delta (a float32 model never
        # builds them; _looked_up says whether that happened).
        self._kernels: native.NativeKernels | None = None
        self._looked_up = False
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
            if t.factors.pop(adapter.int_id, None) is not None:
                t.changed()
        for path, parts in per_target.items():
            target = by_path[path]
            target.factors[adapter.int_id] = self._stack(target, parts, adapter.scale)
            target.changed()
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
                t.changed()
        return True

    # ------------------------------------------------------------------ steps
    def begin_step(self, spans: Sequence[tuple[int, int]]) -> bool:
        """Note the step's rows' adapters; ``spans`` is ``(adapter id, rows)`` per chunk
        in row order (id 0: the base model). True when any row has an adapter."""
        self._grouped = {}
        self._slots_of = {}
        rows: dict[int, list[int]] = {}
        row = 0
        for int_id, n in spans:
            if int_id:
                rows.setdefault(int_id, []).extend(range(row, row + n))
            row += n
        self._rows = rows or None
        adapter_rows = sum(len(r) for r in rows.values())
        self._native_rows = (
            row if self.device.type == "cpu" and adapter_rows <= NATIVE_MAX_ROWS else 0
        )
        self._native_threads = 1 if adapter_rows < native.SMALL_ROWS else torch.get_num_threads()
        return self._rows is not None

    def end_step(self) -> None:
        """Forget the step's rows (every later forward runs the base model only)."""
        self._rows = None
        self._grouped = {}
        self._slots_of = {}

    def _groups(self, batched: _Batched) -> _Groups | None:
        """The step's rows grouped by the adapters in ``batched`` (None: no such rows)."""
        if batched.ids in self._grouped:
            return self._grouped[batched.ids]
        assert self._rows is not None
        present = [(slot, self._rows[i]) for slot, i in enumerate(batched.ids) if i in self._rows]
        groups: _Groups | None = None
        if present:
            g = max(len(r) for _, r in present)
            gather: list[int] = []
            pad: list[int] = []
            for _, r in present:
                pad.extend(range(len(gather) + len(r), len(gather) + g))
                gather.extend(r + [r[0]] * (g - len(r)))
            slots = [slot for slot, _ in present]
            dev = self.device
            groups = _Groups(
                None
                if slots == list(range(len(batched.ids)))
                else torch.tensor(slots, dtype=torch.int64, device=dev),
                torch.tensor(gather, dtype=torch.int64, device=dev),
                torch.tensor(pad, dtype=torch.int64, device=dev) if pad else None,
                len(present),
                g,
            )
        self._grouped[batched.ids] = groups
        return groups

    def _slots(self, ids: tuple[int, ...]) -> torch.Tensor:
        """The slot in ``ids`` of each of the step's rows (int32; -1: no adapter of these)."""
        got = self._slots_of.get(ids)
        if got is None:
            assert self._rows is not None
            got = torch.full((self._native_rows,), -1, dtype=torch.int32)
            for slot, i in enumerate(ids):
                if i in self._rows:
                    got[self._rows[i]] = slot
            self._slots_of[ids] = got
        return got

    def _native_kernels(self) -> native.NativeKernels | None:
        if not self._looked_up:
            self._kernels, self._looked_up = native.kernels(), True
        return self._kernels

    # ------------------------------------------------------------------ the hook
    def _delta(self, target: _Target, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the step's adapter rows' deltas to ``out`` (module docstring)."""
        if self._native_delta(target, x, out):
            return
        batched = target.batched(x.dtype, x.device)
        if batched is None:
            return
        groups = self._groups(batched)
        if groups is None:
            return
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        a, b = batched.a, batched.b
        if groups.slots is not None:
            a, b = a.index_select(0, groups.slots), b.index_select(0, groups.slots)
        xs = x2.index_select(0, groups.gather)
        if groups.pad is not None:
            xs.index_fill_(0, groups.pad, 0)  # padding rows: exact zero deltas
        y = torch.bmm(torch.bmm(xs.view(groups.k, groups.g, -1), a.to(xs.dtype)), b.to(xs.dtype))
        out2.index_add_(0, groups.gather, y.view(-1, out2.shape[-1]).to(out2.dtype))

    def _native_delta(self, target: _Target, x: torch.Tensor, out: torch.Tensor) -> bool:
        """The delta by the native kernel, one call (module docstring, "Native"); False
        (nothing done) where it does not apply: a float32 base, no kernels, a large step."""
        rows = self._native_rows
        if (
            not rows
            or x.dtype != torch.bfloat16
            or out.dtype != torch.bfloat16
            or not x.is_contiguous()
            or not out.is_contiguous()
            or x.numel() != rows * target.in_features
            or out.numel() != rows * target.out_features
        ):
            return False
        kernels = self._native_kernels()
        factors = target.native()
        if kernels is None or factors is None:
            return False
        kernels.lora_(
            x.view(rows, -1),
            out.view(rows, -1),
            self._slots(factors.ids),
            factors.a,
            factors.b,
            self._native_threads,
        )
        return True

    def _install(self, module: nn.Module, target: _Target) -> None:
        base: Callable[..., torch.Tensor] = module.forward
        layers = self

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = base(x, *args, **kwargs)
            if layers._rows is not None and target.factors:
                layers._delta(target, x, out)
            return out

        # An instance attribute: module.forward(x) and module(x) both reach it, and the
        # module stays what it was for everything that inspects it (the decode plan).
        module.forward = forward
