"""The scheduler runs requests of at most ``max_loras`` distinct adapters at a time; the
others wait in their places (docs/lora.md, "Scheduling"), and the prefix cache keys
blocks by the adapter's load."""

from __future__ import annotations

import time

from nbengine.config import EngineConfig
from nbengine.core.kv_cache import salt_root
from nbengine.core.request import Request
from nbengine.core.scheduler import Scheduler
from nbengine.sampling_params import SamplingParams


def _request(key: str, lora: int) -> Request:
    return Request(
        request_id=key,
        prompt_token_ids=[1, 2, 3, 4, 5],
        sampling_params=SamplingParams(max_tokens=4),
        eos_token_ids=frozenset(),
        arrival_time=time.monotonic(),
        lora_int_id=lora,
        lora_key=f"{lora}:1" if lora else None,
    )


def _scheduled(s: Scheduler) -> list[str]:
    return [c.request.request_id for c in s.schedule().chunks]


def test_requests_of_more_adapters_than_max_loras_wait() -> None:
    config = EngineConfig.from_kwargs(enable_lora=True, max_loras=2)
    s = Scheduler(config, num_kv_blocks=64, block_size=4, max_model_len=64)
    for key, lora in [("a1", 1), ("b1", 2), ("c1", 3), ("base", 0), ("a2", 1), ("c2", 3)]:
        s.add_request(_request(key, lora))
    assert sorted(_scheduled(s)) == ["a1", "a2", "b1", "base"]
    assert [r.request_id for r in s.waiting] == ["c1", "c2"]  # still in arrival order
    # adapter 2's request finishes: adapter 3's requests may start
    s.finish_requests(["b1"], s.requests["b1"].status.FINISHED_ABORTED)
    assert {"c1", "c2"} <= set(_scheduled(s))


def test_adapter_loads_key_the_prefix_cache_apart() -> None:
    roots = {salt_root(None), salt_root(None, "1:1"), salt_root(None, "1:2"), salt_root("t", "1:1")}
    roots |= {salt_root("t")}
    assert len(roots) == 5
