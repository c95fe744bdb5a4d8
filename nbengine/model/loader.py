"""Load a Hugging Face-format model directory (config.json + safetensors + tokenizer.json).

Supported architectures are listed in ``SUPPORTED_ARCHITECTURES``. Weights come from
``model.safetensors``, or from the shards named by ``model.safetensors.index.json``, or
from every ``*.safetensors`` in the directory. Every problem (missing file, unsupported
architecture, missing tensor, wrong shape) raises ``ModelLoadError`` (a ``ValueError``)
naming it; a missing directory raises ``FileNotFoundError``.

``dtype="auto"`` follows vLLM: the checkpoint's own dtype (``torch_dtype``) when this
machine runs it well: a bfloat16 (or float16) checkpoint runs in bfloat16 where
nbengine's native bfloat16 kernels are available (x86-64 with AVX-512 BF16), and in
float32 elsewhere, where torch's bfloat16 CPU paths are slower than float32; float16 is
never picked on a CPU (no fast float16 matrix products). docs/models.md, "dtype", and
docs/benchmarks.md give the measured reasons. On a CUDA device "auto" is the checkpoint's
own bfloat16 or float16; a float32 checkpoint runs in bfloat16 where the GPU supports
it, else float16 (as vLLM does).
"""

from __future__ import annotations

import logging
import mmap
import struct
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from nbengine.config import ModelConfig
from nbengine.model.config_check import check_hf_config, check_inside
from nbengine.model.errors import ModelLoadError
from nbengine.model.files import is_regular_file, open_regular, read_json
from nbengine.model.gemma import GEMMA_ACTIVATIONS, GEMMA_ARCHITECTURES, GemmaArgs, GemmaForCausalLM
from nbengine.model.gpt2 import GPT2Args, GPT2LMHeadModel
from nbengine.model.llama import DecoderArgs, LlamaForCausalLM
from nbengine.model.packed_cache import PackedCache
from nbengine.model.progress import LoadProgress, progress_enabled
from nbengine.model.tokenizer import Tokenizer
from nbengine.model.weights import (
    TensorEntry,
    WeightMap,
    WeightSource,
    read_safetensors_header,
)
from nbengine.model.windows import kv_window
from nbengine.ops.rotary import SUPPORTED_ROPE_TYPES, RotaryEmbedding, rope_type_of

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR: Path = Path(__file__).resolve().parent.parent / "default_model"

_LLAMA_FAMILY = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Olmo2ForCausalLM",
)
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (*_LLAMA_FAMILY, *GEMMA_ARCHITECTURES, "GPT2LMHeadModel")

# The model classes build_model makes: each an nn.Module and a CausalLM (model/protocol.py).
ModelModule: TypeAlias = LlamaForCausalLM | GemmaForCausalLM | GPT2LMHeadModel
_M = TypeVar("_M", bound=nn.Module)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# safetensors dtype -> the torch dtype a mapped view of it has (model/weights.py).
_TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run, with what the engine needs to know about it."""

    model: ModelModule
    hf_config: dict[str, Any]
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int  # width of the logits
    eos_token_ids: frozenset[int]
    architecture: str
    path: Path
    tokenizer: Tokenizer
    # Set when every attention layer is windowed: the largest window, behind which the KV
    # cache frees blocks (core/kv_cache.py); None otherwise.
    kv_sliding_window: int | None = None
    # With ``pack_cache``: the layers mapped packed from the load cache (a hit), or, on a
    # miss, the entry to store once ``pack_linears`` has packed them (model/packed_cache.py).
    packed_from_cache: int = 0
    pack_cache: PackedCache | None = None


def resolve_model_dir(model: str | Path | None, revision: str | None = None) -> Path:
    """The model directory for ``model`` (None -> the shipped default model).

    A string that is not an existing path but reads as a Hugging Face Hub id ("org/name")
    resolves to its snapshot in the Hub cache, downloaded if needed (model/hub.py);
    ``revision`` (branch, tag or commit) applies to Hub ids only.
    """
    if model is None:
        if not (DEFAULT_MODEL_DIR / "config.json").is_file():
            raise FileNotFoundError(
                f"The default model is not installed at {DEFAULT_MODEL_DIR}; "
                "pass the path of a Hugging Face-format model directory."
            )
        return DEFAULT_MODEL_DIR
    if not isinstance(model, (str, Path)):
        raise TypeError(f"model must be a path (str or Path) or None, got {model!r}.")
    path = Path(model).expanduser()
    if not path.exists():
        from nbengine.model.hub import is_hub_repo_id, resolve_hub_model

        if isinstance(model, str) and is_hub_repo_id(model):
            return resolve_hub_model(model, revision)
        raise FileNotFoundError(
            f"Model directory {str(path)!r} does not exist (and it is not a Hugging Face Hub "
            "model id such as 'org/name')."
        )
    if not path.is_dir():
        raise ModelLoadError(
            f"Model path {str(path)!r} is not a directory; expected a Hugging Face-format "
            "directory with config.json, *.safetensors and tokenizer.json."
        )
    return path


def auto_dtype(hf_config: dict[str, Any], device: str = "cpu") -> str:
    """What ``dtype="auto"`` means for a checkpoint on ``device`` (module docstring)."""
    declared = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if device != "cpu":
        if declared in ("bfloat16", "float16"):
            return str(declared)
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if declared in ("bfloat16", "float16"):
        from nbengine.ops import native

        if native.unavailable_reason() is None:
            return "bfloat16"
    return "float32"


def resolve_dtype(
    dtype: str, hf_config: dict[str, Any] | None = None, device: str = "cpu"
) -> torch.dtype:
    """Map ModelConfig.dtype to a torch dtype ("auto": ``auto_dtype`` of the checkpoint)."""
    if dtype == "auto":
        return _DTYPES[auto_dtype(hf_config or {}, device)]
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {('auto', *_DTYPES)}, got {dtype!r}.") from None


def read_hf_config(path: Path) -> dict[str, Any]:
    """Parse config.json, naming the file in any error (a FIFO or JSON nested beyond
    bounds too: model/files.py)."""
    cfg_file = path / "config.json"
    if not is_regular_file(cfg_file):
        raise ModelLoadError(f"No config.json in model directory {str(path)!r}.")
    cfg = read_json(cfg_file)
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_file} does not hold a JSON object.")
    return cfg


def architecture_of(cfg: dict[str, Any], path: Path) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return str(arch)
    raise ModelLoadError(
        f"Unsupported architecture {archs or cfg.get('model_type')!r} in {path / 'config.json'}; "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
    )


def _max_model_len(cfg: dict[str, Any], arch: str, requested: int | None) -> int:
    if arch == "GPT2LMHeadModel":
        max_pos = int(cfg.get("n_positions", cfg.get("max_position_embeddings", 1024)))
    else:
        max_pos = int(cfg.get("max_position_embeddings", 2048))
    if requested is not None and requested > max_pos:
        raise ValueError(
            f"max_model_len={requested} is larger than the model's maximum context "
            f"(max_position_embeddings={max_pos})."
        )
    # Sliding-window layers attend within their window at any length (ops/attention.py).
    return requested if requested is not None else max_pos


def build_model(cfg: dict[str, Any], arch: str, max_positions: int, path: Path) -> ModelModule:
    """Construct the (uninitialised) module for ``arch``."""
    try:
        if arch == "GPT2LMHeadModel":
            gargs = GPT2Args.from_hf(cfg)
            if gargs.activation not in ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu"):
                raise ModelLoadError(f"Unsupported GPT-2 activation {gargs.activation!r}.")
            if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
                raise ModelLoadError(
                    "GPT-2 options scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn "
                    "are not supported."
                )
            return _without_init(lambda: GPT2LMHeadModel(gargs))
        if arch in GEMMA_ARCHITECTURES:
            return _build_gemma(GemmaArgs.from_hf(cfg, arch, max_positions), path)
        dargs = DecoderArgs.from_hf(cfg, arch, max_positions)
    except KeyError as exc:
        raise ModelLoadError(f"{path / 'config.json'} lacks the field {exc.args[0]!r}.") from exc
    if dargs.hidden_act != "silu":
        raise ModelLoadError(f"Unsupported hidden_act {dargs.hidden_act!r} (only 'silu').")
    rope_type = rope_type_of(dargs.rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"Unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    if dargs.num_heads % dargs.num_kv_heads:
        raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads.")
    try:
        return _without_init(lambda: LlamaForCausalLM(dargs))
    except (KeyError, ValueError) as exc:  # e.g. rope scaling parameters that do not fit
        raise ModelLoadError(f"Bad rope settings in {path / 'config.json'}: {exc}") from exc


def _build_gemma(gargs: GemmaArgs, path: Path) -> GemmaForCausalLM:
    if gargs.hidden_act not in GEMMA_ACTIVATIONS:
        raise ModelLoadError(
            f"Unsupported Gemma hidden_activation {gargs.hidden_act!r} "
            f"(supported: {', '.join(GEMMA_ACTIVATIONS)})."
        )
    if gargs.num_heads % gargs.num_kv_heads:
        raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads.")
    for _, scaling in gargs.layer_rope:
        if rope_type_of(scaling) not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"Unsupported rope scaling {rope_type_of(scaling)!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
            )
    try:
        return _without_init(lambda: GemmaForCausalLM(gargs))
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"Bad rope settings in {path / 'config.json'}: {exc}") from exc


_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
)


def _without_init(factory: Callable[[], _M]) -> _M:
    """Build a model on the CPU with uninitialised parameters.

    Every parameter is filled from the checkpoint afterwards, so random initialisation
    would be wasted work. (Building on the meta device instead routes the init calls
    through torch's Python reference kernels, which import torch._dynamo: seconds per
    process.)
    """
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("cpu"):
            return factory()
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _retype(model: nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` without copying: every floating parameter gets fresh,
    uninitialised storage in ``dtype`` (the checkpoint fills it; an untouched page costs
    no memory, so a weight that is quantized straight from the file never takes any).
    Converting the uninitialised float32 storage instead would touch, and hold, all of it
    at once. Buffers are cast as ``model.to`` casts them."""
    with torch.no_grad():
        for param in model.parameters():  # a tied parameter is listed once
            if param.is_floating_point() and param.dtype != dtype:
                param.data = torch.empty(param.shape, dtype=dtype)
    model.to(dtype)  # the buffers (parameters are in dtype already: no copy)


def _weight_files(path: Path) -> list[Path]:
    """The weight files of ``path``; each is a regular file (or missing: refused here)."""
    index = path / "model.safetensors.index.json"
    if is_regular_file(index):
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"The shard index {index} has no weight_map object.")
        files = sorted({check_inside(path, f, index) for f in weight_map.values()})
        for f in files:
            if not is_regular_file(f):
                raise ModelLoadError(f"Weight shard {f.name} listed in {index.name} is missing.")
        return files
    single = path / "model.safetensors"
    if is_regular_file(single):
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"No weights in {str(path)!r}: expected model.safetensors or sharded *.safetensors "
            "(pytorch_model.bin is not supported)."
        )
    return files


class _Checkpoint:
    """The weight files of a model directory, opened. A tensor (or a slice of its rows)
    is read when asked for, so a load holds at most one tensor beside the model, never
    a copy of the whole file: float32, bfloat16 and float16 tensors are read from the
    file straight into their destination (``read_into``: no mapping whose touched pages
    would count as the process's memory, no intermediate copy), other dtypes through
    safetensors.

    Each file's header is checked whole (``read_safetensors_header``) before safetensors
    opens it; a tensor torch cannot read is a ``ModelLoadError`` naming file and tensor.
    """

    def __init__(self, files: list[Path], path: Path, stack: ExitStack) -> None:
        self.path = path
        self.files = files
        self.where: dict[str, tuple[Any, Path]] = {}
        self._mappings: dict[Path, tuple[mmap.mmap, int]] = {}
        self.entries: dict[str, tuple[TensorEntry, Path]] = {}
        # Each file, open, with the byte at which its tensors' data starts.
        self._open: dict[Path, tuple[Any, int]] = {}
        for f in files:
            for name, entry in read_safetensors_header(f).items():
                self.entries[name] = (entry, f)
            raw = stack.enter_context(open_regular(f))
            (length,) = struct.unpack("<Q", raw.read(8))
            self._open[f] = (raw, 8 + length)
            try:
                handle = stack.enter_context(safe_open(str(f), framework="pt"))
            except Exception as exc:  # safetensors raises its own error types
                raise ModelLoadError(f"Cannot open weight file {f}: {exc}") from exc
            for name in handle.keys():
                self.where[name] = (handle, f)

    def _locate(self, src: WeightSource) -> tuple[str, Any, Path]:
        name = src.name
        if name not in self.where and name.startswith("transformer."):
            name = name[len("transformer.") :]  # original GPT-2 checkpoints
        if name not in self.where:
            raise ModelLoadError(
                f"Tensor {src.name!r} is missing from the weights in {str(self.path)!r}."
            )
        handle, file = self.where[name]
        return name, handle, file

    def _check_shape(
        self, src: WeightSource, shape: tuple[int, ...], want: tuple[int, ...]
    ) -> None:
        if shape != want:
            raise ModelLoadError(
                f"Tensor {src.name!r} has shape {shape}, expected {want} "
                f"from config.json in {str(self.path)!r}."
            )

    def _direct(self, name: str) -> tuple[TensorEntry, Path, torch.dtype] | None:
        """The entry, file and torch dtype of ``name`` when ``read_into`` can read it."""
        entry, file = self.entries[name]
        dtype = _TORCH_DTYPES.get(entry.dtype)
        if dtype is None or sys.byteorder != "little":
            return None
        return entry, file, dtype

    def _read(self, file: Path, offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous ``out`` with the bytes of ``file`` from ``offset`` on (of
        its data)."""
        raw, data_start = self._open[file]
        view = out.view(torch.uint8).view(-1).numpy().data
        raw.seek(data_start + offset)
        done = 0
        while done < len(view):
            n = raw.readinto(view[done:])
            if not n:
                raise ModelLoadError(f"Weight file {file} ended early (is it truncated?).")
            done += n

    def read_into(self, src: WeightSource, out: torch.Tensor) -> bool:
        """Read ``src`` straight into ``out`` (contiguous, its shape checked) when the
        file holds it in ``out``'s dtype and layout; False (nothing read) otherwise."""
        name, _, _ = self._locate(src)
        direct = self._direct(name)
        if direct is None or src.transpose or not out.is_contiguous():
            return False
        entry, file, dtype = direct
        if dtype != out.dtype:
            return False
        self._check_shape(src, entry.shape, tuple(out.shape))
        if out.numel():
            self._read(file, entry.begin, out)
        return True

    def tensor(self, src: WeightSource, want: tuple[int, ...]) -> torch.Tensor:
        """The tensor of ``src`` (transposed where it says so), checked to be ``want``."""
        name, handle, file = self._locate(src)
        direct = self._direct(name)
        if direct is not None:
            entry, _, dtype = direct
            shape = entry.shape[::-1] if src.transpose and len(entry.shape) == 2 else entry.shape
            self._check_shape(src, shape, want)
            t = torch.empty(entry.shape, dtype=dtype)
            if t.numel():
                self._read(file, entry.begin, t)
            return t.t() if src.transpose and t.dim() == 2 else t
        try:
            t = handle.get_tensor(name)
        except Exception as exc:  # e.g. a safetensors dtype torch has no type for
            raise ModelLoadError(
                f"Cannot read tensor {src.name!r} from weight file {file}: {exc}"
            ) from exc
        if src.transpose and t.dim() == 2:
            t = t.t()
        self._check_shape(src, tuple(t.shape), want)
        return t

    def mapped(self, src: WeightSource, like: torch.Tensor) -> torch.Tensor | None:
        """The tensor of ``src`` as a view of its file, mapped copy-on-write (pages are
        read when first touched; a write stays in this process), when it can stand for
        ``like`` as it is: the whole tensor, same shape and dtype, not transposed, on a
        little-endian host. None otherwise (then it is copied)."""
        name, _, _ = self._locate(src)
        entry, file = self.entries[name]
        if (
            src.transpose
            or src.offset != 0
            or sys.byteorder != "little"
            or _TORCH_DTYPES.get(entry.dtype) != like.dtype
            or entry.shape != tuple(like.shape)
            or entry.end == entry.begin
        ):
            return None
        mapping = self._mappings.get(file)
        if mapping is None:
            with open_regular(file) as f:
                (length,) = struct.unpack("<Q", f.read(8))
                mapping = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), 8 + length)
            self._mappings[file] = mapping
        buf, data_start = mapping
        count = (entry.end - entry.begin) // like.element_size()
        t = torch.frombuffer(buf, dtype=like.dtype, count=count, offset=data_start + entry.begin)
        return t.view(like.shape)

    def release_pages(self) -> None:
        """Drop this process's pages of the mapped views (``mapped``) that the load
        touched (a tied head quantized from the embedding reads all of it); they are
        read again from the file when used. Only while nothing has written to them: a
        dropped page written copy-on-write would lose the write (the load writes none)."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        for buf, _ in self._mappings.values():
            if advice is not None:
                buf.madvise(advice)

    def row_slices(
        self, src: WeightSource, want: tuple[int, ...], rows: int
    ) -> Iterator[torch.Tensor]:
        """The tensor of ``src`` (checked to be ``want``), ``rows`` rows at a time, each
        slice read from the mapped file when it is asked for."""
        if src.transpose:  # GPT-2's Conv1D weights: rows are the file's columns
            yield self.tensor(src, want)
            return
        name, handle, file = self._locate(src)
        direct = self._direct(name)
        if direct is not None:
            entry, _, dtype = direct
            self._check_shape(src, entry.shape, want)
            row_bytes = (entry.end - entry.begin) // max(1, want[0])
            for start in range(0, want[0], rows):
                part = torch.empty((min(want[0], start + rows) - start, *want[1:]), dtype=dtype)
                if part.numel():
                    self._read(file, entry.begin + start * row_bytes, part)
                yield part
            return
        try:
            sl = handle.get_slice(name)
            shape = tuple(sl.get_shape())
        except Exception as exc:
            raise ModelLoadError(
                f"Cannot read tensor {src.name!r} from weight file {file}: {exc}"
            ) from exc
        self._check_shape(src, shape, want)
        for start in range(0, want[0], rows):
            try:
                yield sl[start : min(want[0], start + rows)]
            except Exception as exc:
                raise ModelLoadError(
                    f"Cannot read tensor {src.name!r} from weight file {file}: {exc}"
                ) from exc


def _fill(
    ckpt: _Checkpoint, param: torch.Tensor, sources: list[WeightSource], map_ok: bool
) -> None:
    """Fill ``param`` from the checkpoint: with ``map_ok``, as a view of the mapped file
    where ``_Checkpoint.mapped`` allows; else its rows copied, converted to its dtype."""
    if map_ok and len(sources) == 1:
        view = ckpt.mapped(sources[0], param)
        if view is not None:
            param.data = view
            return
    for src in sources:
        if ckpt.read_into(src, param.data[src.offset : src.offset + src.rows]):
            continue  # read in place: no copy beside it
        t = ckpt.tensor(src, (src.rows, *param.shape[1:]))
        try:
            with torch.no_grad():
                param.data[src.offset : src.offset + src.rows].copy_(t)
        except (RuntimeError, TypeError) as exc:  # a dtype torch cannot convert
            _, _, file = ckpt._locate(src)
            raise ModelLoadError(
                f"Cannot read tensor {src.name!r} ({t.dtype}) from weight file {file}: {exc}"
            ) from exc
        del t  # one tensor of the file at a time


def load_weights(
    model: nn.Module,
    weight_map: WeightMap,
    path: Path,
    dtype: torch.dtype,
    quantization: str | None = None,
    progress: bool | None = None,
    pack_cache: Callable[[], bool] | None = None,
) -> tuple[int, PackedCache | None]:
    """Fill every parameter of ``model`` from the checkpoint, checking names and shapes.

    With ``quantization``, every ``nn.Linear`` becomes a ``QuantLinear`` (ops/quant.py)
    quantized tensor by tensor, a slice of rows at a time (``quant_rows``), from the
    mapped file (its
    full-precision weight is never filled), or read from the load cache when an entry
    for this checkpoint and options exists (model/load_cache.py). ``progress`` None:
    the bar shows where someone watches (model/progress.py).

    ``pack_cache`` (bfloat16, no quantization; the caller packs for the native kernels):
    the layers ``pack_linears`` would pack are taken from the load cache's packed entry
    when there is one (model/packed_cache.py); ``pack_cache()`` says whether they carry a
    oneDNN twin, made from their weights (then read, or mapped where the layout allows),
    else their weights are not read at all. Returns how many layers it took from the
    entry, and on a miss the entry to store after packing (None without ``pack_cache`` or
    with the cache off).
    """
    files = _weight_files(path)
    targets = _quant_targets(model) if quantization is not None else []
    params = dict(model.named_parameters())
    from_file = {f"{name}.weight" for name, _ in targets} & set(weight_map)
    packing: PackedCache | None = None
    packed: dict[str, torch.Tensor] | None = None
    twin = False
    if pack_cache is not None and quantization is None and dtype == torch.bfloat16:
        packing = PackedCache(model, path, files)
        packed = packing.restore()
        twin = packed is not None and pack_cache()
        if packed is not None and not twin:  # a hit: those layers' weights are never read
            from_file = {f"{name}.weight" for name in packed} & set(weight_map)
    # A twin is made from the weight: read it from the mapped file where it can be.
    mappable = _mappable(model) | (
        {f"{name}.weight" for name in packed} if packed is not None and twin else set()
    )
    with ExitStack() as stack:
        ckpt = _Checkpoint(files, path, stack)
        bar = stack.enter_context(
            LoadProgress(
                len(weight_map) + len(targets) - len(from_file),
                "Loading weights",
                progress_enabled(sum(f.stat().st_size for f in files))
                if progress is None
                else progress,
            )
        )
        for ours, sources in weight_map.items():
            if ours in from_file:
                continue  # quantized straight from the file below
            _fill(ckpt, params[ours], sources, ours in mappable)
            bar.update()
        missing = set(params) - set(weight_map)
        assert not missing, f"parameters without a source: {sorted(missing)}"
        if quantization is not None:
            _quantize(model, targets, weight_map, ckpt, quantization, dtype, bar)
        taken = 0
        if packing is not None and packed is not None:
            taken = packing.install(model, packed, twin)  # frees the mapped weights
        ckpt.release_pages()  # nothing has written to the mapped views yet
    if packing is None or packed is not None or not packing.enabled:
        return taken, None
    return 0, packing  # a miss: the caller stores the entry once it has packed


def _mappable(model: nn.Module) -> set[str]:
    """The parameters read as views of the mapped file where dtype and layout allow: the
    embedding tables. Only the rows a prompt looks up are then read from the file (a
    128k-vocabulary table is a fifth of a 1B model), and nothing writes to them (a
    packed or quantized tied head makes its own copy: ops/linear.py, ops/quant.py)."""
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Embedding)}


def _quant_targets(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """Every ``nn.Linear`` of ``model`` with its module path (what ``quantize_linears``
    replaces)."""
    return [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]


def _quantize(
    model: nn.Module,
    targets: list[tuple[str, nn.Linear]],
    weight_map: WeightMap,
    ckpt: _Checkpoint,
    mode: str,
    dtype: torch.dtype,
    bar: LoadProgress,
) -> None:
    """Replace each target by its ``QuantLinear``: from the load cache, else quantized
    from the file (or, for a tied head, from the embedding it shares) and then cached."""
    from nbengine.model.load_cache import LoadCache, cache_root
    from nbengine.ops.quant import QuantLinear, quant_rows, quantize_weight, quantized_shapes

    cache = LoadCache(
        cache_root(), ckpt.path, ckpt.files, {"quantization": mode, "dtype": str(dtype)}
    )
    shapes = {
        name: quantized_shapes(lin.out_features, lin.in_features, mode) for name, lin in targets
    }
    cached = cache.restore(shapes)
    made: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    bar.set_description("Reading quantized weights" if cached else f"Quantizing to {mode}")
    for name, lin in targets:
        if cached is not None:
            q_s = cached.pop(name)
        else:
            sources = weight_map.get(f"{name}.weight")
            if sources is None:  # a tied head: the embedding, already loaded
                rows: Iterable[torch.Tensor] = (lin.weight.detach(),)
            else:
                rows = (
                    part.to(dtype)  # rounded as the loaded weight would be
                    for src in sources
                    for part in ckpt.row_slices(
                        src, (src.rows, lin.in_features), quant_rows(lin.in_features)
                    )
                )
            try:
                q_s = quantize_weight(rows, lin.out_features, lin.in_features, mode)
            except (RuntimeError, TypeError) as exc:  # a dtype torch cannot convert
                raise ModelLoadError(f"Cannot quantize {name!r} from {ckpt.path}: {exc}") from exc
            made[name] = q_s
        parent_name, _, local = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, local, QuantLinear(lin, mode, q_s))
        bar.update()
    logger.info("Quantized %d linear layers to %s.", len(targets), mode)
    if made:
        cache.store(made, background=True)


def load_model(
    config: ModelConfig,
    before_weights: Callable[..., None] | None = None,
    pack_cache: Callable[[], bool] | None = None,
) -> LoadedModel:
    """Load the model named by ``config`` (directory, dtype, max_model_len).

    ``pack_cache``: the caller packs the bfloat16 linear layers for the native kernels
    (``pack_linears``; ``pack_cache()``, called after ``before_weights``, says whether
    with oneDNN twins); they come packed from the load cache where an entry exists
    (``LoadedModel.packed_from_cache``), else ``LoadedModel.pack_cache`` is the entry to
    store once they are packed (``load_weights``).

    ``before_weights(weight_files, hf_config, architecture, dtype, max_model_len)`` runs
    once the shape is known and before any weight is allocated (the memory plan's hook,
    model/memory_plan.py); it may raise to stop the load.
    """
    path = resolve_model_dir(config.model, config.revision)
    cfg = read_hf_config(path)
    arch = architecture_of(cfg, path)
    check_hf_config(cfg, path)
    tokenizer = Tokenizer.from_dir(path)  # validates tokenizer.json early
    dtype = resolve_dtype(config.dtype, cfg, config.device)
    max_len = _max_model_len(cfg, arch, config.max_model_len)
    if before_weights is not None:
        before_weights(_weight_files(path), cfg, arch, dtype, max_len)
    model = build_model(cfg, arch, max_len, path)
    model.tie_weights()
    _retype(model, dtype)
    # With quantization, weight-only quantization of every linear layer, tensor by tensor
    # from the mapped file (ops/quant.py; docs/quantization.md).
    from_cache, to_store = load_weights(
        model, model.hf_weight_map(), path, dtype, config.quantization, pack_cache=pack_cache
    )
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            # model.to(dtype) cast the rope tables too; they stay float32 for exactness.
            module.reset_tables()
    if config.device != "cpu":
        model.to(config.device)  # weights and RoPE tables; dtypes are kept
    model.eval()
    vocab = int(model.lm_head.out_features)
    return LoadedModel(
        model=model,
        hf_config=cfg,
        dtype=dtype,
        max_model_len=max_len,
        vocab_size=vocab,
        eos_token_ids=tokenizer.eos_token_ids,
        architecture=arch,
        path=path,
        tokenizer=tokenizer,
        kv_sliding_window=kv_window(model.layer_windows),
        packed_from_cache=from_cache,
        pack_cache=to_store,
    )
