"""``LoRALayers``: adapters mapped onto a loaded model, and the per-row delta of a step.

Every linear layer of the model that a PEFT adapter may target (all but the head) gets
a thin forward hook: its base forward (``nn.Linear``, a packed native layer, or a
quantized one: ops/linear.py, ops/quant.py) runs unchanged, then the step's rows that
have an adapter gain its delta, grouped by adapter (the shrink and expand of Punica /
S-LoRA as batched matmuls):

    xs  = x[rows of adapters 1..k, padded to G rows each]      [k, G, in]
    out[rows] += (xs @ A_k) @ B_k        A: [k, in, R], B: [k, R, out], scale in B

so each row is multiplied by its own adapter's factors only, base-model rows are not
touched, and a layer costs one gather, the ``bmm`` and ``index_add_`` whatever the
number of adapters in the step. Padding rows (groups of unequal size) are zeroed after
the gather, so they add exact zeros. The grouping is built once per step per set of
adapters a layer has (``begin_step``); a step without adapter rows costs one ``None``
check per layer.

Dtype: the factors are converted once, at ``add`` (the scale folded into ``B`` in
float32 first): bfloat16 on a bfloat16 or quantized bfloat16 base, where torch's
bfloat16 matmul and the native kernel accumulate in float32; float32 on a float32 base
(the parity with transformers + PEFT holds there).

Fused: a module of ours may hold several of the checkpoint's (q/k/v in ``qkv_proj``,
gate/up in ``gate_up_proj``; model/weight_map.py's ``CheckpointLayout`` says which rows
each fills). A layer's parts share their input, so the shrink is one product with the
parts' ``A``s stacked (part p's rank columns ``c_p .. c_p + r_p - 1`` of ``xs @ A``),
and each part's expand writes its own rows from its own rank columns only (``_Packed``):
no block-diagonal ``B``, so no zeros are stored, read or multiplied. Adapters of lower
rank in a part, or without the part, are zero-padded to the part's largest rank (exact
zeros).

Native: on a bfloat16 CPU base every step runs each hooked linear's deltas in one call
of ``nb_lora_bf16`` (ops/kernels.c) on the same factors as it streams them
(``native.pack_lora_factors``), with the adapter slot of each row built once per step
(``_slots``). Prefill steps too: torch's bfloat16 ``bmm`` on this CPU (no AMX) took
about 3 ms per hook for a 512-row step, the kernel under 1 ms. The ``bmm`` path serves
float32 bases, other devices and ``NBENGINE_NATIVE=0``.

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

__all__ = ["NATIVE_PARALLEL_ROWS", "LoRALayers"]

# Steps with at least this many adapter rows split each native call between the torch
# threads; below it, one thread: a call of a decode step is tens of microseconds, about
# what waking an OpenMP worker costs (more on a loaded machine). Measured 2026-12-02, 30
# layers of the bench model, 4 rank-16 adapters, 2 threads vs 1 at load 2.6-3.0: 16 rows
# 15-18 vs 3.0-3.3 ms per step, 64 rows 19-21 vs 13 ms, 512 rows 58-86 vs 83 ms. With
# the AMX kernel (2026-12-03, quiet) a lower threshold (16) bought nothing on full W1:
# 10.19 vs 10.13 s, median of 3.
NATIVE_PARALLEL_ROWS = 256


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
    # adapter id -> checkpoint module name -> (A [r, in], B^T [r, rows], scale in B), in
    # the factor dtype on the model's device (converted once, at add)
    factors: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    # Every adapter's factors of this layer packed for the step (``packed``); rebuilt
    # lazily after add / remove.
    _packed: _Packed | None = None

    def changed(self) -> None:
        """Forget the packed factors (an adapter of this layer was added or removed)."""
        self._packed = None

    def packed(self) -> _Packed | None:
        """This layer's adapters' factors packed (``_Packed``); None without adapters."""
        if not self.factors:
            return None
        if self._packed is None:
            self._packed = self._pack()
        return self._packed

    def _pack(self) -> _Packed:
        # The parts any adapter targets, in output order, each at the largest rank any
        # adapter gives it; an adapter without a part, or of lower rank, has zeros there.
        names = sorted(
            {name for per in self.factors.values() for name in per},
            key=lambda name: self.parts[name][0],
        )
        ids = tuple(sorted(self.factors))
        some_a = next(iter(self.factors[ids[0]].values()))[0]
        spans: list[tuple[int, int, int, int]] = []
        col = 0
        for name in names:
            rank = max(per[name][0].shape[0] for per in self.factors.values() if name in per)
            first, rows = self.parts[name]
            spans.append((col, rank, first, rows))
            col += rank
        sizes = [r * n for _, r, _, n in spans]
        a = torch.zeros(len(ids), col, self.in_features, dtype=some_a.dtype, device=some_a.device)
        b = torch.zeros(len(ids), sum(sizes), dtype=some_a.dtype, device=some_a.device)
        b_parts: list[torch.Tensor] = []
        at = 0
        for (_, rank, _, rows), size in zip(spans, sizes):
            b_parts.append(b[:, at : at + size].view(len(ids), rank, rows))
            at += size
        for slot, i in enumerate(ids):
            for name, (c, _, _, _), b_part in zip(names, spans, b_parts):
                got = self.factors[i].get(name)
                if got is not None:
                    fa, fbt = got
                    a[slot, c : c + fa.shape[0]] = fa
                    b_part[slot, : fa.shape[0]] = fbt
        native_a = native_b = None
        if a.dtype == torch.bfloat16 and a.device.type == "cpu":
            native_a, native_b = native.pack_lora_factors(a, b_parts)
        return _Packed(
            ids,
            a,
            b,
            tuple(b_parts),
            tuple(spans),
            torch.tensor(spans, dtype=torch.int64),
            native_a,
            native_b,
        )


@dataclass(slots=True, frozen=True)
class _Packed:
    """A layer's adapters' factors, one slot per adapter (module docstring, "Fused")."""

    ids: tuple[int, ...]  # adapter id of each slot
    a: torch.Tensor  # [slots, R, in]: the parts' A stacked, part p at rank columns c_p..
    b: torch.Tensor  # [slots, sum of r_p * n_p]: each part's B^T [r_p, n_p], part after part
    b_parts: tuple[torch.Tensor, ...]  # views of ``b``: part p's [slots, r_p, n_p]
    spans: tuple[tuple[int, int, int, int], ...]  # per part (c_p, r_p, first output, n_p)
    parts: torch.Tensor  # ``spans`` as int64 [P, 4] on the CPU (the native kernel's)
    # The same factors as nb_lora_bf16 streams them (native.pack_lora_factors), on a
    # bfloat16 CPU base only (None otherwise).
    native_a: torch.Tensor | None = None
    native_b: torch.Tensor | None = None


@dataclass(slots=True, frozen=True)
class _Groups:
    """The step's rows of the adapters one layer has, grouped for ``bmm``."""

    slots: torch.Tensor | None  # slot of each group in _Packed (None: every slot in order)
    gather: torch.Tensor  # [k * G] row of each grouped position (padding: a group's row)
    pad: torch.Tensor | None  # positions that are padding (zeroed after the gather)
    k: int
    g: int


class LoRALayers:
    """The adapters loaded into one model (by ``lora_int_id``) and the hooks applying them."""

    def __init__(
        self,
        model: nn.Module,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        """Hook every adaptable linear of ``model`` on ``device``; ``dtype`` is the base's
        activations' (default: its first floating-point parameter's), which sets the
        factors' (bfloat16 on a bfloat16 base, quantized or not; float32 otherwise)."""
        layout: _Layout | None = getattr(model, "checkpoint_layout", None)
        if layout is None:
            raise TypeError(f"{type(model).__name__} declares no checkpoint_layout.")
        self.device = torch.device(device)
        if dtype is None:
            dtype = next(
                (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32
            )
        self.factor_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        # The step's rows of each adapter (None: no adapter rows) and its groupings by
        # the adapter set of a layer (begin_step, _groups).
        self._rows: dict[int, list[int]] | None = None
        self._grouped: dict[tuple[int, ...], _Groups | None] = {}
        # The native path of the step (begin_step): the step's row count when it may run
        # (on the CPU), else 0; and each adapter set's slot
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
        per_target: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
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
            _, rows = target.parts[name]
            if a.shape[1] != target.in_features or b.shape[0] != rows:
                raise ValueError(
                    f"LoRA adapter {adapter.source}: base model: {name} has lora_A "
                    f"{list(a.shape)} and lora_B {list(b.shape)}, but the model's layer takes "
                    f"{target.in_features} inputs to {rows} outputs (was it trained on another "
                    "base model?)."
                )
            # Converted once: the scale folded into B in float32, then one rounding to
            # the factor dtype; B transposed ([r, rows]) as the expand reads it.
            per_target.setdefault(target.path, {})[name] = (
                a.to(self.device, self.factor_dtype).contiguous(),
                (b * adapter.scale).t().to(self.device, self.factor_dtype).contiguous(),
            )
        by_path = {t.path: t for t in self._targets}
        for t in self._targets:
            if t.factors.pop(adapter.int_id, None) is not None:
                t.changed()
        for path, per in per_target.items():
            target = by_path[path]
            target.factors[adapter.int_id] = per
            target.changed()
        self.adapters[adapter.int_id] = adapter

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
        self._native_rows = row if self.device.type == "cpu" else 0
        self._native_threads = 1 if adapter_rows < NATIVE_PARALLEL_ROWS else torch.get_num_threads()
        return self._rows is not None

    def end_step(self) -> None:
        """Forget the step's rows (every later forward runs the base model only)."""
        self._rows = None
        self._grouped = {}
        self._slots_of = {}

    def _groups(self, packed: _Packed) -> _Groups | None:
        """The step's rows grouped by the adapters in ``packed`` (None: no such rows)."""
        if packed.ids in self._grouped:
            return self._grouped[packed.ids]
        assert self._rows is not None
        present = [(slot, self._rows[i]) for slot, i in enumerate(packed.ids) if i in self._rows]
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
                if slots == list(range(len(packed.ids)))
                else torch.tensor(slots, dtype=torch.int64, device=dev),
                torch.tensor(gather, dtype=torch.int64, device=dev),
                torch.tensor(pad, dtype=torch.int64, device=dev) if pad else None,
                len(present),
                g,
            )
        self._grouped[packed.ids] = groups
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
        packed = target.packed()
        if packed is None or self._native_delta(packed, x, out):
            return
        groups = self._groups(packed)
        if groups is None:
            return
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        a, b_parts = packed.a, packed.b_parts
        if groups.slots is not None:
            a = a.index_select(0, groups.slots)
            b_parts = tuple(b.index_select(0, groups.slots) for b in b_parts)
        xs = x2.index_select(0, groups.gather)
        if groups.pad is not None:
            xs.index_fill_(0, groups.pad, 0)  # padding rows: exact zero deltas
        # The shrink of every part at once (their A stacked), then each part's expand
        # from its own rank columns into its own outputs.
        h = torch.bmm(xs.view(groups.k, groups.g, -1), a.transpose(1, 2).to(xs.dtype))
        for (c, r, first, rows), b in zip(packed.spans, b_parts):
            y = torch.bmm(h[:, :, c : c + r], b.to(xs.dtype))
            out2.narrow(1, first, rows).index_add_(
                0, groups.gather, y.view(-1, rows).to(out2.dtype)
            )

    def _native_delta(self, packed: _Packed, x: torch.Tensor, out: torch.Tensor) -> bool:
        """The delta by the native kernel, one call (module docstring, "Native"); False
        (nothing done) where it does not apply: a float32 base, no kernels, a large step."""
        rows = self._native_rows
        na, nb = packed.native_a, packed.native_b
        if (
            not rows
            or na is None
            or nb is None
            or x.dtype != torch.bfloat16
            or out.dtype != torch.bfloat16
            or not x.is_contiguous()
            or not out.is_contiguous()
            or x.numel() != rows * packed.a.shape[2]
        ):
            return False
        kernels = self._native_kernels()
        if kernels is None:
            return False
        n = out.shape[-1]
        if out.numel() != rows * n:
            return False
        # Arguments built to fit (``_Packed``, ``_slots``): the unchecked entry point.
        status = kernels.lora_raw(
            x.data_ptr(),
            out.data_ptr(),
            self._slots(packed.ids).data_ptr(),
            na.data_ptr(),
            nb.data_ptr(),
            packed.parts.data_ptr(),
            rows,
            packed.a.shape[2],
            n,
            na.shape[0],
            na.shape[1] * 16,
            packed.parts.shape[0],
            nb.shape[1],
            self._native_threads,
            1,  # both products on AMX tiles where the CPU has them
        )
        if status:
            raise RuntimeError(f"nb_lora_bf16 refused its arguments ({status}).")
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
