"""Hub model ids: ``nb.Engine("org/name")`` resolves through huggingface_hub.

No test reaches the real Hub. Cache tests lay out a Hub cache as huggingface_hub does
(``nbengine.testing.make_hub_cache``) and let huggingface_hub's own offline resolution
find it; download tests point ``HF_ENDPOINT`` at a local server (tests/model/hub_server.py
says which routes it serves and why they suffice). huggingface_hub reads ``HF_*``
variables when it is imported, so each scenario runs in a fresh Python process with the
environment a user would set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hub_server import HubRepo, repo_from_dir, serve_hub

from nbengine.model.hub import is_hub_repo_id
from nbengine.testing import TINY_LLAMA, make_hub_cache, make_tiny_model

# Each scenario prints one JSON line: what a user would see.
_PRELUDE = """
import json, sys
import nbengine as nb
from nbengine.model import ModelLoadError, resolve_model_dir

def outcome(fn):
    try:
        return {"ok": str(fn())}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}

def greedy(model, **kw):
    with nb.LLM(model, num_kv_blocks=32, **kw) as llm:
        params = nb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        out = llm.generate("Once upon a time", params, use_tqdm=False)
        return out[0].outputs[0].token_ids
"""


def _run(code: str, env: dict[str, str], first: str = "") -> tuple[dict[str, object], str]:
    """Run ``first``, then the prelude, then ``code`` in a fresh Python with ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    base.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(first) + _PRELUDE + textwrap.dedent(code)],
        env=base,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama", **TINY_LLAMA)


def test_repo_ids_and_paths_are_told_apart() -> None:
    for repo in ("gpt2", "Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.2-1B", "a_b/c.d"):
        assert is_hub_repo_id(repo)
    for path in (
        "./model",
        "../m",
        "/abs/model",
        "~/m",
        "a/b/c",
        "a\\b",
        "org/-x",
        "org/x.",
        "a--b/c",
        "",
        "org/",
    ):
        assert not is_hub_repo_id(path)


@pytest.mark.slow  # fresh Python processes
def test_hub_cache_resolves_offline_via_hf_hub_cache_and_hf_home(
    tiny: Path, tmp_path: Path
) -> None:
    snap = make_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", tiny)
    make_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", tiny, revision="v1")
    result, _ = _run(
        f"""
        print(json.dumps({{
            "path": outcome(lambda: resolve_model_dir("tiny-org/tiny-llama")),
            "tag": outcome(lambda: resolve_model_dir("tiny-org/tiny-llama", revision="v1")),
            "hub_ids": greedy("tiny-org/tiny-llama"),
            "dir_ids": greedy({str(tiny)!r}),
            "missing": outcome(lambda: resolve_model_dir("tiny-org/not-cached")),
            "bad_rev": outcome(lambda: nb.Engine("tiny-org/tiny-llama", revision="v2")),
        }}))
    """,
        {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"},
    )
    assert result["path"] == {"ok": str(snap)}
    assert result["tag"] == {"ok": str(snap)}
    assert result["hub_ids"] == result["dir_ids"] and len(result["hub_ids"]) == 8
    for key, name in (("missing", "tiny-org/not-cached"), ("bad_rev", "tiny-org/tiny-llama")):
        err = result[key]
        assert err["error"] == "ModelLoadError", err
        assert name in err["message"] and "HF_HUB_OFFLINE=1" in err["message"]
    assert "'v2'" in result["bad_rev"]["message"]

    # HF_HOME=<home> means the cache <home>/hub; no HF_HUB_OFFLINE and an endpoint that
    # refuses connections: a complete cached snapshot needs no network at all.
    home = tmp_path / "home"
    snap2 = make_hub_cache(home / "hub", "tiny-org/tiny-llama", tiny)
    result, _ = _run(
        """
        print(json.dumps({"path": outcome(lambda: resolve_model_dir("tiny-org/tiny-llama"))}))
    """,
        {"HF_HOME": str(home), "HF_ENDPOINT": "http://127.0.0.1:9"},
    )
    assert result["path"] == {"ok": str(snap2)}


@pytest.mark.slow  # fresh Python processes
def test_local_directory_wins_over_a_hub_id(tiny: Path, tmp_path: Path) -> None:
    local = tmp_path / "org" / "name"
    local.parent.mkdir()
    local.symlink_to(tiny, target_is_directory=True)
    result, _ = _run(
        """
        import os
        os.chdir(os.environ["WORKDIR"])
        print(json.dumps({"path": outcome(lambda: resolve_model_dir("org/name"))}))
    """,
        {"WORKDIR": str(tmp_path), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "c")},
    )
    assert result["path"] == {"ok": "org/name"}


def _sharded_repo(tiny: Path, tmp_path: Path, repo_id: str) -> tuple[HubRepo, Path]:
    """``tiny`` as a two-shard checkpoint with an index, plus files nbengine must not fetch."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "sharded-src"
    d.mkdir()
    for f in tiny.iterdir():
        if f.name != "model.safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    weights = load_file(tiny / "model.safetensors")
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(d / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    extra = {
        # A repo may ship the same weights in other forms; the index decides what is read.
        "consolidated.safetensors": (tiny / "model.safetensors").read_bytes(),
        "pytorch_model.bin": b"\0" * 4096,
        "modeling_custom.py": b"raise SystemExit('never run')\n",
        "README.md": b"# tiny\n",
        "original/model.safetensors": b"\0" * 1024,
    }
    return repo_from_dir(repo_id, d, extra), d


@pytest.mark.slow  # fresh Python processes
def test_download_fetches_only_the_files_the_engine_reads(tiny: Path, tmp_path: Path) -> None:
    repo, src = _sharded_repo(tiny, tmp_path, "tiny-org/sharded")
    gated = repo_from_dir("tiny-org/gated", tiny, gated=True)
    cache = tmp_path / "cache"
    with serve_hub(repo, gated) as server:
        host, port = server.server_address[:2]
        result, stderr = _run(
            f"""
            print(json.dumps({{
                "path": outcome(lambda: resolve_model_dir("tiny-org/sharded")),
                "hub_ids": greedy("tiny-org/sharded"),
                "dir_ids": greedy({str(tiny)!r}),
                "missing": outcome(lambda: nb.Engine("tiny-org/no-such-model")),
                "gated": outcome(lambda: nb.Engine("tiny-org/gated")),
                "bad_rev": outcome(
                    lambda: nb.Engine("tiny-org/sharded", revision="no-such-branch")
                ),
            }}))
        """,
            {"HF_ENDPOINT": f"http://{host}:{port}", "HF_HUB_CACHE": str(cache)},
        )
        log = list(server.log)
    snap = Path(result["path"]["ok"])
    assert snap.parent.parent == cache / "models--tiny-org--sharded"
    assert snap.name == repo.commit
    assert (cache / "models--tiny-org--sharded" / "refs" / "main").read_text() == repo.commit
    wanted = {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    assert {p.name for p in snap.iterdir()} == wanted
    fetched = {
        path.split("/resolve/")[1].split("/", 1)[1]
        for method, path in log
        if method == "GET" and "/resolve/" in path
    }
    assert fetched == wanted  # never *.bin, code, README, subfolders or the unlisted copy
    assert result["hub_ids"] == result["dir_ids"] and len(result["hub_ids"]) == 8
    assert "Fetching" in stderr  # huggingface_hub's progress bars (tqdm.auto)

    missing, gated_err, bad_rev = result["missing"], result["gated"], result["bad_rev"]
    assert missing["error"] == "ModelLoadError"
    assert (
        "'tiny-org/no-such-model' is neither a local directory nor a model on the Hugging Face Hub"
        in missing["message"]
        and "HF_TOKEN" in missing["message"]
    )
    assert gated_err["error"] == "ModelLoadError"
    assert (
        "gated" in gated_err["message"]
        and "https://huggingface.co/tiny-org/gated" in gated_err["message"]
    )
    assert bad_rev["error"] == "ModelLoadError"
    assert "has no revision 'no-such-branch'" in bad_rev["message"]

    # The cache huggingface_hub wrote is the layout make_hub_cache writes: the same blob
    # names (sha256 for safetensors, git sha1 otherwise) behind the same file names.
    mine = make_hub_cache(tmp_path / "mine", "tiny-org/sharded", src)
    for name in wanted:
        assert os.readlink(snap / name) == os.readlink(mine / name), name

    # The server is gone and HF_HUB_OFFLINE is not set: the cached snapshot is used as is.
    result, _ = _run(
        """
        print(json.dumps({"path": outcome(lambda: resolve_model_dir("tiny-org/sharded"))}))
    """,
        {"HF_ENDPOINT": f"http://{host}:{port}", "HF_HUB_CACHE": str(cache)},
    )
    assert result["path"] == {"ok": str(snap)}


@pytest.mark.slow  # fresh Python processes
def test_unreachable_hub_and_empty_cache_says_so(tmp_path: Path) -> None:
    result, _ = _run(
        """
        print(json.dumps({"e": outcome(lambda: resolve_model_dir("tiny-org/tiny"))}))
    """,
        {
            "HF_ENDPOINT": "http://127.0.0.1:9",
            "HF_HUB_CACHE": str(tmp_path / "c"),
            "HF_HUB_ETAG_TIMEOUT": "2",
            "HF_HUB_DOWNLOAD_TIMEOUT": "2",
        },
    )
    err = result["e"]
    assert err["error"] == "ModelLoadError", err
    assert "Cannot reach the Hugging Face Hub (http://127.0.0.1:9)" in err["message"]
    assert str(tmp_path / "c") in err["message"]


def test_snapshot_links_into_blobs_are_inside_but_links_elsewhere_are_not(
    tiny: Path, tmp_path: Path
) -> None:
    from nbengine.model import ModelLoadError
    from nbengine.model.loader import _weight_files

    _, src = _sharded_repo(tiny, tmp_path, "tiny-org/sharded")
    snap = make_hub_cache(tmp_path / "hub", "tiny-org/sharded", src)
    assert [f.name for f in _weight_files(snap)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes((snap / "model-00001-of-00002.safetensors").read_bytes())
    (snap / "model-00001-of-00002.safetensors").unlink()
    (snap / "model-00001-of-00002.safetensors").symlink_to(outside)
    with pytest.raises(ModelLoadError, match="leads outside the model directory"):
        _weight_files(snap)


# A notebook imports transformers (so huggingface_hub, which reads its HF_* variables into
# module constants then) before a cell sets HF_HUB_CACHE or HF_HUB_OFFLINE.
_IMPORT_HUB_FIRST = """
import os
import huggingface_hub
import transformers
"""


@pytest.mark.slow  # fresh Python processes
def test_hub_settings_set_after_huggingface_hub_was_imported_offline(
    tiny: Path, tmp_path: Path
) -> None:
    snap = make_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", tiny)
    home = tmp_path / "home"
    snap_home = make_hub_cache(home / "hub", "tiny-org/tiny-llama", tiny)
    # At import: an empty cache and an endpoint that logs every request it gets.
    with serve_hub() as server:
        host, port = server.server_address[:2]
        result, _ = _run(
            f"""
            os.environ["HF_HUB_CACHE"] = {str(tmp_path / "hub")!r}
            os.environ["HF_HUB_OFFLINE"] = "1"
            out = {{
                "path": outcome(lambda: resolve_model_dir("tiny-org/tiny-llama")),
                "hub_ids": greedy("tiny-org/tiny-llama"),
                "dir_ids": greedy({str(tiny)!r}),
                "missing": outcome(lambda: nb.Engine("tiny-org/not-cached")),
            }}
            # HF_HOME=<home>: the cache <home>/hub, once HF_HUB_CACHE is unset.
            del os.environ["HF_HUB_CACHE"]
            os.environ["HF_HOME"] = {str(home)!r}
            out["home"] = outcome(lambda: resolve_model_dir("tiny-org/tiny-llama"))
            out["home_missing"] = outcome(lambda: resolve_model_dir("tiny-org/not-cached"))
            print(json.dumps(out))
        """,
            {
                "HF_HOME": str(tmp_path / "import-home"),
                "HF_ENDPOINT": f"http://{host}:{port}",
            },
            first=_IMPORT_HUB_FIRST,
        )
        log = list(server.log)
    assert result["path"] == {"ok": str(snap)}
    assert result["hub_ids"] == result["dir_ids"] and len(result["hub_ids"]) == 8
    assert result["home"] == {"ok": str(snap_home)}
    for key, cache in (("missing", tmp_path / "hub"), ("home_missing", home / "hub")):
        err = result[key]
        assert err["error"] == "ModelLoadError", err
        assert f"is not in the Hub cache ({cache})" in err["message"]
        assert "HF_HUB_OFFLINE=1" in err["message"]
    assert log == []  # offline: the Hub was never contacted


@pytest.mark.slow  # fresh Python processes
def test_hf_endpoint_set_after_huggingface_hub_was_imported(tiny: Path, tmp_path: Path) -> None:
    repo = repo_from_dir("tiny-org/tiny-llama", tiny)
    cache = tmp_path / "cache"
    with serve_hub(repo) as server:
        host, port = server.server_address[:2]
        result, _ = _run(
            f"""
            os.environ["HF_ENDPOINT"] = "http://{host}:{port}"
            os.environ["HF_HUB_CACHE"] = {str(cache)!r}
            out = {{"path": outcome(lambda: resolve_model_dir("tiny-org/tiny-llama"))}}
            os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"
            out["unreachable"] = outcome(lambda: nb.Engine("tiny-org/other"))
            print(json.dumps(out))
        """,
            {
                # At import: an endpoint that refuses connections and another cache.
                "HF_ENDPOINT": "http://127.0.0.1:9",
                "HF_HUB_CACHE": str(tmp_path / "import-cache"),
                "HF_HUB_ETAG_TIMEOUT": "2",
                "HF_HUB_DOWNLOAD_TIMEOUT": "2",
            },
            first=_IMPORT_HUB_FIRST,
        )
        log = list(server.log)
    snap = Path(result["path"]["ok"])
    assert snap == cache / "models--tiny-org--tiny-llama" / "snapshots" / repo.commit
    assert (snap / "model.safetensors").is_file()
    assert any("/resolve/" in path for _, path in log)
    err = result["unreachable"]
    assert err["error"] == "ModelLoadError", err
    assert "Cannot reach the Hugging Face Hub (http://127.0.0.1:9)" in err["message"]
    assert f"not in the Hub cache ({cache})" in err["message"]


@pytest.mark.slow  # fresh Python processes
def test_hf_hub_offline_unset_after_import_says_huggingface_hub_stays_offline(
    tmp_path: Path,
) -> None:
    result, _ = _run(
        """
        del os.environ["HF_HUB_OFFLINE"]
        print(json.dumps({"e": outcome(lambda: resolve_model_dir("tiny-org/tiny"))}))
    """,
        {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "c")},
        first=_IMPORT_HUB_FIRST,
    )
    err = result["e"]
    assert err["error"] == "ModelLoadError", err
    assert "huggingface_hub was imported while HF_HUB_OFFLINE was set" in err["message"]
    assert str(tmp_path / "c") in err["message"]


_PRECEDENCE_CASES: list[dict[str, str]] = [
    {},
    {"HF_HOME": "/h"},
    {"XDG_CACHE_HOME": "/xdg"},
    {"XDG_CACHE_HOME": "/xdg", "HF_HOME": "~/h"},
    {"HF_HOME": "/h", "HUGGINGFACE_HUB_CACHE": "/legacy"},
    {"HF_HOME": "/h", "HUGGINGFACE_HUB_CACHE": "/legacy", "HF_HUB_CACHE": "/c"},
    {"HF_HUB_CACHE": "$NBE_ROOT/c", "NBE_ROOT": "/r"},
    {"HF_HUB_OFFLINE": "yes"},
    {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "1"},
    {"TRANSFORMERS_OFFLINE": "On"},
    {"HF_HUB_OFFLINE": "2"},
    {"HF_ENDPOINT": "http://mirror.example:8080/"},
]


@pytest.mark.slow  # fresh Python processes
def test_hub_settings_follow_huggingface_hubs_own_precedence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What hub_settings reads from an environment is what huggingface_hub itself makes
    of that environment when it is imported with it."""
    from nbengine.model.hub import hub_settings

    probe = (
        "import json; from huggingface_hub import constants as c; "
        "print(json.dumps([c.HF_HUB_CACHE, c.ENDPOINT, c.HF_HUB_OFFLINE]))"
    )
    for case in _PRECEDENCE_CASES:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "XDG_"))
        }
        env.update(case)  # HOME as here: "~" means the same in both
        proc = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        cache, endpoint, offline = json.loads(proc.stdout)
        with monkeypatch.context() as m:
            for key in set(os.environ) - set(env):
                m.delenv(key)
            for key, value in case.items():
                m.setenv(key, value)
            ours = hub_settings()
        assert (str(ours.cache_dir), ours.endpoint, ours.offline) == (cache, endpoint, offline), (
            case
        )
