"""Model side: loading Hugging Face directories, the architectures, the runner."""

from nbengine.model.errors import ModelLoadError
from nbengine.model.loader import (
    DEFAULT_MODEL_DIR,
    SUPPORTED_ARCHITECTURES,
    LoadedModel,
    load_model,
    resolve_model_dir,
)
from nbengine.model.tokenizer import Tokenizer, TokenizerLoadError

__all__ = [
    "DEFAULT_MODEL_DIR",
    "SUPPORTED_ARCHITECTURES",
    "LoadedModel",
    "ModelLoadError",
    "Tokenizer",
    "TokenizerLoadError",
    "load_model",
    "resolve_model_dir",
]
