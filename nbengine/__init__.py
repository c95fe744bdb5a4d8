"""nbengine: an LLM inference engine embedded in a Jupyter kernel."""

import logging as _logging
import os as _os
import sys as _sys

# OpenMP worker threads that spin while waiting make every torch op 10-25x slower
# whenever another process (or the notebook's own threads) wants the same cores, as
# on any shared machine; sleeping waiters cost little on an idle one (docs/benchmarks.md).
# A short spin before sleeping (about 0.1 ms) saves the wake-up between the parallel
# regions of one step (nbengine/ops/openmp.py). This only takes effect if torch has not
# been imported yet; an explicit setting wins.
if "torch" not in _sys.modules and "OMP_WAIT_POLICY" not in _os.environ:
    from nbengine.ops.openmp import PASSIVE_SPINCOUNT as _SPINCOUNT

    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _os.environ.setdefault("GOMP_SPINCOUNT", _SPINCOUNT)

from nbengine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from nbengine.frontend.engine import Engine
from nbengine.frontend.handles import RequestHandle
from nbengine.llm import LLM
from nbengine.lora.request import LoRARequest
from nbengine.outputs import CompletionOutput, Logprob, RequestOutput
from nbengine.request import EngineDeadError, FinishReason, RequestIdInUseError, RequestStatus
from nbengine.sampling_params import RequestOutputKind, SamplingParams
from nbengine.structured_outputs import GuidedDecodingParams, StructuredOutputsParams

__all__ = [
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "Engine",
    "EngineDeadError",
    "FinishReason",
    "GuidedDecodingParams",
    "LLM",
    "Logprob",
    "LoRARequest",
    "RequestHandle",
    "RequestIdInUseError",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStatus",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"

# Library logging stays silent unless the application configures it: with no handler,
# Python's last-resort handler would write engine-thread warnings to stderr, which
# ipykernel routes into whichever notebook cell runs next.
_logging.getLogger("nbengine").addHandler(_logging.NullHandler())
