"""``nbengine bench --lora N``: W1 again over N random rank-16 adapters (docs/lora.md,
docs/benchmarks.md); here on a tiny model, for what it produces, not its speed."""

from __future__ import annotations

from pathlib import Path

from nbengine.bench.engines import LORA_RANK, NbengineDriver
from nbengine.bench.report import targets
from nbengine.bench.workloads import bench_lora_adapters, make_workloads
from nbengine.lora.adapter import read_adapter
from nbengine.lora.request import LoRARequest
from nbengine.testing import make_tiny_model


def test_bench_runs_w1_over_lora_adapters(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", "llama")
    dirs = bench_lora_adapters(model, 2, LORA_RANK)
    assert len(dirs) == 2 and dirs == bench_lora_adapters(model, 2, LORA_RANK)  # cached
    spec = read_adapter(LoRARequest("x", 1, str(dirs[0])), dirs[0], LORA_RANK)
    assert spec.rank == LORA_RANK and len(spec.modules) == 2 * 7  # 2 layers x 7 projections
    (wl,) = make_workloads(["W1"], vocab=400, scale=0.05).values()
    driver = NbengineDriver(model, "float32", {"num_kv_blocks": 128})
    base = driver.run(wl)
    lora = driver.run(wl, lora_adapters=2)
    assert lora.error is None and lora.output_tokens == base.output_tokens == wl.num_output_tokens
    t = targets({"W1": {"nbengine": {"wall_s": 2.0}, "nbengine_lora": {"wall_s": 2.4}}})
    ratio = t["W1 wall time over LoRA adapters / base (at most)"]
    assert abs(ratio["value"] - 1.2) < 1e-9 and ratio["pass"] is True
