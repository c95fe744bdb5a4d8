"""The server serves each LoRA adapter as a ``model`` and lists them in /v1/models
(``engine.serve(lora_modules=...)``, ``nbengine serve --lora-modules``; docs/lora.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from lora_setup import N_NEW, PROMPTS, hf_greedy, make_adapter, tiny  # noqa: E402

import nbengine as nb  # noqa: E402


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, object]:
    root = tmp_path_factory.mktemp("lora-server")
    base = tiny(root / "base", "llama")
    path, model = make_adapter(base, root / "a", "llama", seed=31)
    return base, path, model


def _body(model: str) -> dict[str, object]:
    return {
        "model": model,
        "prompt": PROMPTS[0],
        "max_tokens": N_NEW,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def test_serve_lora_modules(adapters: tuple[Path, Path, object]) -> None:
    base, path, model = adapters
    with nb.Engine(base, dtype="float32", enable_lora=True, num_kv_blocks=64) as engine:
        ids = list(engine.tokenizer.encode(PROMPTS[0]))
        with engine.serve(port=0, model_name="base", lora_modules={"tuned": str(path)}) as srv:
            listed = httpx.get(f"{srv.url}/models").json()["data"]
            assert [m["id"] for m in listed] == ["base", "tuned"]
            assert listed[1]["parent"] == "base"
            r = httpx.post(f"{srv.url}/completions", json=_body("tuned"), timeout=60).json()
            assert r["model"] == "tuned"
            tuned_text = r["choices"][0]["text"]
            assert tuned_text == engine.tokenizer.decode(hf_greedy(model, ids))
            plain = httpx.post(f"{srv.url}/completions", json=_body("base"), timeout=60).json()
            assert plain["model"] == "base" and plain["choices"][0]["text"] != tuned_text
            missing = httpx.post(f"{srv.url}/completions", json=_body("nope"), timeout=60)
            assert missing.status_code == 404
        assert engine.list_loras() == {1}


def test_serve_cli_lora_modules(adapters: tuple[Path, Path, object]) -> None:
    base, path, _ = adapters
    cmd = [sys.executable, "-m", "nbengine", "serve", str(base), "--port", "0"]
    cmd += ["--served-model-name", "tiny", "--lora-modules", f"t={path}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()  # printed once the server listens
        assert line.startswith("nbengine: serving 'tiny'"), line + proc.stderr.read()
        url = line.rsplit(" ", 1)[1].strip()
        assert [m["id"] for m in httpx.get(url + "/models").json()["data"]] == ["tiny", "t"]
        r = httpx.post(url + "/completions", json=_body("t"), timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "t"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_cli_refuses_a_malformed_lora_module() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "nbengine", "serve", "--lora-modules", "nopath"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert r.returncode == 2
    assert "--lora-modules: expected NAME=PATH, got 'nopath'" in r.stderr
