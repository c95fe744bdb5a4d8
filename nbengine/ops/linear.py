"""Linear layers with prepacked bfloat16 weights (CPU fast paths).

Two packings, tried in this order by ``pack_linears``:

``NativeLinear``: nbengine's own kernel (ops/kernels.c via ops/native.py), weights in a
VNNI layout inside one huge-page ``WeightArena``. It reads the weights of a decode step
as one sequential stream: measured here (2 threads, SmolLM2-135M shapes, all 30 layers
plus lm_head, M = 1) 9 ms per step against 15-20 ms for oneDNN's prepacked weights, and on
the AMD host (no AMX) it was as fast as oneDNN at every batch size up to 512 rows.

``PackedLinear``: oneDNN's prepacked weights, where the native kernels are unavailable.

**Products of many rows (CPUs with AMX).** The native kernels use AVX-512 BF16 dot
products, which a product of many rows leaves compute bound. On a CPU with AMX tile
units (``amx_bf16``: Intel Xeon since Sapphire Rapids) ``NativeKernels.linear`` runs
products of ``native.BF16_AMX_ROWS`` rows or more on the tiles instead, reading the same
packed weights (ops/kernels.c, "bfloat16 weights on AMX tiles"): prefill chunks and
large decode batches on the tiles, small decode batches through the dpbf16 kernels and
the whole-stack decode plan (model/decode_plan.py). Measured on this project's Intel
host (2 threads, one pass over the Llama-3.2-1B shape's linears): 16 rows 102 ms
against 348 with the dpbf16 kernels, 512 rows 883 ms against 6563.

**The oneDNN twin (``NBENGINE_LINEAR=twin``).** Before those tile kernels, a
``NativeLinear`` on an AMX CPU also held a oneDNN-packed copy of its weight (the twin)
and sent products of ``ONEDNN_MIN_ROWS`` rows or more to oneDNN's AMX kernels. That
copy doubles the linear layers' memory and is made again at every load (a oneDNN
tensor cannot be stored in the load cache), for products about as fast as the native
tiles' (same pass: 16 rows 109 ms, 512 rows 821-872 ms). It is kept as an option for
comparisons; the memory plan counts it and turns it off when it would take much of the
free memory (model/memory_plan.py). oneDNN rounds its output to bfloat16 (as
``F.linear`` does), so the float32 logits of a large batch carry bfloat16 rounding,
like ``transformers'``. ``NBENGINE_LINEAR=onednn`` uses oneDNN's packing alone (no
native linears, no decode plan), for comparisons.

``F.linear`` on bfloat16 CPU tensors re-lays the weight out on every call and, for the
single-row products of decoding, runs a slow path: measured on this project's machine
(AMD EPYC, avx512_bf16, one thread) a ``[1, 576] x [576, 49152]`` product takes 11.8 ms
with ``F.linear`` and 6.3 ms with a weight prepacked once by oneDNN
(``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``, the kernels
``torch.compile``'s CPU backend uses after freezing); ``[64, 576] x [576, 49152]`` takes
46 ms vs 28 ms. Results are bit-identical to ``F.linear`` on that machine.

The reference is ``F.linear`` itself; ``pack_linears`` checks every packed layer against
it once and keeps ``nn.Linear`` wherever packing is unavailable or disagrees. float32
models are never packed, so float32 parity with transformers is untouched.
Set ``NBENGINE_PACKED_LINEAR=0`` to turn packing off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nbengine.ops import native, native_build
from nbengine.ops.arena import WeightArena

logger = logging.getLogger(__name__)


# Products with at least this many rows go to the oneDNN twin (module docstring): the
# rows from which the native kernels use AMX tiles, so that a step's rounding changes at
# one row count whichever runs it (the decode plan takes the smaller steps).
ONEDNN_MIN_ROWS = native.BF16_AMX_ROWS


def linear_mode() -> str:
    """``NBENGINE_LINEAR``: "auto" (the default: native, on AMX tiles from
    ``native.BF16_AMX_ROWS`` rows where the CPU has them), "native" (the same), "twin"
    (native, with a oneDNN twin on AMX CPUs) or "onednn" (oneDNN packing alone)."""
    mode = os.environ.get("NBENGINE_LINEAR", "auto")
    return mode if mode in ("auto", "native", "twin", "onednn") else "auto"


def onednn_amx_supported(dtype: torch.dtype) -> bool:
    """True when ``dtype`` products of many rows here can run on oneDNN's AMX kernels
    beside the native ones: native kernels and oneDNN bfloat16 available, a CPU with AMX,
    and ``NBENGINE_LINEAR`` not "onednn"."""
    return (
        linear_mode() != "onednn"
        and packed_linear_supported(dtype)
        and native.kernels() is not None
        and native_build.has_amx()
    )


def onednn_twin_supported(dtype: torch.dtype) -> bool:
    """True when bfloat16 ``NativeLinear``s here should carry a oneDNN twin:
    ``NBENGINE_LINEAR=twin`` and ``onednn_amx_supported``."""
    return linear_mode() == "twin" and onednn_amx_supported(dtype)


def amx_min_rows(twin: bool) -> int | None:
    """The rows from which ``pack_linears``' bfloat16 products here (with a oneDNN
    ``twin`` or not) run on AMX tiles, and so round otherwise than a row alone; None:
    never (no AMX, or ``NBENGINE_LINEAR=onednn``)."""
    if twin:
        return ONEDNN_MIN_ROWS
    kernels = native.kernels() if linear_mode() != "onednn" else None
    return native.BF16_AMX_ROWS if kernels is not None and kernels.amx else None


def packed_linear_supported(dtype: torch.dtype) -> bool:
    """True when oneDNN can prepack ``dtype`` weights on this CPU (bfloat16 only)."""
    if dtype != torch.bfloat16 or os.environ.get("NBENGINE_PACKED_LINEAR", "1") == "0":
        return False
    try:
        return bool(
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's blocked layout (inference only)."""

    packed_weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, batch_size_hint: int | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach()
        self.register_buffer(
            "packed_weight",
            torch.ops.mkldnn._reorder_linear_weight(w, batch_size_hint),
            persistent=False,
        )
        b = linear.bias
        self.register_buffer("bias", None if b is None else b.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, "none", [None], ""
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


class NativeLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` packed for nbengine's native kernel (inference only)."""

    packed_weight: torch.Tensor
    bias: torch.Tensor | None
    _w: torch.Tensor
    _b: torch.Tensor | None

    def __init__(
        self,
        linear: nn.Linear,
        kernels: native.NativeKernels,
        arena: WeightArena | None = None,
        onednn_twin: bool = False,
        packed: torch.Tensor | None = None,
    ) -> None:
        """``linear``'s weight packed (into ``arena`` when given); with ``packed``, that
        weight already packed (``pack_linear_weight``'s layout, flat: e.g. a view of a
        load cache entry, model/load_cache.py), and ``linear.weight`` is read only for a
        ``onednn_twin``."""
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self._kernels = kernels
        shape = (native.packed_linear_numel(self.out_features, self.in_features),)
        if packed is not None:
            if tuple(packed.shape) != shape or packed.dtype != torch.bfloat16:
                raise ValueError(f"a packed weight of {shape} bfloat16 expected")
            w = packed
        else:
            out = arena.take(shape, torch.bfloat16) if arena is not None else None
            w = native.pack_linear_weight(linear.weight.detach(), out)
        self.register_buffer("packed_weight", w, persistent=False)
        b = linear.bias
        self.register_buffer(
            "bias", None if b is None else b.detach().contiguous().clone(), persistent=False
        )
        # The oneDNN copy for products of ONEDNN_MIN_ROWS rows or more (module docstring).
        twin = (
            torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
            if onednn_twin
            else None
        )
        self.register_buffer("onednn_weight", twin, persistent=False)
        # Plain attributes for the per-call path (nn.Module.__getattr__ costs ~1 us a lookup).
        self._w, self._b, self._dnn = self.packed_weight, self.bias, twin

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``x [..., in_features]`` -> ``[..., out_features]`` in ``out_dtype`` (bf16 or f32)."""
        if x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_contiguous():  # the usual case
            # All in this one frame: a Python frame per call costs tens of microseconds with
            # the caches the previous kernel flushed (ops/attention_kernels.py,
            # rope_paged_attention).
            if self._dnn is not None and x.shape[0] >= ONEDNN_MIN_ROWS:
                y = torch.ops.mkldnn._linear_pointwise(x, self._dnn, self._b, "none", [None], "")
                return y if out_dtype == torch.bfloat16 else y.to(out_dtype)
            return self._kernels.linear(x, self._w, self.out_features, self._b, out_dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.bfloat16 or not x2.is_contiguous():
            x2 = x2.to(torch.bfloat16).contiguous()
        return self.forward(x2, out_dtype).view(*lead, self.out_features)

    @property
    def has_onednn_twin(self) -> bool:
        """Whether products of ``ONEDNN_MIN_ROWS`` rows or more run in oneDNN."""
        return self._dnn is not None

    def extra_repr(self) -> str:
        twin = " + onednn twin" if self._dnn is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, native{twin}"


def _check_rows(n: int) -> torch.Tensor:
    """The output features ``_agrees`` compares: one in every tile of 64 (at a different
    place in each, the last feature included). Comparing every feature would cost a
    bfloat16 ``F.linear`` over the whole weight, seconds for a large vocabulary; the
    packing moves every tile alike, so a wrong layout shows in every tile."""
    tiles = torch.arange(0, n, 64)
    picked = torch.minimum(tiles + (tiles // 64 * 37) % 64, torch.tensor(n - 1))
    return torch.unique(torch.cat([picked, torch.tensor([n - 1])]))


def _agrees(linear: nn.Linear, packed: nn.Module) -> bool:
    """The packed layer's products (few rows, and enough rows to reach a oneDNN twin)
    agree with ``F.linear`` at the features ``_check_rows`` picks."""
    gen = torch.Generator().manual_seed(0)
    idx = _check_rows(linear.out_features)
    weight = linear.weight.detach()[idx]
    bias = None if linear.bias is None else linear.bias.detach()[idx]
    for rows in (3, ONEDNN_MIN_ROWS + 1):
        x = torch.randn(rows, linear.in_features, generator=gen).to(linear.weight.dtype)
        with torch.inference_mode():
            want = F.linear(x, weight, bias).float()
            got = packed(x).float()[:, idx]
        tol = 1e-2 * float(want.abs().max()) + 1e-6
        if not torch.allclose(got, want, rtol=1e-2, atol=tol):
            return False
    return True


def _bf16_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16
    ]


def pack_linears(
    model: nn.Module, batch_size_hint: int | None = None, onednn_twin: bool = False
) -> int:
    """Replace every bfloat16 ``nn.Linear`` of ``model`` by a packed one; returns how many.

    ``NativeLinear`` (all weights in one ``WeightArena``; with ``onednn_twin`` each also
    keeps a oneDNN copy for products of many rows, see the module docstring) where the
    native kernels are available, else ``PackedLinear``. A layer whose packed product
    disagrees with ``F.linear`` (or cannot be packed) is left as it is. Tied weights stay
    tied where they are read as weights (the embedding); the packed copy of a tied
    ``lm_head`` is separate.
    """
    linears = _bf16_linears(model)
    kernels = native.kernels() if linear_mode() != "onednn" else None
    make: Callable[[nn.Linear], nn.Module]
    if kernels is not None:
        linears = [(p, n, c) for p, n, c in linears if c.in_features % 2 == 0]  # kernel's limit
        arena = WeightArena(
            sum(
                2 * native.packed_linear_numel(c.out_features, c.in_features) + 64
                for _, _, c in linears
            )
        )
        make = lambda lin: NativeLinear(lin, kernels, arena, onednn_twin)  # noqa: E731
    elif packed_linear_supported(torch.bfloat16):
        make = lambda lin: PackedLinear(lin, batch_size_hint)  # noqa: E731
    else:
        return 0
    count = 0
    # Popped one by one: each replaced layer's weight is freed as soon as it is packed, so
    # packing holds one layer twice, never the model.
    linears.reverse()
    while linears:
        parent, name, child = linears.pop()
        try:
            packed = make(child)
        except RuntimeError as exc:
            logger.info("not packing %s: %s", name, exc)
            continue
        if not _agrees(child, packed):
            logger.warning("packed %s disagrees with F.linear; keeping nn.Linear", name)
            continue
        setattr(parent, name, packed)
        count += 1
    return count
