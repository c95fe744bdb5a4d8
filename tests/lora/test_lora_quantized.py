"""Adapters on bfloat16 and int8/int4 bases (the adapter in float32), through the native
kernels and the decode plan (docs/lora.md, "Cost"): every decode step under an adapter
must carry its delta. The check: each token generated under the adapter equals what a
fresh prefill of the text so far (the module path, never the plan) predicts under it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from lora_setup import make_adapter

import nbengine as nb
from nbengine.model import DEFAULT_MODEL_DIR

N = 10
P = nb.SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
ONE = nb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = make_adapter(DEFAULT_MODEL_DIR, tmp_path_factory.mktemp("q") / "a", "llama", seed=1)
    return path


@pytest.fixture(params=[None, "int8", "int4"])
def engine(request: pytest.FixtureRequest) -> Iterator[nb.Engine]:
    kw = {} if request.param is None else {"quantization": request.param}
    e = nb.Engine(dtype="bfloat16", enable_lora=True, enable_prefix_caching=False, **kw)
    try:
        yield e
    finally:
        e.shutdown()


def test_every_decode_step_carries_the_delta(engine: nb.Engine, adapter: Path) -> None:
    req = nb.LoRARequest("a", 1, str(adapter))
    ids = list(engine.tokenizer.encode("Once upon a time"))
    base = engine.generate(ids, P).result(timeout=120).outputs[0].token_ids
    gen = engine.generate(ids, P, lora_request=req).result(timeout=120).outputs[0].token_ids
    assert gen != base  # the adapter matters
    forced = [
        engine.generate(ids + gen[:k], ONE, lora_request=req).result(timeout=120) for k in range(N)
    ]
    assert [o.outputs[0].token_ids[0] for o in forced] == gen
    # and base requests after it are the base model's again (the hooks hold no state)
    assert engine.generate(ids, P).result(timeout=120).outputs[0].token_ids == base
