"""Router: least-loaded placement, prefix affinity, n>1 grouping, lost replicas (no Ray needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nbengine.core.messages import StepStats
from nbengine.distributed.router import Router, parent_key


def _stats(used: int, total: int = 100) -> StepStats:
    return StepStats(
        step=1,
        start_time=0.0,
        duration_s=0.0,
        num_requests=1,
        num_prefill_tokens=0,
        num_decode_tokens=1,
        num_running=1,
        num_waiting=0,
        kv_blocks_used=used,
        kv_blocks_total=total,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
    )


def test_parent_key_groups_children_only() -> None:
    assert parent_key("a#3.1") == "a#3" and parent_key("a#3") == "a#3"
    assert parent_key("x.y#12.0") == "x.y#12" and parent_key("x.y#12") == "x.y#12"
    assert parent_key("p#q#7.2") == "p#q#7"


def test_new_requests_go_to_the_least_loaded_replica() -> None:
    r = Router(3, block_size=4, prefix_aware=False)
    placed = [r.route(f"r{i}#1", [1, 2]) for i in range(6)]
    assert sorted(placed) == [0, 0, 1, 1, 2, 2]
    r.on_finished(placed[0], ["r0#1"])
    assert r.route("new#1", [1]) == placed[0]  # the one that freed a slot
    # Equal counts: the lower KV usage wins.
    r2 = Router(2, block_size=4, prefix_aware=False)
    r2.on_step(0, _stats(90))
    r2.on_step(1, _stats(10))
    assert r2.route("a#1", [1]) == 1


def test_n_children_share_a_replica() -> None:
    r = Router(2, block_size=4, prefix_aware=False)
    r.route("busy#1", [1])
    kids = [r.route(f"req#2.{i}", [1, 2]) for i in range(4)]
    assert len(set(kids)) == 1
    assert r.split([f"req#2.{i}" for i in range(4)]) == {kids[0]: [f"req#2.{i}" for i in range(4)]}


def test_prefix_affinity_until_overloaded() -> None:
    r = Router(2, block_size=4, prefix_aware=True, prefix_slack=2)
    shared = [7, 8, 9, 10]
    first = r.route("p0#1", shared + [1])
    # The same first block follows its replica while it is at most 2 ahead...
    assert [r.route(f"p{i}#1", shared + [i]) for i in range(1, 3)] == [first, first]
    # ...then load wins.
    assert r.route("p3#1", shared + [3]) != first
    assert r.loads()[first]["prefix_hits"] == 2
    # Short prompts (under one block) are placed by load alone.
    assert r.route("short#1", [7, 8]) != first


def test_dead_replica_gets_nothing_and_returns_its_keys() -> None:
    r = Router(2, block_size=4)
    a = r.route("a#1", [1])
    b = r.route("b#1", [2])
    assert {a, b} == {0, 1}
    assert r.mark_dead(a) == {"a#1"}
    assert r.replica_of("a#1") is None and r.split(["a#1", "b#1"]) == {b: ["b#1"]}
    assert {r.route(f"c{i}#1", [3]) for i in range(3)} == {b}
    r.mark_dead(b)
    with pytest.raises(RuntimeError, match="No live replica"):
        r.route("d#1", [1])
    r.mark_alive(a)
    assert r.route("d#1", [1]) == a


def test_default_backend_never_imports_ray() -> None:
    code = (
        "import sys, nbengine, nbengine.distributed, nbengine.core.client\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_metrics_replica_column() -> None:
    from nbengine.metrics import REQUEST_COLUMNS, MetricsLog

    log = MetricsLog()
    log.on_request("a#1", "a", 3, 0.0)
    log.on_request("b#2", "b", 3, 0.0)
    log.on_replica("a#1", 1)
    log.on_replica("unknown#9", 0)  # ignored
    df = log.request_stats()
    assert "replica" in REQUEST_COLUMNS and str(df["replica"].dtype) == "Int64"
    assert df["replica"].iloc[0] == 1 and df["replica"].isna().iloc[1]


def test_backend_choice_is_checked(tmp_path: object) -> None:
    from pathlib import Path

    import nbengine as nb
    from nbengine.testing import make_tiny_model

    model = make_tiny_model(
        Path(str(tmp_path)) / "m",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with pytest.raises(ValueError, match="backend must be one of"):
        nb.Engine(str(model), backend="mpi")
    with pytest.raises(TypeError, match="data_parallel_size only apply to backend='ray'"):
        nb.Engine(str(model), data_parallel_size=2)
    with nb.Engine(str(model), num_kv_blocks=64) as eng:
        (health,) = eng.replicas()
        assert health["alive"] and health["backend"] == "inproc"
        with pytest.raises(NotImplementedError, match="backend='ray'"):
            eng.restart_replica(0)
