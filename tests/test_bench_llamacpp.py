"""The llama.cpp peer of ``nbengine bench`` (llama-cpp-python: in the ``bench`` extra, which
compiles llama.cpp from source, so not in the test dependencies).

Not a required test (tests/support/required_tests.py): CI installs ``.[dev,ray]`` only, so
these skip there by design, and run wherever the bench extra is installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import nbengine as nb
from nbengine.bench.workloads import Workload
from nbengine.testing import make_tiny_model

pytest.importorskip(
    "llama_cpp",
    reason="llama-cpp-python is not installed: an optional bench peer (pip install -e "
    "'.[bench]'), not a required test",
)

from nbengine.bench.gguf import gguf_type  # after the skip, as the driver it serves
from nbengine.bench.llamacpp import CHECK_TOKENS, LlamaCppDriver  # it needs llama_cpp

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("llamacpp") / "llama",
        arch="llama",
        hidden_size=128,
        intermediate_size=256,
    )


def _nbengine_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    with nb.LLM(str(path), dtype="float32", num_kv_blocks=32) as llm:
        outs = llm.generate(
            prompts,
            nb.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
            use_tqdm=False,
        )
    return [list(o.outputs[0].token_ids) for o in outs]


def test_float32_gguf_decodes_as_nbengine_and_transformers(model_dir: Path) -> None:
    # Fewer sequences than requests and a small batch: slots are reused, and prompts are
    # decoded in chunks spread over several steps, next to other sequences' decode tokens.
    driver = LlamaCppDriver(model_dir, "float32", n_batch=8, n_seq_max=2)
    check = driver.info["check"]
    assert check["pass"] and check["leading_tokens_agreeing"] == [CHECK_TOKENS] * 4
    assert min(check["first_logits_correlation"]) > 0.9999
    assert check["first_token_rank_in_reference"] == [0, 0, 0, 0]
    wl = Workload("W", [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [9, 10], [11, 12, 13]], [5, 3, 4])
    res = driver.run(wl)
    assert res.error is None and res.output_tokens == 12 and res.prompt_tokens == 15
    assert len(res.ttft_s) == 3 and len(res.itl_s) == 12 - 3
    assert "length_mismatches" not in res.extra and res.extra["gguf_type"] == "f32"
    assert res.extra["n_threads"] >= 1 and res.extra["num_steps"] >= 5
    seqs, _ = driver.model.generate(wl.prompts, [5, 5, 5], 8, 2, True)
    assert [s.tokens for s in seqs] == _nbengine_greedy(model_dir, wl.prompts, 5)
    # The other KV layout (a stream per sequence) decodes the same tokens.
    seqs2, _ = driver.model.generate(wl.prompts, [5, 5, 5], 8, 2, False)
    assert [s.tokens for s in seqs2] == [s.tokens for s in seqs]


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_each_precision_is_converted_checked_and_recorded(
    model_dir: Path, quantization: str | None
) -> None:
    driver = LlamaCppDriver(model_dir, "bfloat16", quantization)
    gtype = gguf_type("bfloat16", quantization)
    assert driver.gguf.name == f"model-{gtype}.gguf" and driver.gguf.is_file()
    cached = json.loads(driver.gguf.with_name(f"check-{gtype}.json").read_text())
    assert cached["use_extra_bufts"] == driver.info["use_extra_bufts"]
    assert driver.info["check"]["pass"]
    res = driver.run(Workload("W", [[3, 4, 5, 6]], [6]))
    assert res.output_tokens == 6 and res.extra["gguf_type"] == gtype
    assert isinstance(res.extra["turned_off"], list)


def test_gguf_type_follows_the_bench_precision() -> None:
    assert gguf_type("bfloat16", None) == "bf16" and gguf_type("float32", None) == "f32"
    assert gguf_type("bfloat16", "int8") == "q8_0"
    assert gguf_type("bfloat16", "int4") == gguf_type("bfloat16", "int4-g32") == "q4_0"
    with pytest.raises(ValueError, match="quantization"):
        gguf_type("bfloat16", "int3")
    with pytest.raises(ValueError, match="dtype"):
        gguf_type("float16", None)
