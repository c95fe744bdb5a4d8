"""The CTranslate2 peer of ``nbengine bench`` (optional: ``pip install ctranslate2``, in the
``bench`` extra, not in the test dependencies; skipped where it is not installed)."""

from __future__ import annotations

from pathlib import Path

import pytest

import nbengine as nb
from nbengine.bench.engines import CT2Driver
from nbengine.bench.workloads import Workload
from nbengine.testing import make_tiny_model

pytest.importorskip("ctranslate2")


def test_ct2_driver_generates_nbengine_greedy_tokens(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "llama", arch="llama", hidden_size=64, intermediate_size=128)
    wl = Workload("W", [[5, 6, 7, 8], [9, 10], [11, 12, 13]], [5, 3, 4], None)
    driver = CT2Driver(path, "bfloat16", batch_size=2)
    res = driver.run(wl)
    assert res.error is None and res.output_tokens == 12 and len(res.ttft_s) == 3
    assert "length_mismatches" not in res.extra and res.extra["compute_type"] == "float32"
    # The converted model decodes as nbengine does (float32, greedy).
    got = driver.generator.generate_batch(
        [[driver.tokens[i] for i in p] for p in wl.prompts],
        max_length=5,
        min_length=5,
        sampling_topk=1,
        include_prompt_in_result=False,
    )
    with nb.LLM(str(path), dtype="float32", num_kv_blocks=16) as llm:
        want = llm.generate(
            wl.prompts,
            nb.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
            use_tqdm=False,
        )
    assert [r.sequences_ids[0] for r in got] == [list(o.outputs[0].token_ids) for o in want]
