"""Adapters that cannot run are refused at the call, naming the field, and leave nothing
loaded (docs/lora.md, "Errors")."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from lora_setup import make_adapter, tiny

import nbengine as nb
from nbengine.testing import make_tiny_model

P = nb.SamplingParams(max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora-errors")


@pytest.fixture(scope="module")
def base(root: Path) -> Path:
    return tiny(root / "base", "llama")


@pytest.fixture(scope="module")
def engine(base: Path) -> Iterator[nb.Engine]:
    e = nb.Engine(base, dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    try:
        yield e
    finally:
        e.shutdown()


def _refused(engine: nb.Engine, req: nb.LoRARequest, *words: str) -> None:
    for call in (
        lambda: engine.generate("hello", P, lora_request=req),
        lambda: engine.add_lora(req),
    ):
        with pytest.raises(ValueError) as info:
            call()
        for w in words:
            assert w in str(info.value), str(info.value)
    assert engine.list_loras() == set()
    assert not engine.has_unfinished_requests()


def test_rank_above_max_lora_rank(engine: nb.Engine, base: Path, root: Path) -> None:
    path, _ = make_adapter(base, root / "r16", "llama", seed=3, r=16)
    _refused(engine, nb.LoRARequest("big", 1, str(path)), "r is 16", "max_lora_rank=8")


def test_target_module_the_engine_cannot_adapt(engine: nb.Engine, base: Path, root: Path) -> None:
    path, _ = make_adapter(base, root / "head", "llama", seed=4, target_modules=["lm_head"])
    _refused(engine, nb.LoRARequest("head", 1, str(path)), "target_modules", "lm_head")


def test_adapter_of_another_base_model(engine: nb.Engine, root: Path) -> None:
    other = make_tiny_model(root / "other", "llama", hidden_size=32, intermediate_size=64)
    path, _ = make_adapter(other, root / "other-a", "llama", seed=5)
    _refused(engine, nb.LoRARequest("other", 1, str(path)), "base model")


def test_adapter_of_a_deeper_base_model(engine: nb.Engine, root: Path) -> None:
    deeper = make_tiny_model(root / "deeper", "llama", num_hidden_layers=3)
    path, _ = make_adapter(deeper, root / "deeper-a", "llama", seed=6)
    _refused(engine, nb.LoRARequest("deeper", 1, str(path)), "base model", "layers.2")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_dora", True),
        ("bias", "all"),
        ("modules_to_save", ["lm_head"]),
        ("peft_type", "PREFIX_TUNING"),
        ("r", 0),
        ("lora_alpha", "big"),
    ],
)
def test_config_fields_nbengine_cannot_apply(
    engine: nb.Engine, base: Path, root: Path, field: str, value: object
) -> None:
    src, _ = make_adapter(base, root / f"ok-{field}", "llama", seed=7)
    path = root / f"bad-{field}"
    shutil.copytree(src, path)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg[field] = value
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    _refused(engine, nb.LoRARequest("bad", 1, str(path)), field)


def test_missing_files_and_bad_requests(engine: nb.Engine, root: Path) -> None:
    empty = root / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        engine.generate("hi", P, lora_request=nb.LoRARequest("x", 1, str(empty)))
    with pytest.raises(ValueError, match="lora_int_id"):
        nb.LoRARequest("x", 0, str(empty))
    with pytest.raises(TypeError, match="lora_int_id"):
        nb.LoRARequest("x", True, str(empty))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lora_name"):
        nb.LoRARequest("", 1, str(empty))
    with pytest.raises(ValueError, match="lora_path"):
        nb.LoRARequest("x", 1)
    with pytest.raises(TypeError, match="lora_request"):
        engine.generate("hi", P, lora_request="x")  # type: ignore[arg-type]
    assert engine.list_loras() == set()


def test_id_or_name_already_taken(engine: nb.Engine, base: Path, root: Path) -> None:
    a, _ = make_adapter(base, root / "taken-a", "llama", seed=8)
    b, _ = make_adapter(base, root / "taken-b", "llama", seed=9)
    assert engine.add_lora(nb.LoRARequest("a", 1, str(a)))
    try:
        assert not engine.add_lora(nb.LoRARequest("a", 1, str(a)))  # the same: no-op
        with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'a'"):
            engine.generate("hi", P, lora_request=nb.LoRARequest("b", 1, str(b)))
        with pytest.raises(ValueError, match="lora_name 'a'"):
            engine.add_lora(nb.LoRARequest("a", 2, str(b)))
        assert engine.list_loras() == {1}
    finally:
        assert engine.remove_lora(1)


def test_lora_request_without_enable_lora(base: Path, root: Path) -> None:
    path, _ = make_adapter(base, root / "plain", "llama", seed=10)
    req = nb.LoRARequest("a", 1, str(path))
    with nb.Engine(base, dtype="float32", num_kv_blocks=32) as plain:
        for call in (
            lambda: plain.generate("hi", P, lora_request=req),
            lambda: plain.add_lora(req),
            lambda: plain.remove_lora(1),
        ):
            with pytest.raises(ValueError, match="enable_lora=True"):
                call()
        assert not plain.has_unfinished_requests()


def test_engine_lora_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        nb.Engine(enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="max_lora_rank"):
        nb.Engine(enable_lora=True, max_lora_rank=0)
    with pytest.raises(TypeError, match="enable_lora"):
        nb.Engine(enable_lora="yes")
