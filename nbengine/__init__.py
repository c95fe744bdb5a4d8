"""nbengine: an LLM inference engine embedded in a Jupyter kernel."""

import logging as _logging

from nbengine.frontend.engine import Engine
from nbengine.frontend.handles import RequestHandle
from nbengine.llm import LLM
from nbengine.outputs import CompletionOutput, Logprob, RequestOutput
from nbengine.request import EngineDeadError, FinishReason, RequestIdInUseError, RequestStatus
from nbengine.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "CompletionOutput",
    "Engine",
    "EngineDeadError",
    "FinishReason",
    "LLM",
    "Logprob",
    "RequestHandle",
    "RequestIdInUseError",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStatus",
    "SamplingParams",
]
__version__ = "0.1.0"

# Library logging stays silent unless the application configures it: with no handler,
# Python's last-resort handler would write engine-thread warnings to stderr, which
# ipykernel routes into whichever notebook cell runs next.
_logging.getLogger("nbengine").addHandler(_logging.NullHandler())
