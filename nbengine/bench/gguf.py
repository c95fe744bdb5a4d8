"""The llama.cpp peer's weights: the bench model as GGUF files, converted once and cached.

Cached beside the bench model (as ``ct2_model_dir`` does for CTranslate2), in
``<model>-gguf/``: ``bf16`` (and ``f32``) and ``q8_0`` by llama.cpp's own
``convert_hf_to_gguf.py``, ``q4_0`` by ``llama_model_quantize`` from the bf16 file. The
converter is not part of the installed package; ``converter_source`` finds the one of the
installed version (see its docstring and docs/benchmarks.md). The driver that runs these
files is bench/llamacpp.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

__all__ = [
    "converter_source",
    "gguf_dir",
    "gguf_file",
    "gguf_type",
    "installed_version",
    "llamacpp_cache_dir",
]

# The GGUF type for each ``--quantization`` (None: the bench dtype decides).
_QUANT_TYPES = {"int8": "q8_0", "int4": "q4_0", "int4-g32": "q4_0"}
_DTYPE_TYPES = {"bfloat16": "bf16", "float32": "f32"}
_CONVERTER_TYPES = ("bf16", "f32", "q8_0")  # what convert_hf_to_gguf.py writes itself
# The environment variable naming a llama-cpp-python sdist (.tar.gz) or an unpacked
# llama.cpp source tree holding convert_hf_to_gguf.py.
SOURCE_ENV = "NBENGINE_LLAMACPP_SOURCE"


def gguf_type(dtype: str, quantization: str | None) -> str:
    """The GGUF weight type llama.cpp runs for a bench run: ``q8_0`` for int8, ``q4_0`` for
    int4 and int4-g32 (both 32-weight blocks with one scale each), else the dtype's."""
    if quantization is not None:
        if quantization not in _QUANT_TYPES:
            raise ValueError(
                f"quantization must be one of {tuple(_QUANT_TYPES)} or None, got {quantization!r}."
            )
        return _QUANT_TYPES[quantization]
    if dtype not in _DTYPE_TYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPE_TYPES)}, got {dtype!r}.")
    return _DTYPE_TYPES[dtype]


def llamacpp_cache_dir() -> Path:
    """``$NBENGINE_CACHE/llamacpp`` (default ``~/.cache/nbengine/llamacpp``)."""
    root = Path(os.environ.get("NBENGINE_CACHE", Path.home() / ".cache" / "nbengine"))
    return root / "llamacpp"


def installed_version() -> str:
    """The installed llama-cpp-python's version."""
    import llama_cpp

    return str(llama_cpp.__version__)


def _converter_members(name: str) -> bool:
    """The sdist members the converter needs: the script, its package, gguf-py."""
    parts = name.split("/")
    if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"]:
        return False
    return parts[3] in ("convert_hf_to_gguf.py", "conversion", "gguf-py")


def _unpack_converter(sdist: Path, dest: Path) -> Path:
    """The converter's files of ``sdist`` unpacked into ``dest``; its llama.cpp directory."""
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if _converter_members(m.name)]
            if not any(m.name.endswith("/convert_hf_to_gguf.py") for m in members):
                raise RuntimeError(f"{sdist} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
            tar.extractall(tmp, members=members, filter="data")
        (src,) = [p.parent for p in tmp.glob("*/vendor/llama.cpp/convert_hf_to_gguf.py")]
        src.rename(tmp / "llama.cpp")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / "llama.cpp"


def converter_source() -> Path:
    """The llama.cpp directory holding ``convert_hf_to_gguf.py`` (and its ``conversion``
    package and ``gguf-py``) of the installed llama-cpp-python's version.

    The converter ships in llama-cpp-python's sdist (``vendor/llama.cpp``), not in the
    installed package, and it must match the compiled llama.cpp (the GGUF keys and tensor
    names move together). Looked up in this order:

    1. ``$NBENGINE_LLAMACPP_SOURCE``: an sdist ``.tar.gz`` (its converter files are
       unpacked into the cache) or a llama.cpp source tree;
    2. the cache, ``llamacpp_cache_dir()/converter-<version>``;
    3. ``pip download --no-deps --no-binary :all: llama-cpp-python==<version>`` (the
       same sdist pip built the installed package from), unpacked into the cache.
    """
    env = os.environ.get(SOURCE_ENV)
    version = installed_version()
    cache = llamacpp_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    if env:
        p = Path(env)
        if p.is_dir():
            for cand in (p, p / "vendor" / "llama.cpp"):
                if (cand / "convert_hf_to_gguf.py").is_file():
                    return cand
            raise RuntimeError(f"{SOURCE_ENV}={env}: no convert_hf_to_gguf.py there")
        if not p.is_file():
            raise RuntimeError(f"{SOURCE_ENV}={env}: no such file or directory")
        return _unpack_converter(p, cache / f"converter-{p.name.removesuffix('.tar.gz')}")
    dest = cache / f"converter-{version}"
    if (dest / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        return dest / "llama.cpp"
    dl = cache / "sdist"
    dl.mkdir(exist_ok=True)
    name = f"llama_cpp_python-{version}.tar.gz"
    if not (dl / name).is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += ["-d", str(dl), f"llama-cpp-python=={version}"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if not (dl / name).is_file():
            raise RuntimeError(
                f"cannot fetch llama.cpp's converter (llama-cpp-python {version} sdist): "
                f"{done.stderr.strip()[-500:]}; set {SOURCE_ENV} to the sdist or a llama.cpp "
                "source tree"
            )
    return _unpack_converter(dl / name, dest)


# The converter, run in a child process: the bench model's tokenizer is a small byte-level
# BPE the converter does not know by its pre-tokenizer hash; the bench sends token ids
# only (llama.cpp never tokenizes text here), so an unknown one is written as "gpt-2".
_CONVERT = """
import runpy, sys
src, model, out, outtype = sys.argv[1:5]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
original = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return original(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", outtype]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def gguf_dir(model_dir: Path) -> Path:
    """``<model_dir>-gguf/``, beside the model: its GGUF files and check results."""
    return model_dir.parent / f"{model_dir.name}-gguf"


def gguf_file(model_dir: Path, gtype: str) -> Path:
    """``model_dir`` as a GGUF file of weight type ``gtype`` (``bf16``, ``f32``, ``q8_0``,
    ``q4_0``), converted once and cached in ``<model_dir>-gguf/`` beside it."""
    out = gguf_dir(model_dir) / f"model-{gtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if gtype in _CONVERTER_TYPES:
        src = converter_source()
        cmd = [sys.executable, "-c", _CONVERT, str(src), str(model_dir), str(tmp), gtype]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not tmp.is_file():
            raise RuntimeError(
                f"convert_hf_to_gguf.py --outtype {gtype} failed: {done.stderr.strip()[-1500:]}"
            )
    elif gtype == "q4_0":
        import llama_cpp as L

        src_file = gguf_file(model_dir, "bf16")
        L.llama_backend_init()
        params = L.llama_model_quantize_default_params()
        params.nthread = torch.get_num_threads()
        params.ftype = L.LLAMA_FTYPE_MOSTLY_Q4_0
        rc = L.llama_model_quantize(str(src_file).encode(), str(tmp).encode(), params)
        if rc != 0 or not tmp.is_file():
            raise RuntimeError(f"llama_model_quantize to q4_0 failed (status {rc})")
    else:
        raise ValueError(f"gtype must be one of bf16, f32, q8_0, q4_0; got {gtype!r}")
    tmp.replace(out)
    return out
