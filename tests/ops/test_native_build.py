"""Building and loading the native kernel library: only on use, and only what we built.

Each case runs in a fresh Python process with its own ``NBENGINE_CACHE`` directory, so
what the process builds or loads is exactly what the test sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nbengine.ops import native_build
from nbengine.testing import TINY_LLAMA, make_tiny_model


def _run(code: str, cache: Path) -> dict[str, object]:
    env = {**os.environ, "NBENGINE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_float32_engine_builds_and_loads_nothing(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "llama", arch="llama", **TINY_LLAMA)
    cache = tmp_path / "cache"
    result = _run(
        "import json, nbengine as nb\n"
        "from nbengine.ops import native\n"
        f"with nb.Engine({str(model)!r}, dtype='float32') as e:\n"
        "    ids = e.generate('Once upon', nb.SamplingParams(max_tokens=8, temperature=0,"
        " ignore_eos=True)).result(120).outputs[0].token_ids\n"
        "print(json.dumps({'tokens': len(ids), 'loaded': native.kernels.cache_info().currsize}))",
        cache,
    )
    assert result == {"tokens": 8, "loaded": 0}
    assert not (cache / "native").exists() or list((cache / "native").iterdir()) == []


needs_native = pytest.mark.skipif(
    native_build.unsupported() is not None, reason=f"native kernels: {native_build.unsupported()}"
)

LOAD = (
    "import json\nfrom nbengine.ops import native\nk = native.kernels()\n"
    "print(json.dumps({'ok': k is not None, 'path': str(k.path) if k else None}))"
)


@needs_native
def test_a_tampered_cached_library_is_rebuilt(tmp_path: Path) -> None:
    first = _run(LOAD, tmp_path)
    assert first["ok"]
    library = Path(str(first["path"]))
    record = library.with_suffix(".sha256")
    assert record.read_text().split()[1] == native_build._sha256(library)
    good = library.read_bytes()
    library.write_bytes(good[:4096])  # a truncated (or replaced) library
    second = _run(LOAD, tmp_path)
    assert second == first  # loaded again, from a fresh build
    assert (
        library.read_bytes() == good
        or native_build._sha256(library) == record.read_text().split()[1]
    )
    record.unlink()  # no record at all: not trusted either
    assert _run(LOAD, tmp_path)["ok"] and record.exists()
    os.chmod(library, 0o777)  # writable by anyone: rebuilt with safe permissions
    assert _run(LOAD, tmp_path)["ok"] and library.stat().st_mode & 0o022 == 0


def test_auto_dtype_follows_the_checkpoint_and_the_machine(tmp_path: Path) -> None:
    """A bfloat16 checkpoint runs in bfloat16 where the native kernels are available, in
    float32 where they are not (NBENGINE_NATIVE=0 stands in for a CPU without AVX-512
    BF16); an explicit bfloat16 then takes the torch path and still generates."""
    model = make_tiny_model(tmp_path / "llama", arch="llama", **TINY_LLAMA)
    cfg_file = model / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg_file.write_text(json.dumps(cfg))
    code = (
        "import json, nbengine as nb\n"
        "from nbengine.ops import native\n"
        f"with nb.Engine({str(model)!r}) as auto, "
        f"nb.Engine({str(model)!r}, dtype='bfloat16') as bf:\n"
        "    p = nb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)\n"
        "    n = len(bf.generate('Once upon', p).result(120).outputs[0].token_ids)\n"
        "    print(json.dumps({'auto': auto.dtype, 'tokens': n,"
        " 'native': native.kernels.cache_info().currsize > 0 and native.kernels() is not None}))"
    )
    with_native = native_build.unsupported() is None
    result = _run(code, tmp_path / "cache")
    assert result == {
        "auto": "bfloat16" if with_native else "float32",
        "tokens": 6,
        "native": with_native,
    }
    env_code = "import os\nos.environ['NBENGINE_NATIVE'] = '0'\n" + code
    assert _run(env_code, tmp_path / "cache") == {"auto": "float32", "tokens": 6, "native": False}
