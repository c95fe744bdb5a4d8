"""``resolve_engine``: ``Engine(...)``'s keyword arguments to a finished ``EngineSetup``.

As vLLM's ``EngineArgs`` becomes a ``VllmConfig``: the flat keywords are validated into an
``EngineConfig`` (the backend and its options in ``config.parallel``), the model directory
and tokenizer are found, and ``dtype="auto"`` is resolved against the checkpoint, so the
config that reaches the core (and every Ray replica) names the real dtype. Nothing here
starts a thread or loads weights; ``make_core_client`` then builds the backend the config
names (docs/architecture.md, "Backends").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbengine.config import EngineConfig
from nbengine.core.client import CoreClient, InprocCoreClient
from nbengine.frontend.input_processor import InputProcessor
from nbengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nbengine.core.engine_core import RunnerLike

__all__ = ["EngineSetup", "make_core_client", "make_input_processor", "resolve_engine"]


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """What an ``Engine`` is built from: the resolved config and the model's files."""

    config: EngineConfig
    # None only when a test injects a tokenizer and runs the default model.
    model_dir: Path | None
    tokenizer: Any
    default_params: SamplingParams


def resolve_engine(
    model: str | Path | None, kwargs: dict[str, Any], tokenizer: Any = None
) -> EngineSetup:
    """Validate ``kwargs`` (``EngineConfig`` fields, ``backend`` and the Ray options) and
    resolve the model directory, its tokenizer (unless ``tokenizer`` is given) and
    ``dtype="auto"``. Raises TypeError/ValueError naming a bad argument before any file
    is read."""
    from nbengine.model.generation_defaults import default_sampling_params
    from nbengine.model.loader import auto_dtype, read_hf_config, resolve_model_dir

    config = EngineConfig.from_kwargs(model, **kwargs)
    model_dir: Path | None = None
    if tokenizer is None or model is not None:
        model_dir = resolve_model_dir(model, config.model.revision)
    if tokenizer is None:
        from nbengine.model.tokenizer import Tokenizer

        assert model_dir is not None
        tokenizer = Tokenizer.from_dir(model_dir)
    if config.model.dtype == "auto" and model_dir is not None:
        dtype = auto_dtype(read_hf_config(model_dir), config.model.device)
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype))
    return EngineSetup(config, model_dir, tokenizer, default_sampling_params(model_dir))


def make_core_client(config: EngineConfig, runner: RunnerLike | None = None) -> CoreClient:
    """The client of the backend ``config.parallel`` names; ``runner`` (a test hook)
    replaces the in-process core's model runner."""
    parallel = config.parallel
    if parallel.backend == "ray":
        if runner is not None:
            raise ValueError(
                "backend='ray' builds its runners in the replicas; _runner is inproc only."
            )
        from nbengine.distributed.ray_client import RayCoreClient

        return RayCoreClient(config, **parallel.ray_options())  # type: ignore[arg-type]
    from nbengine.model.runner import ModelRunner  # the core takes its runner from here

    return InprocCoreClient(config, ModelRunner if runner is None else runner)


def make_input_processor(setup: EngineSetup, client: CoreClient) -> InputProcessor:
    """The caller-thread validator of ``setup``'s engine, with the limits ``client``'s
    core reports; a request ends at the model's EOS ids and the tokenizer's."""
    config = setup.config
    eos = frozenset(client.eos_token_ids) | frozenset(getattr(setup.tokenizer, "eos_token_ids", ()))
    return InputProcessor(
        setup.tokenizer,
        int(client.vocab_size),
        int(client.max_model_len),
        setup.default_params,
        eos,
        config.model.max_logprobs,
        kv_pool=client.kv_pool,
        max_prefill_tokens=None
        if config.scheduler.enable_chunked_prefill
        else config.scheduler.max_num_batched_tokens,
    )
