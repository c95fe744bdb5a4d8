"""Model ids from the Hugging Face Hub: ``nb.Engine("org/name", revision=None)``.

A model argument that is not an existing directory but reads as a Hub repo id is
resolved through ``huggingface_hub.snapshot_download``, in this order (docs/models.md,
"Models from the Hugging Face Hub"):

1. the Hub cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``),
   with ``local_files_only=True``: no network when a complete snapshot is already there;
2. otherwise a download, with huggingface_hub's progress bars (``tqdm.auto``: a widget in
   a notebook), of only the files the loader reads (``ENGINE_FILES``, then the
   safetensors weights: the shards named by ``model.safetensors.index.json``, else the
   top-level ``*.safetensors``). Never ``*.bin``, never Python code.

``HF_HUB_OFFLINE=1`` stops after step 1; ``HF_ENDPOINT`` names the Hub (a mirror);
``HF_TOKEN`` is huggingface_hub's own. Every failure becomes a ``ModelLoadError`` that
says what to do.

huggingface_hub reads HF_HUB_CACHE, HF_HOME, HF_HUB_OFFLINE and HF_ENDPOINT into module
constants when it is first imported (importing transformers imports it), so a notebook
cell that sets them afterwards would not be seen. ``hub_settings`` therefore reads them
from ``os.environ`` at every resolution, with huggingface_hub's precedence, and they are
passed to it explicitly (``cache_dir=``, ``endpoint=``, ``local_files_only=``). One
setting cannot be passed: huggingface_hub imported while HF_HUB_OFFLINE was set blocks
every request of the process, so a download then fails with a message that says so.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from nbengine.model.errors import ModelLoadError
from nbengine.model.files import read_json

__all__ = [
    "ENGINE_FILES",
    "resolve_hub_adapter",
    "HubSettings",
    "hub_settings",
    "is_hub_repo_id",
    "resolve_hub_model",
    "weight_patterns",
]

logger = logging.getLogger(__name__)

# Every small file nbengine reads from a model directory (loader.py, tokenizer.py,
# chat_template.py). Anything else in a repo (README, *.bin, *.py, onnx/, original/) is
# never downloaded.
ENGINE_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model.safetensors.index.json",
)

# "name" or "org/name": letters, digits, "-", "_", "." (no "--" or ".." and no leading
# or trailing "-" or "."), as the Hub allows.
_REPO_ID = re.compile(r"^(?:[\w][\w.-]{0,95}/)?[\w][\w.-]{0,95}$")


DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = ("1", "ON", "YES", "TRUE")  # huggingface_hub's truthy spellings, case-insensitive


@dataclass(frozen=True, slots=True)
class HubSettings:
    """The Hub settings in force for one resolution (``hub_settings``)."""

    cache_dir: Path  # the Hub cache: <cache_dir>/models--org--name/snapshots/<commit>/
    endpoint: str  # the Hub's URL, without a trailing "/"
    offline: bool  # HF_HUB_OFFLINE: never contact the Hub


def _env(name: str) -> str | None:
    """``os.environ[name]`` now, with an empty value read as unset."""
    return os.environ.get(name) or None


def _expand(value: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(value)))


def hub_settings() -> HubSettings:
    """The Hub settings that ``os.environ`` asks for now.

    huggingface_hub's own rules (its ``constants`` module, which applies them once, at
    import): the cache is HF_HUB_CACHE, else the legacy HUGGINGFACE_HUB_CACHE, else
    ``$HF_HOME/hub``, with HF_HOME defaulting to ``$XDG_CACHE_HOME/huggingface``, else
    ``~/.cache/huggingface``; offline is HF_HUB_OFFLINE (else TRANSFORMERS_OFFLINE) being
    1, ON, YES or TRUE; the endpoint is HF_ENDPOINT, else https://huggingface.co. A
    variable set to the empty string counts as unset.
    """
    cache = _env("HF_HUB_CACHE") or _env("HUGGINGFACE_HUB_CACHE")
    if cache is None:
        home = _env("HF_HOME") or os.path.join(
            _env("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
            "huggingface",
        )
        cache = os.path.join(str(_expand(home)), "hub")
    offline = _env("HF_HUB_OFFLINE") or _env("TRANSFORMERS_OFFLINE") or ""
    return HubSettings(
        cache_dir=_expand(cache),
        endpoint=(_env("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
        offline=offline.upper() in _TRUE,
    )


def is_hub_repo_id(model: str) -> bool:
    """True if ``model`` (which is not an existing path) reads as a Hub repo id."""
    if model.startswith((".", "~", "/")) or "\\" in model:
        return False
    if not _REPO_ID.match(model) or "--" in model or ".." in model:
        return False
    return not any(part.endswith((".", "-")) for part in model.split("/"))


def weight_patterns(snapshot: Path) -> list[str]:
    """The safetensors files the loader will read, as ``allow_patterns``.

    With an index, exactly its shards (a repo may also hold a consolidated copy, e.g.
    Mistral's ``consolidated.safetensors``, which would double the download); without
    one, every top-level ``*.safetensors`` (the loader's own rule, loader.py).
    """
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"The shard index {index} has no weight_map object.")
        return sorted({str(name) for name in weight_map.values()})
    return ["*.safetensors"]


def _is_complete(snapshot: Path) -> bool:
    """A snapshot holds what the loader needs: config, tokenizer and every weight file."""
    if not (snapshot / "config.json").is_file() or not (snapshot / "tokenizer.json").is_file():
        return False
    patterns = weight_patterns(snapshot)
    if patterns == ["*.safetensors"]:
        return any(snapshot.glob("*.safetensors"))
    return all((snapshot / name).is_file() for name in patterns)


def _hint_stuck_offline(repo_id: str) -> str:
    return (
        "HF_HUB_OFFLINE is no longer set, but huggingface_hub was imported while "
        "HF_HUB_OFFLINE was set, and it refuses every download for the rest of this "
        "process: restart the kernel (or Python) to download, or download the model first, "
        f"e.g. `hf download {repo_id}` in a terminal."
    )


def _hint_offline(repo_id: str) -> str:
    return (
        "HF_HUB_OFFLINE=1 is set, so nothing is downloaded: unset it (with network access) "
        f"or download the model first, e.g. `hf download {repo_id}`."
    )


def _describe(repo_id: str, revision: str | None) -> str:
    return f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")


def _as_model_load_error(
    exc: Exception, repo_id: str, revision: str | None, settings: HubSettings
) -> ModelLoadError:
    """A ModelLoadError that says what went wrong with ``repo_id`` and what to do."""
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = _describe(repo_id, revision)
    cache = settings.cache_dir
    if isinstance(exc, GatedRepoError):  # a subclass of RepositoryNotFoundError: test first
        msg = (
            f"The Hugging Face Hub model {repo_id!r} is gated: accept its terms on its page "
            f"(https://huggingface.co/{repo_id}), then log in (`hf auth login`) or set HF_TOKEN."
        )
    elif isinstance(exc, RepositoryNotFoundError):
        msg = (
            f"{repo_id!r} is neither a local directory nor a model on the Hugging Face Hub "
            "(or it is private: log in with `hf auth login` or set HF_TOKEN)."
        )
    elif isinstance(exc, RevisionNotFoundError):
        msg = f"The Hugging Face Hub model {repo_id!r} has no revision {revision!r}."
    elif isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)):
        if settings.offline:
            msg = f"The model {what} is not in the Hub cache ({cache}). " + _hint_offline(repo_id)
        else:
            msg = (
                f"Cannot reach the Hugging Face Hub ({settings.endpoint}) to download {what}, "
                f"and it is not in the Hub cache ({cache}). Check the network (or HF_ENDPOINT), "
                "or point HF_HUB_CACHE / HF_HOME at a cache that holds it."
            )
    else:
        msg = f"Downloading {what} from the Hugging Face Hub failed: {type(exc).__name__}: {exc}"
    return ModelLoadError(msg)


def _snapshot(
    repo_id: str,
    revision: str | None,
    patterns: list[str],
    settings: HubSettings,
    *,
    local_files_only: bool,
) -> Path:
    from huggingface_hub import snapshot_download

    # Every setting explicit: huggingface_hub's defaults are its import-time constants.
    folder = snapshot_download(
        repo_id,
        revision=revision,
        allow_patterns=patterns,
        ignore_patterns=["*/*"],  # the loader reads the top level only
        cache_dir=str(settings.cache_dir),
        endpoint=settings.endpoint,
        local_files_only=local_files_only or settings.offline,
    )
    return Path(folder)


def resolve_hub_model(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of Hub model ``repo_id`` (cache first, then download).

    Raises ``ModelLoadError`` for a missing, private or gated repo, an unknown revision,
    or a model that is neither cached nor reachable (``HF_HUB_OFFLINE=1``, no network).
    The Hub settings are those of ``os.environ`` now (``hub_settings``).
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError

    settings = hub_settings()
    try:
        # The same patterns as the download: huggingface_hub checks them against the
        # tree listing it cached with the snapshot (trees/<commit>.json), if any.
        cached = _snapshot(repo_id, revision, list(ENGINE_FILES), settings, local_files_only=True)
    except HFValidationError as exc:
        raise ModelLoadError(f"{repo_id!r} is not a valid Hub model id: {exc}") from exc
    except Exception:  # not cached (LocalEntryNotFoundError), or only partly
        cached = None
    if cached is not None and _is_complete(cached):
        logger.info("Using %s from the Hub cache: %s", _describe(repo_id, revision), cached)
        return cached
    # huggingface_hub imported while HF_HUB_OFFLINE was set refuses every request since.
    stuck_offline = not settings.offline and bool(constants.HF_HUB_OFFLINE)
    if settings.offline or stuck_offline:
        where = (
            f"is incomplete in the Hub cache ({cached})"
            if cached
            else (f"is not in the Hub cache ({settings.cache_dir})")
        )
        hint = _hint_stuck_offline(repo_id) if stuck_offline else _hint_offline(repo_id)
        raise ModelLoadError(f"The model {_describe(repo_id, revision)} {where}. " + hint)
    try:
        # The small files first: the shard index says which weight files to fetch.
        snapshot = _snapshot(
            repo_id, revision, list(ENGINE_FILES), settings, local_files_only=False
        )
        # Pin the commit just resolved, so that both downloads come from one revision.
        commit = snapshot.name
        _snapshot(repo_id, commit, weight_patterns(snapshot), settings, local_files_only=False)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise _as_model_load_error(exc, repo_id, revision, settings) from exc
    if not (snapshot / "config.json").is_file():
        raise ModelLoadError(
            f"The Hugging Face Hub model {_describe(repo_id, revision)} has no config.json; "
            "nbengine loads Hugging Face transformers-format models (docs/models.md)."
        )
    if not any(snapshot.glob("*.safetensors")):
        raise ModelLoadError(
            f"The Hugging Face Hub model {_describe(repo_id, revision)} has no safetensors "
            "weights; nbengine does not load pytorch_model.bin (docs/models.md)."
        )
    return snapshot


def resolve_hub_adapter(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of a PEFT LoRA adapter on the Hub (docs/lora.md): the
    cache first, then a download of only ``adapter_config.json`` and
    ``adapter_model.safetensors``, with the same settings and errors as models."""
    from huggingface_hub.errors import HFValidationError

    from nbengine.lora.adapter import ADAPTER_FILES

    settings = hub_settings()
    files = list(ADAPTER_FILES)

    def complete(folder: Path) -> bool:
        return all((folder / f).is_file() for f in files)

    try:
        cached = _snapshot(repo_id, revision, files, settings, local_files_only=True)
    except HFValidationError as exc:
        raise ModelLoadError(f"{repo_id!r} is not a valid Hub adapter id: {exc}") from exc
    except Exception:  # not cached, or only partly
        cached = None
    if cached is not None and complete(cached):
        return cached
    if settings.offline:
        raise ModelLoadError(
            f"The LoRA adapter {_describe(repo_id, revision)} is not in the Hub cache "
            f"({settings.cache_dir}). " + _hint_offline(repo_id)
        )
    try:
        snapshot = _snapshot(repo_id, revision, files, settings, local_files_only=False)
    except Exception as exc:
        raise _as_model_load_error(exc, repo_id, revision, settings) from exc
    if not complete(snapshot):
        raise ModelLoadError(
            f"The Hub repo {_describe(repo_id, revision)} is not a PEFT LoRA adapter: it has "
            f"no {' or '.join(f for f in files if not (snapshot / f).is_file())}."
        )
    return snapshot
