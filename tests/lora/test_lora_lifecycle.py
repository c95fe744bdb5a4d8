"""Adapters in the request lifecycle: removal while in use, abort, id reuse, more adapters
in flight than ``max_loras``, and the adapter's name where a user looks (docs/lora.md)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from lora_setup import N_NEW, PROMPTS, hf_greedy, make_adapter, tiny

import nbengine as nb
from nbengine.frontend.lora import LoRAInUseError
from nbengine.model.errors import ModelLoadError
from nbengine.testing import make_hub_cache

from support.requests import wait_until

GREEDY = nb.SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
LONG = nb.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


class Setup:
    def __init__(self, root: Path) -> None:
        self.base = tiny(root / "base", "llama")
        self.adapters = [
            make_adapter(self.base, root / f"ad{i}", "llama", seed=20 + i) for i in range(3)
        ]

    def request(self, i: int, int_id: int | None = None) -> nb.LoRARequest:
        return nb.LoRARequest(f"ad{i}", int_id or i + 1, str(self.adapters[i][0]))

    def ref(self, i: int, ids: list[int]) -> list[int]:
        return hf_greedy(self.adapters[i][1], ids)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return Setup(tmp_path_factory.mktemp("lora-life"))


@pytest.fixture
def engine(setup: Setup) -> Iterator[nb.Engine]:
    e = nb.Engine(
        setup.base, dtype="float32", enable_lora=True, max_loras=1, block_size=4, num_kv_blocks=256
    )
    try:
        yield e
    finally:
        e.shutdown()


def _wait_running(h: nb.RequestHandle) -> None:
    deadline = time.monotonic() + 60  # a hang guard only
    while h.status.name in ("QUEUED", "WAITING") and time.monotonic() < deadline:
        time.sleep(0.01)


def test_remove_while_in_use_is_refused_then_allowed_after_abort(
    engine: nb.Engine, setup: Setup
) -> None:
    req = setup.request(0)
    h = engine.generate(PROMPTS[0], LONG, lora_request=req, request_id="r")
    _wait_running(h)
    with pytest.raises(LoRAInUseError, match="used by 1 waiting or running request"):
        engine.remove_lora(1)
    assert engine.list_loras() == {1}
    engine.abort("r", timeout=60)
    assert engine.remove_lora(1)
    assert engine.list_loras() == set()
    assert not engine.remove_lora(1)
    # the id may be reused by the same request id and the same adapter id afterwards
    out = engine.generate(PROMPTS[0], GREEDY, lora_request=req, request_id="r").result(timeout=120)
    ids = list(engine.tokenizer.encode(PROMPTS[0]))
    assert out.outputs[0].token_ids == setup.ref(0, ids)


def test_waiting_requests_also_hold_their_adapter(engine: nb.Engine, setup: Setup) -> None:
    """max_loras=1: a request under a second adapter waits; removing that adapter is
    refused while it waits."""
    first = engine.generate(PROMPTS[0], LONG, lora_request=setup.request(0))
    _wait_running(first)
    second = engine.generate(PROMPTS[1], GREEDY, lora_request=setup.request(1))
    with pytest.raises(LoRAInUseError):
        engine.remove_lora(2)
    first.cancel()
    second.result(timeout=120)
    assert engine.remove_lora(2)


def test_adapter_id_reused_for_another_adapter(engine: nb.Engine, setup: Setup) -> None:
    """Id 1 is adapter 0, then (after removal) adapter 1: the second run gets adapter 1's
    output, never adapter 0's prefix-cache blocks."""
    ids = list(engine.tokenizer.encode(PROMPTS[2]))
    out0 = engine.generate(ids, GREEDY, lora_request=setup.request(0, 1)).result(timeout=120)
    assert out0.outputs[0].token_ids == setup.ref(0, ids)
    assert engine.remove_lora(1)
    out1 = engine.generate(ids, GREEDY, lora_request=setup.request(1, 1)).result(timeout=120)
    assert out1.outputs[0].token_ids == setup.ref(1, ids)
    assert out1.num_cached_tokens == 0


def test_more_adapters_in_flight_than_max_loras_queue(engine: nb.Engine, setup: Setup) -> None:
    """max_loras=1 with three adapters and the base in flight: each request runs under
    its own adapter (those of others wait), and all match PEFT."""
    tok = engine.tokenizer
    plan = [(i % 3, PROMPTS[i % 3]) for i in range(6)]
    handles = engine.generate_many(
        [p for _, p in plan], [GREEDY] * len(plan), [setup.request(i) for i, _ in plan]
    )
    base = engine.generate(PROMPTS[0], GREEDY)
    got = [h.result(timeout=120).outputs[0].token_ids for h in handles]
    assert got == [setup.ref(i, list(tok.encode(p))) for i, p in plan]
    assert len(base.result(timeout=120).outputs[0].token_ids) == N_NEW


def test_adapter_name_in_request_stats_and_handle(engine: nb.Engine, setup: Setup) -> None:
    req = setup.request(0)
    h = engine.generate(PROMPTS[0], GREEDY, lora_request=req, request_id="with")
    plain = engine.generate(PROMPTS[0], GREEDY, request_id="without")
    h.result(timeout=120)
    plain.result(timeout=120)
    assert h.lora_request is req and plain.lora_request is None
    df = engine.request_stats()
    rows = dict(zip(df["request_id"], df["lora"]))
    assert rows["with"] == "ad0"
    assert pd.isna(rows["without"])


def test_handle_widget_and_dashboard_name_the_adapter(engine: nb.Engine, setup: Setup) -> None:
    dash = engine.dashboard()
    with_lora = engine.generate(PROMPTS[0], LONG, lora_request=setup.request(0), request_id="w")
    plain = engine.generate(PROMPTS[0], LONG, request_id="p")
    try:
        assert "nbengine-lora" in with_lora.widget().title.value
        assert "ad0" in with_lora.widget().title.value
        assert "nbengine-lora" not in plain.widget().title.value

        def cell(rid: str) -> str | None:
            return next((r.id_cell.value for r in dash.rows if r.request_id == rid), None)

        wait_until(lambda: cell("w") is not None and cell("p") is not None, what="both rows")
        w, p = cell("w"), cell("p")
        assert w is not None and "nbengine-lora" in w and "ad0" in w
        assert p is not None and "nbengine-lora" not in p
    finally:
        with_lora.cancel()
        plain.cancel()


def test_adapter_by_hub_id_from_the_hub_cache(
    engine: nb.Engine, setup: Setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hub id resolves through model/hub.py: the Hub cache, offline here."""
    cache = tmp_path / "hub"
    make_hub_cache(cache, "someone/tiny-lora", setup.adapters[0][0])
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    req = nb.LoRARequest("hub", 1, "someone/tiny-lora")
    ids = list(engine.tokenizer.encode(PROMPTS[1]))
    out = engine.generate(ids, GREEDY, lora_request=req).result(timeout=120)
    assert out.outputs[0].token_ids == setup.ref(0, ids)
    with pytest.raises(ModelLoadError, match="not in the Hub cache"):
        engine.add_lora(nb.LoRARequest("gone", 2, "someone/missing-lora"))
    assert engine.list_loras() == {1}
