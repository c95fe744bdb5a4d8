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
from collections.abc import Callable
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
from nbengine.model.files import is_regular_file, read_json
from nbengine.model.gemma import GEMMA_ACTIVATIONS, GEMMA_ARCHITECTURES, GemmaArgs, GemmaForCausalLM
from nbengine.model.gpt2 import GPT2Args, GPT2LMHeadModel
from nbengine.model.llama import DecoderArgs, LlamaForCausalLM
from nbengine.model.tokenizer import Tokenizer
from nbengine.model.weights import WeightMap, read_safetensors_header
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


def load_weights(model: nn.Module, weight_map: WeightMap, path: Path, dtype: torch.dtype) -> None:
    """Fill every parameter of ``model`` from the checkpoint, checking names and shapes.

    Each file's header is checked whole (``read_safetensors_header``) before safetensors
    opens it; a tensor torch cannot read is a ``ModelLoadError`` naming file and tensor.
    """
    files = _weight_files(path)
    with ExitStack() as stack:
        where: dict[str, tuple[Any, Path]] = {}
        for f in files:
            read_safetensors_header(f)
            try:
                handle = stack.enter_context(safe_open(str(f), framework="pt"))
            except Exception as exc:  # safetensors raises its own error types
                raise ModelLoadError(f"Cannot open weight file {f}: {exc}") from exc
            for name in handle.keys():
                where[name] = (handle, f)
        params = dict(model.named_parameters())
        for ours, sources in weight_map.items():
            param = params[ours]
            for src in sources:
                name = src.name
                if name not in where and name.startswith("transformer."):
                    name = name[len("transformer.") :]  # original GPT-2 checkpoints
                if name not in where:
                    raise ModelLoadError(
                        f"Tensor {src.name!r} is missing from the weights in {str(path)!r}."
                    )
                handle, file = where[name]
                try:
                    t = handle.get_tensor(name)
                except Exception as exc:  # e.g. a safetensors dtype torch has no type for
                    raise ModelLoadError(
                        f"Cannot read tensor {src.name!r} from weight file {file}: {exc}"
                    ) from exc
                want = (src.rows, *param.shape[1:])
                if src.transpose and t.dim() == 2:
                    t = t.t()
                if tuple(t.shape) != want:
                    raise ModelLoadError(
                        f"Tensor {src.name!r} has shape {tuple(t.shape)}, expected {want} "
                        f"from config.json in {str(path)!r}."
                    )
                try:
                    with torch.no_grad():
                        param.data[src.offset : src.offset + src.rows].copy_(t)
                except (RuntimeError, TypeError) as exc:  # a dtype torch cannot convert
                    raise ModelLoadError(
                        f"Cannot read tensor {src.name!r} ({t.dtype}) from weight file "
                        f"{file}: {exc}"
                    ) from exc
        missing = set(params) - set(weight_map)
        assert not missing, f"parameters without a source: {sorted(missing)}"


def load_model(
    config: ModelConfig, before_weights: Callable[..., None] | None = None
) -> LoadedModel:
    """Load the model named by ``config`` (directory, dtype, max_model_len).

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
    model.to(dtype)
    load_weights(model, model.hf_weight_map(), path, dtype)
    if config.quantization is not None:
        # Weight-only quantization of every linear layer, from the weights just read
        # (ops/quant.py; docs/quantization.md).
        from nbengine.ops.quant import quantize_linears

        quantize_linears(model, config.quantization)
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
    )
