"""Memory planning: weights + KV cache, estimated before any weight is loaded.

``plan_memory`` runs when the loader knows the model's shape and dtype but has not built
the model yet (the ``before_weights`` hook of ``load_model``). It estimates

- the **weights**: every tensor in the safetensors headers (shapes only; nothing is
  read) at the dtype the engine will use, not the checkpoint's; plus the separate packed
  ``lm_head`` that bfloat16 models with tied embeddings get (ops/linear.py); with
  ``quantization``, linear weights at that format's bytes per weight (ops/quant.py), so
  the KV cache gets the memory they no longer take; with ``NBENGINE_LINEAR=twin`` on
  CPUs with AMX, the oneDNN copy of the bfloat16 linear weights (ops/linear.py, "The
  oneDNN twin"), kept only while it takes at most ``_TWIN_SHARE`` of the free memory;
- the **RoPE tables**: cos and sin, float32, ``max_model_len x head_dim / 2`` each, per
  distinct RoPE setting (Gemma 3 has two; ops/rotary.py), which matter for very long
  contexts;
- the **KV cache**: ``num_kv_blocks`` blocks of ``2 * layers * block_size * kv_heads *
  head_dim * bytes_per_element``, the count set by ``num_kv_blocks``, else by
  ``kv_cache_memory_gb``, else (``kv_cache_memory_gb=None``) by what is free after the
  weights, keeping ``_HEADROOM`` of the free memory for activations and Python; never
  more blocks than ``max_num_seqs`` full-length sequences can use;

On a CUDA device the budget is ``gpu_memory_utilization`` of the GPU's total memory
(vLLM's meaning; it must be free when the engine starts), and the KV cache takes what is
left of it after the weights, the RoPE tables and an estimate of the activations
(``activation_bytes``), unless ``num_kv_blocks`` fixes it.

It raises ``InsufficientMemoryError`` (a ``ModelLoadError``) with the numbers when
weights + KV cache exceed the memory that is free now (``MemAvailable``, capped by a
cgroup limit in a container). The plan is kept by the runner and shown in the engine's
repr (docs/models.md, "Memory").
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nbengine.model.device import cuda_memory, format_bytes
from nbengine.model.errors import ModelLoadError
from nbengine.model.weights import read_safetensors_header
from nbengine.ops.linear import onednn_twin_supported

if TYPE_CHECKING:
    from nbengine.config import EngineConfig

__all__ = [
    "InsufficientMemoryError",
    "MemoryPlan",
    "available_memory",
    "format_bytes",
    "plan_memory",
]

logger = logging.getLogger(__name__)

_GIB = 1 << 30
# With kv_cache_memory_gb=None the KV cache takes what is free after the weights, less
# this share of the free memory (activations, logits, the tokenizer, Python itself).
_HEADROOM = 0.10
# The oneDNN twin of the linear weights (ops/linear.py) is kept only while it takes at
# most this share of the free memory: it buys speed, never the ability to load a model.
_TWIN_SHARE = 0.25


class InsufficientMemoryError(ModelLoadError):
    """Weights + KV cache do not fit in the free memory; the message has the numbers."""


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory() -> int | None:
    """Bytes this process can still allocate, or None where that cannot be told.

    Linux: ``MemAvailable`` of /proc/meminfo, capped by the cgroup's limit minus its usage
    (containers); elsewhere psutil's ``available`` when psutil is installed.
    """
    avail: int | None = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        try:
            import psutil  # optional

            avail = int(psutil.virtual_memory().available)
        except Exception:
            return None
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),  # cgroup v1
    ):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < (1 << 60):
            room = max(0, limit - usage)
            avail = room if avail is None else min(avail, room)
            break
    return avail


def _safetensors_numels(files: list[Path]) -> dict[str, int]:
    """Tensor name -> element count, from the files' JSON headers (no tensor is read)."""
    return {name: math.prod(shape) for name, shape in _safetensors_shapes(files).items()}


def _safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the files' checked headers (model/weights.py; no tensor
    is read)."""
    return {name: entry.shape for f in files for name, entry in read_safetensors_header(f).items()}


_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "wpe.weight")


@dataclass(frozen=True, slots=True)
class _ParamCounts:
    """A checkpoint's parameters by kind, in elements (from its safetensors headers)."""

    linear: int  # the linear layers' weights: 2-D tensors that are not embeddings
    other: int  # embeddings, norms, biases
    tied_embedding: int  # the embedding a tied lm_head reads (0 when untied)


def _param_counts(files: list[Path], cfg: dict[str, Any], arch: str) -> _ParamCounts:
    tied = bool(cfg.get("tie_word_embeddings", arch == "GPT2LMHeadModel"))
    linear = other = embed = 0
    for name, shape in _safetensors_shapes(files).items():
        n = math.prod(shape)
        if arch == "GPT2LMHeadModel" and name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # GPT-2's stored causal masks are buffers nbengine does not load
        if tied and name == "lm_head.weight":
            continue  # the tied head shares the embedding
        if name.endswith(("embed_tokens.weight", "wte.weight")):
            embed = n
        if len(shape) == 2 and not name.endswith(_EMBEDDINGS):
            linear += n
        else:
            other += n
    return _ParamCounts(linear, other, embed if tied else 0)


def _weights_bytes(
    counts: _ParamCounts, dtype: torch.dtype, quantization: str | None, packed: bool
) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    per_weight = float(elem)
    if quantization is not None:
        from nbengine.ops.quant import bytes_per_weight

        per_weight = bytes_per_weight(quantization)
    total = counts.linear * per_weight + counts.other * elem
    if quantization is not None:
        total += counts.tied_embedding * per_weight  # the tied head's own quantized copy
    elif dtype == torch.bfloat16 and packed:
        # bfloat16 packing gives a tied lm_head its own copy (ops/linear.py)
        total += counts.tied_embedding * elem
    return int(total)


def _linear_weights_bytes(counts: _ParamCounts, dtype: torch.dtype) -> int:
    """Bytes of the packed linear layers (a tied lm_head's copy included) at ``dtype``:
    what a oneDNN twin copies (ops/linear.py)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return (counts.linear + counts.tied_embedding) * elem


def weights_bytes(
    files: list[Path],
    cfg: dict[str, Any],
    arch: str,
    dtype: torch.dtype,
    quantization: str | None = None,
    packed: bool = True,
) -> int:
    """Bytes the model's parameters will take at ``dtype``.

    ``packed``: the CPU's bfloat16 weight packing will run (False on a CUDA device).

    With ``quantization``, every linear layer's weight (a 2-D tensor that is not an
    embedding) at that format's bytes per weight (ops/quant.py), and a tied ``lm_head``
    as a quantized copy of the embedding.
    """
    return _weights_bytes(_param_counts(files, cfg, arch), dtype, quantization, packed)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What the engine will hold in memory, decided before the weights are loaded."""

    weights_bytes: int
    buffers_bytes: int  # the RoPE cos/sin tables
    kv_block_bytes: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    dtype: str
    available_bytes: int | None  # free when planned; None if it could not be told
    quantization: str | None = None  # the weights' format (ops/quant.py); None: dtype
    # The oneDNN copy of the bfloat16 linear weights (ops/linear.py); 0: none.
    onednn_twin_bytes: int = 0
    device: str = "cpu"  # on CUDA, available_bytes is gpu_memory_utilization's budget

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache (K and V, every layer)."""
        return self.num_kv_blocks * self.kv_block_bytes

    @property
    def total_bytes(self) -> int:
        """Weights (and their oneDNN copy), RoPE tables and KV cache."""
        fixed = self.weights_bytes + self.onednn_twin_bytes + self.buffers_bytes
        return fixed + self.kv_cache_bytes

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds, over all sequences."""
        return self.num_kv_blocks * self.block_size

    def summary(self) -> str:
        """One line: weights + KV cache (tokens) of the memory that was free."""
        free = (
            ""
            if self.available_bytes is None
            else f" of {format_bytes(self.available_bytes)} free"
            if self.device == "cpu"
            else f" of {format_bytes(self.available_bytes)} allowed on {self.device}"
        )
        rope = f" + RoPE tables {format_bytes(self.buffers_bytes)}" if self.buffers_bytes else ""
        if self.onednn_twin_bytes:
            rope = f" + oneDNN copy of the linears {format_bytes(self.onednn_twin_bytes)}" + rope
        kind = (
            self.dtype
            if self.quantization is None
            else f"{self.quantization}, {self.dtype} activations"
        )
        return (
            f"weights {format_bytes(self.weights_bytes)} ({kind}){rope} + KV cache "
            f"{format_bytes(self.kv_cache_bytes)} ({self.kv_tokens} tokens) = "
            f"{format_bytes(self.total_bytes)}{free}"
        )


def _kv_dims(cfg: dict[str, Any], arch: str, max_len: int) -> tuple[int, int, int, int]:
    """(layers, kv heads, head dim, RoPE table bytes) of the model."""
    if arch == "GPT2LMHeadModel":
        from nbengine.model.gpt2 import GPT2Args

        gpt2 = GPT2Args.from_hf(cfg)
        return gpt2.num_layers, gpt2.num_heads, gpt2.hidden_size // gpt2.num_heads, 0
    from nbengine.model.gemma import GEMMA_ARCHITECTURES, GemmaArgs

    table = 2 * max_len * 4  # cos and sin, float32, times head_dim / 2 below
    if arch in GEMMA_ARCHITECTURES:
        g = GemmaArgs.from_hf(cfg, arch, max_len)
        tables = len(set(map(repr, g.layer_rope)))  # one table per distinct (theta, scaling)
        return g.num_layers, g.num_kv_heads, g.head_dim, tables * table * (g.head_dim // 2)
    from nbengine.model.llama import DecoderArgs

    d = DecoderArgs.from_hf(cfg, arch, max_len)
    return d.num_layers, d.num_kv_heads, d.head_dim, table * (d.head_dim // 2)


_CUDA_RESERVE = 256 << 20  # allocator fragmentation, cuBLAS workspaces


def activation_bytes(config: EngineConfig, cfg: dict[str, Any], dtype: torch.dtype) -> int:
    """An upper estimate of one step's activations on a GPU: a layer's live tensors for
    ``max_num_batched_tokens`` tokens, and float32 logits with the sampler's temporaries
    (sort, cumulative sums) for ``max_num_seqs`` rows."""
    hidden = int(cfg.get("hidden_size") or cfg.get("n_embd") or 0)
    inter = int(cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * hidden)
    vocab = int(cfg.get("vocab_size") or 0)
    elem = torch.empty((), dtype=dtype).element_size()
    tokens = config.scheduler.max_num_batched_tokens
    rows = config.scheduler.max_num_seqs
    return tokens * (8 * hidden + 3 * inter) * elem + rows * vocab * 32 + _CUDA_RESERVE


def _advice(dtype: torch.dtype) -> str:
    tips = ["a smaller max_model_len", "num_kv_blocks= or a smaller kv_cache_memory_gb"]
    if dtype == torch.float32:
        tips.append('dtype="bfloat16" (half the memory)')
    return "Try " + ", ".join(tips) + ", or free memory (other engines: engine.shutdown())."


def plan_memory(
    config: EngineConfig,
    weight_files: list[Path],
    cfg: dict[str, Any],
    arch: str,
    dtype: torch.dtype,
    max_model_len: int,
    available: int | None = None,
    device_memory: tuple[int, int] | None = None,
) -> MemoryPlan:
    """Size the KV cache and check that weights + KV cache fit in free memory.

    ``available`` None measures the free memory now (``available_memory()``).
    On a CUDA device, ``device_memory`` is the GPU's ``(free, total)`` bytes (None:
    measured now, ``torch.cuda.mem_get_info``); tests pass it to plan a GPU on any machine.
    Raises ``InsufficientMemoryError`` with the numbers when they cannot fit.
    """
    device = config.model.device
    cuda = device != "cpu"
    cache, sched = config.cache, config.scheduler
    if cuda:
        if device_memory is None:
            device_memory = cuda_memory(device)
        free, total = device_memory
        util = cache.gpu_memory_utilization
        available = int(total * util)
        if free < available:
            raise InsufficientMemoryError(
                f"gpu_memory_utilization={util} asks for {format_bytes(available)} of "
                f"{device}'s {format_bytes(total)}, but only {format_bytes(free)} is free "
                f"(other processes use {format_bytes(total - free)}). Lower "
                "gpu_memory_utilization or free GPU memory (other engines: engine.shutdown())."
            )
    elif available is None:
        available = available_memory()
    dtype_name = str(dtype).removeprefix("torch.")
    quantization = config.model.quantization
    counts = _param_counts(weight_files, cfg, arch)  # the headers are read once
    weights = _weights_bytes(counts, dtype, quantization, packed=not cuda)
    layers, kv_heads, head_dim, rope = _kv_dims(cfg, arch, max_model_len)
    twin = 0
    if quantization is None and not cuda and onednn_twin_supported(dtype):
        twin = _linear_weights_bytes(counts, dtype)
        if available is not None and twin > _TWIN_SHARE * available:
            logger.info(
                "No oneDNN copy of the linear weights: it would take %s of %s free.",
                format_bytes(twin),
                format_bytes(available),
            )
            twin = 0
    fixed = weights + twin + rope
    elem = torch.empty((), dtype=dtype).element_size()
    per_block = 2 * layers * cache.block_size * kv_heads * head_dim * elem
    per_seq = math.ceil(max_model_len / cache.block_size)
    useful = sched.max_num_seqs * per_seq  # more blocks than this can never be used

    if cuda:
        fixed += activation_bytes(config, cfg, dtype)
    if cache.num_kv_blocks is not None:
        blocks = cache.num_kv_blocks
    elif cuda:
        assert available is not None
        blocks = min(max(0, available - fixed) // per_block, useful)
        if blocks < per_seq:
            raise InsufficientMemoryError(
                f"Not enough GPU memory for the KV cache of one {max_model_len}-token "
                f"sequence: it needs {format_bytes(per_seq * per_block)}, and "
                f"gpu_memory_utilization={cache.gpu_memory_utilization} allows "
                f"{format_bytes(available)} on {device}, of which the weights, RoPE tables and "
                f"activations take {format_bytes(fixed)}. Raise gpu_memory_utilization, or "
                "try a smaller max_model_len or max_num_batched_tokens."
            )
    elif cache.kv_cache_memory_gb is not None:
        blocks = min(max(1, int(cache.kv_cache_memory_gb * _GIB) // per_block), useful)
    elif available is None:
        logger.warning("Free memory cannot be measured here; the KV cache takes 1 GiB.")
        blocks = min(max(1, _GIB // per_block), useful)
    else:
        budget = int(available * (1 - _HEADROOM)) - fixed
        blocks = min(max(0, budget) // per_block, useful)
        if blocks < per_seq:
            raise InsufficientMemoryError(
                f"Not enough free memory for the KV cache of one {max_model_len}-token "
                f"sequence: it needs {format_bytes(per_seq * per_block)} "
                f"({format_bytes(per_block / cache.block_size)} per token, {dtype_name}), and "
                f"{format_bytes(available)} is free, of which the weights"
                + (
                    f" and RoPE tables take {format_bytes(fixed)}"
                    if rope
                    else f" take {format_bytes(fixed)}"
                )
                + f" and {_HEADROOM:.0%} is kept for activations. "
                + _advice(dtype)
            )
    plan = MemoryPlan(
        weights,
        rope,
        per_block,
        blocks,
        cache.block_size,
        max_model_len,
        dtype_name,
        available,
        quantization,
        twin,
        device,
    )
    if available is not None and plan.total_bytes > available:
        raise InsufficientMemoryError(
            f"The model does not fit in free memory: weights {format_bytes(weights)} "
            f"({dtype_name})"
            + (f" + RoPE tables {format_bytes(rope)}" if rope else "")
            + f" + KV cache {format_bytes(plan.kv_cache_bytes)} ({blocks} blocks "
            f"of {cache.block_size} tokens) = {format_bytes(plan.total_bytes)}, but only "
            f"{format_bytes(available)} is "
            + ("free. " if not cuda else f"allowed on {device} by gpu_memory_utilization. ")
            + _advice(dtype)
        )
    logger.info("Memory plan: %s.", plan.summary())
    return plan
