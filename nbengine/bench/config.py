"""``BenchConfig``: everything that decides what ``nbengine bench`` runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbengine.bench.workloads import DEFAULT_SHAPE, KNOWN_WORKLOADS, SHAPES

__all__ = [
    "ALL_ENGINES",
    "BenchConfig",
    "DEFAULT_ENGINES",
    "ENGINE_PACKAGES",
    "ENGINE_WAIT_POLICY",
    "PEER_ENGINES",
    "peer_engines",
]

# ct2: CTranslate2, an optional peer (pip install ctranslate2), not run by default;
# llamacpp: llama.cpp through llama-cpp-python (built from source by the bench extra).
ALL_ENGINES = ("nbengine", "hf_static", "hf_cb", "ct2", "llamacpp")
DEFAULT_ENGINES = ("nbengine", "hf_static", "hf_cb")
# `nbengine bench --peers`: nbengine and every peer (those whose package is installed).
PEER_ENGINES = ALL_ENGINES
# The OMP_WAIT_POLICY each engine's processes get unless one policy is asked for all:
# its faster one, as measured on this machine (docs/benchmarks.md, "Each engine's wait
# policy"). CTranslate2's OpenMP workers sleeping between its ops cost it 1.3-3.6x;
# nbengine is faster with PASSIVE (its threads need the cores spinning workers would hold);
# llama.cpp measured the same under both; the transformers baselines get what a notebook
# with nbengine gets (PASSIVE: under load, spinning workers slowed hf_cb over tenfold).
ENGINE_WAIT_POLICY = {
    "nbengine": "PASSIVE",
    "hf_static": "PASSIVE",
    "hf_cb": "PASSIVE",
    "ct2": "ACTIVE",
    "llamacpp": "PASSIVE",
}
WAIT_POLICIES = ("PASSIVE", "ACTIVE")
# The Python package (importable name) each optional engine needs; `nbengine bench`
# checks them before it starts (cli.py).
ENGINE_PACKAGES = {
    "hf_static": "transformers",
    "hf_cb": "transformers",
    "ct2": "ctranslate2",
    "llamacpp": "llama_cpp",
}


def peer_engines() -> tuple[tuple[str, ...], dict[str, str]]:
    """The engines of ``--peers`` installed here, and the skipped ones with the reason."""
    import importlib.util

    run: list[str] = []
    skipped: dict[str, str] = {}
    for e in PEER_ENGINES:
        pkg = ENGINE_PACKAGES.get(e)
        if pkg is not None and importlib.util.find_spec(pkg) is None:
            skipped[e] = f"{pkg} is not installed (pip install -e '.[bench]')"
        else:
            run.append(e)
    return tuple(run), skipped


@dataclass(slots=True)
class BenchConfig:
    """What ``run_bench`` runs, and how.

    ``model_dir`` None builds a random model in ``shape``'s dimensions (``SHAPES`` in
    bench/workloads.py; SmolLM2-135M's by default) into ``cache_dir`` (default
    ``$NBENGINE_CACHE/bench``). ``engine_kwargs`` are extra ``nb.Engine``
    arguments on top of the bench's (64 sequences, 512 batched tokens). ``threads`` is
    the torch thread count of every engine alike (None: the physical cores).
    ``omp_wait_policy`` is the ``OMP_WAIT_POLICY`` of every engine's process, or None for
    each engine's own faster one (``ENGINE_WAIT_POLICY``; ``wait_policy(engine)`` says
    which an engine gets).
    ``quantization`` runs nbengine with quantized weights (``nb.Engine(quantization=)``;
    the transformers engines stay in ``dtype``) and counts the quantized weight bytes in
    the bandwidth bound. ``scale`` shrinks every workload (0.1 for a smoke run). A figure
    whose repeats disagree by more than ``max_spread`` ((max - min) / median) is reported
    with a warning.
    """

    model_dir: str | Path | None = None
    shape: str = DEFAULT_SHAPE
    workloads: tuple[str, ...] = ("W1", "W2", "W3")  # W4 on request (ALL_WORKLOADS)
    engines: tuple[str, ...] = DEFAULT_ENGINES
    dtype: str = "bfloat16"
    quantization: str | None = None
    scale: float = 1.0
    repeats: int = 1
    seed: int = 0
    abort_latency: bool = True
    static_batch_size: int = 16
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    cache_dir: str | Path | None = None
    threads: int | None = None
    omp_wait_policy: str | None = None
    max_spread: float = 0.10
    # W1 again on nbengine with its requests spread over this many LoRA adapters of rank
    # 16 (label "nbengine_lora"; docs/lora.md); 0: not run.
    lora_adapters: int = 0

    def __post_init__(self) -> None:
        self.workloads = tuple(self.workloads)
        self.engines = tuple(self.engines)
        self.engine_kwargs = dict(self.engine_kwargs or {})
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {tuple(SHAPES)}, got {self.shape!r}.")
        for w in self.workloads:
            if w not in KNOWN_WORKLOADS:
                raise ValueError(f"Unknown workload {w!r}; choose from {KNOWN_WORKLOADS}.")
        for e in self.engines:
            if e not in ALL_ENGINES:
                raise ValueError(f"Unknown engine {e!r}; choose from {ALL_ENGINES}.")
        if self.quantization is not None:
            from nbengine.ops.quant import QUANTIZATION_MODES

            if self.quantization not in QUANTIZATION_MODES:
                raise ValueError(
                    f"quantization must be one of {tuple(QUANTIZATION_MODES)} or "
                    f"None, got {self.quantization!r}."
                )
        if self.scale <= 0:
            raise ValueError(f"scale must be positive, got {self.scale}.")
        if self.omp_wait_policy is not None and self.omp_wait_policy not in WAIT_POLICIES:
            raise ValueError(
                f"omp_wait_policy must be PASSIVE, ACTIVE or None (each engine's own), "
                f"got {self.omp_wait_policy!r}."
            )
        if self.lora_adapters < 0:
            raise ValueError(f"lora_adapters must be at least 0, got {self.lora_adapters}.")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}.")

    def wait_policy(self, engine: str) -> str:
        """The ``OMP_WAIT_POLICY`` of ``engine``'s processes in this run."""
        return self.omp_wait_policy or ENGINE_WAIT_POLICY[engine]

    @property
    def measure_large(self) -> bool:
        """Full-size machine measurements (512 MiB copy, 1536^3 matmul) unless a smoke run."""
        return self.scale >= 0.5
