"""Engine configuration: small dataclasses, each validated in ``__post_init__``."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nbengine.sampling_params import SEED_MAX, SEED_MIN
from nbengine.validation import is_int, is_number

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_QUANTIZATION = ("int8", "int4", "int4-g32")  # ops/quant.py, docs/quantization.md
_POLICIES = ("fcfs", "priority")
MAX_KV_CACHE_GB = 10**9
"""The largest ``kv_cache_memory_gb`` (an exabyte, far beyond any machine): a bound, since
a finite value such as 1e300 would overflow the float the memory plan sizes the pool in
(model/memory_plan.py)."""


def resolve_device(device: object) -> str:
    """``ModelConfig.device`` resolved to a ``torch.device``-compatible string.

    "auto" is "cuda" when torch sees a CUDA GPU, else "cpu"; "cpu", "cuda" and "cuda:N"
    are kept (checked against the GPUs torch sees). Anything else raises a TypeError or
    ValueError naming ``device``; nothing is allocated on the device here.
    """
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise TypeError(f"device must be a string (auto, cpu, cuda, cuda:N), got {device!r}.")
    value = device.strip().lower()
    if value == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if value == "cpu":
        return "cpu"
    kind, _, index = value.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"device must be one of auto, cpu, cuda, cuda:N; got {device!r}.")
    if not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA support"
            if torch.version.cuda is None
            else "torch sees no CUDA GPU"
        )
        raise ValueError(
            f"device={device!r} asks for a CUDA GPU, but {why} (torch.cuda.is_available() "
            'is False). Use device="cpu" or "auto".'
        )
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(
            f"device={device!r}: torch sees {torch.cuda.device_count()} CUDA GPU(s) "
            f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})."
        )
    return value


def _check_types(
    obj: object, ints: tuple[str, ...], bools: tuple[str, ...] = (), numbers: tuple[str, ...] = ()
) -> None:
    """TypeError naming the field for a wrong type (None allowed where the default is None)."""
    for name in ints:
        value = getattr(obj, name)
        if value is not None and not is_int(value):
            raise TypeError(f"{name} must be an int, got {value!r}.")
    for name in bools:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}.")
    for name in numbers:
        value = getattr(obj, name)
        if not is_number(value):
            raise TypeError(f"{name} must be a number, got {value!r}.")
        # Before any range check: nan compares False with everything, and inf overflows
        # the int() that sizes memory later. (An int is always finite.)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}.")


LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
"""What ``logprobs`` report (vLLM's ``logprobs_mode``): the model's log-softmax or logits
("raw_"), or those after the request's logits processing ("processed_": structured-output
mask, allowed_token_ids, bad_words, logits processors, min_tokens, logit_bias, penalties
and temperature; docs/api.md)."""


@dataclass(slots=True)
class ModelConfig:
    """Which model to load and how.

    ``model`` is a Hugging Face-format directory or a Hugging Face Hub model id
    ("org/name"); None means the shipped default model. ``revision`` (a branch, tag or
    commit of a Hub model; None: "main") is ignored for directories.
    ``max_model_len`` None means the model's own ``max_position_embeddings``.
    ``seed`` seeds the sampler for requests without their own ``SamplingParams.seed``;
    None (the default, as in vLLM) draws a fresh random seed for each engine, so two runs
    of a notebook sample different text. The seed drawn is kept here: pass it back as
    ``seed=`` to repeat a run.
    ``quantization`` ("int8", "int4", "int4-g32"; None: off) quantizes the weights of every
    linear layer when the model loads (weight-only; docs/quantization.md).
    ``device`` (vLLM's name): "auto" (a CUDA GPU when torch sees one, else the CPU),
    "cpu", "cuda" or "cuda:N"; resolved here by ``resolve_device``, so the config always
    names the device the engine runs on (docs/architecture.md, "Devices").
    """

    model: str | Path | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int | None = None
    revision: str | None = None
    # vLLM's names: the most logprobs a request may ask for (-1: no bound; a request's
    # logprobs=-1 means the whole vocabulary), and what the returned logprobs are.
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    quantization: str | None = None
    device: str = "auto"

    def __post_init__(self) -> None:
        _check_types(self, ints=("max_model_len", "max_logprobs"))
        self.device = resolve_device(self.device)
        if self.max_logprobs < -1:
            raise ValueError(
                f"max_logprobs must be -1 (no bound) or at least 0, got {self.max_logprobs}."
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}."
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        if self.seed is None:
            self.seed = secrets.randbits(63)
        if not is_int(self.seed):
            raise TypeError(f"seed must be an int, got {self.seed!r}.")
        if not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed}.")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision):
            raise TypeError(f"revision must be a non-empty string or None, got {self.revision!r}.")
        if self.quantization is not None and not isinstance(self.quantization, str):
            raise TypeError(f"quantization must be a string or None, got {self.quantization!r}.")
        if self.quantization is not None and self.quantization not in _QUANTIZATION:
            raise ValueError(
                f"quantization must be one of {_QUANTIZATION} or None, got {self.quantization!r}."
            )
        if self.quantization is not None and self.device != "cpu":
            raise ValueError(
                f"quantization={self.quantization!r} runs on the CPU only (its kernels are "
                f"CPU kernels), not on device={self.device!r}."
            )


@dataclass(slots=True)
class CacheConfig:
    """The paged KV cache.

    ``num_kv_blocks`` None sizes the pool from ``kv_cache_memory_gb``; with that None too,
    the pool takes the memory that is free after the weights (model/memory_plan.py).
    On a CUDA device the pool is sized instead by ``gpu_memory_utilization`` (vLLM's name
    and meaning: the fraction of the GPU's total memory this engine may use for weights,
    activations and KV cache; the KV cache takes what is left), unless ``num_kv_blocks``
    is set; ``kv_cache_memory_gb`` applies to the CPU only.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_memory_gb: float | None = 1.0
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        _check_types(
            self,
            ints=("block_size", "num_kv_blocks"),
            bools=("enable_prefix_caching",),
            numbers=("gpu_memory_utilization",)
            + (("kv_cache_memory_gb",) if self.kv_cache_memory_gb is not None else ()),
        )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                "gpu_memory_utilization must be in (0, 1] (a fraction of the GPU's memory), "
                f"got {self.gpu_memory_utilization}."
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}.")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}.")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb > MAX_KV_CACHE_GB:
            raise ValueError(
                f"kv_cache_memory_gb must be at most {MAX_KV_CACHE_GB} (GB, an exabyte), "
                f"got {self.kv_cache_memory_gb}."
            )


@dataclass(slots=True)
class SchedulerConfig:
    """Continuous batching limits.

    ``max_num_batched_tokens`` is the per-step token budget shared by prefill chunks
    and decodes; ``max_num_seqs`` caps the number of running requests.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    stream_interval: int = 1

    def __post_init__(self) -> None:
        _check_types(
            self,
            ints=("max_num_seqs", "max_num_batched_tokens", "stream_interval"),
            bools=("enable_chunked_prefill",),
        )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}."
            )
        if self.policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {self.policy!r}.")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}.")


SPEC_METHODS = ("ngram", "draft_model")
"""Speculative decoding methods (docs/speculative-decoding.md)."""
_SPEC_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "dtype",
)


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` (docs/speculative-decoding.md); off by default.

    ``method`` None: no speculation. "ngram": prompt lookup proposes up to
    ``num_speculative_tokens`` tokens per step from the longest suffix n-gram (of
    ``prompt_lookup_min`` .. ``prompt_lookup_max`` tokens) that occurred earlier in the
    request's prompt and output. "draft_model": the small model ``model`` (a directory
    or Hub id, of the target's vocabulary) proposes ``num_speculative_tokens`` greedy
    tokens per step; ``dtype`` None: the target's.
    """

    method: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    model: str | None = None
    dtype: str | None = None

    @classmethod
    def from_dict(cls, value: object) -> SpeculativeConfig:
        """Check ``Engine(speculative_config=...)``: None (off) or a dict of vLLM's keys.

        Raises TypeError / ValueError naming ``speculative_config`` and the key.
        """
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise TypeError(
                f"speculative_config must be a dict or None, got {type(value).__name__}."
            )
        unknown = sorted(str(k) for k in value if k not in _SPEC_KEYS)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"the keys are {', '.join(_SPEC_KEYS)}."
            )
        method = value.get("method")
        if method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config['method'] must be one of {SPEC_METHODS}, got {method!r}."
            )
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config['num_speculative_tokens'] is required.")
        k = value["num_speculative_tokens"]
        lmax = value.get("prompt_lookup_max", 3)
        lmin = value.get("prompt_lookup_min", 1)
        for key, v in (
            ("num_speculative_tokens", k),
            ("prompt_lookup_max", lmax),
            ("prompt_lookup_min", lmin),
        ):
            if not is_int(v):
                raise TypeError(f"speculative_config[{key!r}] must be an int, got {v!r}.")
            if v < 1:
                raise ValueError(f"speculative_config[{key!r}] must be at least 1, got {v}.")
        if lmin > lmax:
            raise ValueError(
                f"speculative_config['prompt_lookup_min'] ({lmin}) must not exceed "
                f"'prompt_lookup_max' ({lmax})."
            )
        model = value.get("model")
        dtype = value.get("dtype")
        if method == "draft_model":
            if not isinstance(model, (str, Path)) or not str(model):
                raise ValueError(
                    "speculative_config['model'] (a directory or Hub id of the draft model) "
                    f"is required with method 'draft_model', got {model!r}."
                )
            model = str(model)
        elif model is not None or dtype is not None:
            raise ValueError(
                "speculative_config['model'] and ['dtype'] apply only to method 'draft_model'."
            )
        if dtype is not None and not isinstance(dtype, str):
            raise TypeError(f"speculative_config['dtype'] must be a str or None, got {dtype!r}.")
        return cls(method, k, lmax, lmin, model, dtype)

    @property
    def enabled(self) -> bool:
        return self.method is not None


BACKENDS = ("inproc", "ray")
"""Where the engine cores run: a thread of this process, or Ray actors (docs/scale-out.md)."""
_RAY_OPTIONS = ("data_parallel_size", "ray_address", "resources_per_replica", "routing")


@dataclass(slots=True)
class ParallelConfig:
    """Which backend runs the engine cores (vLLM's ``distributed_executor_backend``).

    ``backend`` is "inproc" (one core on a thread of this process) or "ray"
    (``data_parallel_size`` cores as Ray actors; ``ray_address``,
    ``resources_per_replica`` and ``routing`` as in docs/scale-out.md). The Ray options are
    None unless given (the Ray client checks their values and applies its defaults); they
    apply only to ``backend="ray"``.
    """

    backend: str = "inproc"
    data_parallel_size: int | None = None
    ray_address: str | None = None
    resources_per_replica: dict[str, object] | None = None
    routing: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}.")
        given = sorted(self.ray_options())
        if self.backend == "inproc" and given:
            raise TypeError(
                f"{', '.join(given)} only apply to backend='ray' (got backend='inproc')."
            )

    def ray_options(self) -> dict[str, object]:
        """The Ray options that were given, as keyword arguments of the Ray client."""
        values = {name: getattr(self, name) for name in _RAY_OPTIONS}
        return {name: value for name, value in values.items() if value is not None}


@dataclass(slots=True)
class LoRAConfig:
    """LoRA adapters per request (vLLM's names; docs/lora.md).

    ``enable_lora`` allows ``lora_request=`` on requests; at most ``max_loras`` distinct
    adapters run in one step (requests of others wait); an adapter's rank may be at most
    ``max_lora_rank``.
    """

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        _check_types(self, ints=("max_loras", "max_lora_rank"), bools=("enable_lora",))
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}.")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}.")


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine needs; built from ``Engine(...)``/``LLM(...)`` keyword arguments."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.lora.enable_lora and self.parallel.backend != "inproc":
            raise ValueError(
                f"enable_lora=True needs backend='inproc' (got backend={self.parallel.backend!r})."
            )

    @classmethod
    def from_kwargs(cls, model: str | Path | None = None, **kwargs: object) -> EngineConfig:
        """Split flat keyword arguments (as ``nb.Engine`` takes them) into the parts.

        Unknown keywords raise ``TypeError`` naming them.
        """
        speculative = SpeculativeConfig.from_dict(kwargs.pop("speculative_config", None))
        parts: dict[str, dict[str, object]] = {
            "model": {},
            "cache": {},
            "scheduler": {},
            "parallel": {},
            "lora": {},
        }
        owners = {
            "model": ModelConfig.__dataclass_fields__,
            "cache": CacheConfig.__dataclass_fields__,
            "scheduler": SchedulerConfig.__dataclass_fields__,
            "parallel": ParallelConfig.__dataclass_fields__,
            "lora": LoRAConfig.__dataclass_fields__,
        }
        for key, value in kwargs.items():
            for part, fields_ in owners.items():
                if key in fields_ and key != "model":
                    parts[part][key] = value
                    break
            else:
                raise TypeError(f"Unknown engine argument {key!r}.")
        return cls(
            model=ModelConfig(model=model, **parts["model"]),  # type: ignore[arg-type]
            cache=CacheConfig(**parts["cache"]),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(**parts["scheduler"]),  # type: ignore[arg-type]
            parallel=ParallelConfig(**parts["parallel"]),  # type: ignore[arg-type]
            speculative=speculative,
            lora=LoRAConfig(**parts["lora"]),  # type: ignore[arg-type]
        )
