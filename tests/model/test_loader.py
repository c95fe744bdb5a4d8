"""Loading model directories: what works, and the errors a broken directory gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nbengine.config import ModelConfig
from nbengine.model import (
    SUPPORTED_ARCHITECTURES,
    ModelLoadError,
    Tokenizer,
    load_model,
    resolve_model_dir,
)
from nbengine.testing import ARCHS, make_tiny_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_tiny_model_and_tokenizer(arch: str, tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / arch, arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert type(hf).__name__ == json.loads((path / "config.json").read_text())["architectures"][0]
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    ours = Tokenizer.from_dir(path)
    text = "Once upon a time, the dog said hello 42 times!"
    ids = ours.encode(text)
    assert hf_tok(text).input_ids == ids
    assert ours.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True) == text
    assert ours.vocab_size == len(hf_tok) and 300 <= ours.vocab_size <= 1000
    assert hf_tok.eos_token_id in ours.eos_token_ids
    if arch in ("llama", "mistral"):
        assert ids[0] == ours.bos_token_id  # the post-processor adds <s>
        assert ours.encode(text, add_special_tokens=False) == ids[1:]
    assert all(ours.convert_ids_to_tokens([i])[0] for i in ids)


def test_make_tiny_model_config_overrides_and_determinism(tmp_path: Path) -> None:
    a = make_tiny_model(
        tmp_path / "a",
        "qwen3",
        seed=3,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    b = make_tiny_model(
        tmp_path / "b",
        "qwen3",
        seed=3,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    cfg = json.loads((a / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (32, 3, 8)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert wa["model.layers.2.self_attn.k_proj.weight"].shape == (8, 32)
    c = make_tiny_model(
        tmp_path / "c",
        "qwen3",
        seed=4,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    assert not torch.equal(
        load_file(c / "model.safetensors")["model.norm.weight"], wa["model.norm.weight"]
    )


def test_loaded_model_fields(llama_dir: Path) -> None:
    lm = load_model(ModelConfig(model=llama_dir, dtype="auto"))
    assert lm.architecture == "LlamaForCausalLM"
    assert lm.dtype == torch.float32  # "auto" resolves to float32 on CPU
    assert lm.max_model_len == 256 and lm.vocab_size == 400
    assert lm.eos_token_ids == frozenset({lm.tokenizer.backend.token_to_id("</s>")})
    assert load_model(ModelConfig(model=llama_dir, max_model_len=100)).max_model_len == 100
    bf = load_model(ModelConfig(model=str(llama_dir), dtype="bfloat16"))
    assert bf.dtype == torch.bfloat16 and bf.model.embed_tokens.weight.dtype == torch.bfloat16


def test_sharded_checkpoint_loads_identically(llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(llama_dir, tmp_path / "sharded")
    weights = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    names = sorted(weights)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for fname, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(d / fname), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    a = load_model(ModelConfig(model=llama_dir)).model.state_dict()
    b = load_model(ModelConfig(model=d)).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_directory_and_default_model(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(ModelConfig(model=tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        resolve_model_dir(tmp_path / "file")


def test_missing_config_json(llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(llama_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="No config.json"):
        load_model(ModelConfig(model=d))


def test_missing_weights(llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="No weights"):
        load_model(ModelConfig(model=d))


def test_missing_tokenizer(llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(llama_dir, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_model(ModelConfig(model=d))


def test_missing_tensor_is_named(llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(llama_dir, tmp_path / "m")
    w = load_file(d / "model.safetensors")
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_model(ModelConfig(model=d))


def test_wrong_shape_is_named(llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError, match=r"gate_proj\.weight.*shape \(128, 64\), expected \(96, 64\)"
    ):
        load_model(ModelConfig(model=d))


def test_unsupported_architecture_lists_supported(llama_dir: Path, tmp_path: Path) -> None:
    d = _copy(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="FalconForCausalLM") as e:
        load_model(ModelConfig(model=d))
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


def test_max_model_len_beyond_model_rejected(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len=1000"):
        load_model(ModelConfig(model=llama_dir, max_model_len=1000))


def test_sliding_window_keeps_max_model_len_and_names_the_kv_window(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "m", "mistral", sliding_window=64)
    loaded = load_model(ModelConfig(model=d))
    assert loaded.max_model_len == 256 and loaded.kv_sliding_window == 64
    d2 = make_tiny_model(tmp_path / "m2", "mistral", sliding_window=None)
    loaded2 = load_model(ModelConfig(model=d2))
    assert loaded2.max_model_len == 256 and loaded2.kv_sliding_window is None
    # Qwen2 windows only the layers from max_window_layers on: no block can be freed.
    d3 = make_tiny_model(
        tmp_path / "q", "qwen2", use_sliding_window=True, sliding_window=16, num_hidden_layers=3
    )
    cfg = json.loads((d3 / "config.json").read_text())
    cfg["max_window_layers"] = 1
    (d3 / "config.json").write_text(json.dumps(cfg))
    loaded3 = load_model(ModelConfig(model=d3))
    assert loaded3.model.layer_windows == (None, 16, 16) and loaded3.kv_sliding_window is None


def test_gpt2_checkpoint_without_transformer_prefix(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "g", "gpt2")
    ref = load_model(ModelConfig(model=d)).model.state_dict()
    w = load_file(d / "model.safetensors")
    save_file(
        {k.removeprefix("transformer."): v for k, v in w.items()}, str(d / "model.safetensors")
    )
    got = load_model(ModelConfig(model=d)).model.state_dict()
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_default_model_dir_resolution() -> None:
    from nbengine.model import DEFAULT_MODEL_DIR

    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        assert resolve_model_dir(None) == DEFAULT_MODEL_DIR
    else:
        with pytest.raises(FileNotFoundError, match="default model"):
            resolve_model_dir(None)


def _edit_config(path: Path, **changes: object) -> Path:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_unsupported_gemma_activation_and_bad_longrope_are_named(tmp_path: Path) -> None:
    d = _edit_config(
        make_tiny_model(tmp_path / "g", "llama"),
        architectures=["Gemma2ForCausalLM"],
        head_dim=16,
        hidden_activation="relu",
    )
    with pytest.raises(ModelLoadError, match="hidden_activation 'relu'"):
        load_model(ModelConfig(model=d))
    d2 = _edit_config(
        make_tiny_model(tmp_path / "p", "llama"),
        architectures=["Phi3ForCausalLM"],
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.0],
            "long_factor": [1.0, 1.0],
            "original_max_position_embeddings": 64,
        },
    )
    with pytest.raises(ModelLoadError, match="longrope factors"):
        load_model(ModelConfig(model=d2))
    d3 = _edit_config(
        make_tiny_model(tmp_path / "r", "llama"), rope_scaling={"rope_type": "mrope", "factor": 2.0}
    )
    with pytest.raises(ModelLoadError, match="'mrope'"):
        load_model(ModelConfig(model=d3))
