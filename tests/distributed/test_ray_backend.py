"""backend="ray": two replicas as Ray actors on a two-node local cluster, one frontend here.

One engine serves the whole module (starting replicas costs seconds on 2 cores); the
replica-loss test runs last and ends by restarting the lost replica.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip(
    "ray", reason="backend='ray' tests need Ray (pip install 'nbengine[ray]')", exc_type=ImportError
)

import nbengine as nb  # noqa: E402
from nbengine import RequestOutputKind as Kind  # noqa: E402
from nbengine import RequestStatus as S  # noqa: E402

from support.requests import WAIT_S, long_params, wait_first_token  # noqa: E402
from support.scenarios import abort_and_readd_race  # noqa: E402

ENGINE_KW = dict(num_kv_blocks=512, block_size=16, max_num_seqs=32, max_num_batched_tokens=256)


def replica_of(engine: nb.Engine, h: nb.RequestHandle) -> int:
    """The replica serving ``h`` (from request_stats' replica column: kept after the end)."""
    keys = {c.key for c in h._live.children}  # type: ignore[union-attr]
    stats = engine.request_stats()
    where = set(stats[stats["key"].isin(keys)]["replica"].tolist())
    assert len(where) == 1, where
    (r,) = where
    assert r in (0, 1)
    return int(r)


@pytest.fixture(scope="module")
def engine(ray_cluster: Any, tiny_model: Path) -> Iterator[nb.Engine]:
    eng = nb.Engine(
        str(tiny_model), backend="ray", data_parallel_size=2, routing="least_loaded", **ENGINE_KW
    )
    actors = [r.actor for r in eng._client._replicas]  # type: ignore[attr-defined]
    try:
        yield eng
    finally:
        eng.shutdown()
    assert not eng.is_alive
    assert ray.is_initialized()  # attached to the fixture's cluster: not shut down
    # No actor is left behind: every replica (also a restarted one) is gone...
    actors += [r.actor for r in eng._client._replicas]  # type: ignore[attr-defined]
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.info.remote(), timeout=WAIT_S)
    # ...and its CPU is back.
    deadline = time.monotonic() + WAIT_S
    while ray.available_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


def test_replicas_on_both_nodes_and_greedy_matches_inproc(
    engine: nb.Engine, tiny_model: Path
) -> None:
    reps = engine.replicas()
    assert [r["replica"] for r in reps] == [0, 1] and all(r["alive"] for r in reps)
    assert reps[0]["pid"] != reps[1]["pid"]
    prompts = [f"Once upon a time {i}" for i in range(8)]
    params = nb.SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    handles = [engine.generate(p, params) for p in prompts]
    where = [replica_of(engine, h) for h in handles]
    outs = [h.result(timeout=WAIT_S) for h in handles]
    assert sorted(where) == [0, 0, 0, 0, 1, 1, 1, 1]  # least loaded: spread evenly
    stats = engine.request_stats()
    assert stats["replica"].tolist()[-8:] == where  # which replica served each request
    assert set(engine.step_stats()["replica"]) == {0, 1}  # and which ran each step
    with nb.Engine(str(tiny_model), **ENGINE_KW) as local:
        ref = [local.generate(p, params).result(timeout=WAIT_S) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]
    assert all(r["routed_total"] >= 4 for r in engine.replicas())


def test_streams_and_cancel(engine: nb.Engine) -> None:
    h = engine.generate("The", long_params(output_kind=Kind.DELTA), request_id="s")
    seen: list[int] = []
    for out in h:
        seen.extend(out.outputs[0].token_ids)
        if len(seen) >= 10:
            break  # leaving the loop cancels the request
    assert h.done() and h.status is S.FINISHED_ABORTED
    h2 = engine.generate("The", long_params(), request_id="s2")
    wait_first_token(h2)
    final = h2.cancel()
    assert final is not None and final.outputs[0].finish_reason == "abort"
    assert h2.status is S.FINISHED_ABORTED and len(final.outputs[0].token_ids) >= 1
    assert engine.num_unfinished_requests() == 0


def test_n_children_run_on_one_replica(engine: nb.Engine) -> None:
    h = engine.generate("Hi", nb.SamplingParams(n=3, max_tokens=4, ignore_eos=True, seed=3))
    replica_of(engine, h)  # asserts one replica for all three keys
    r = h.result(timeout=WAIT_S)
    assert [len(c.token_ids) for c in r.outputs] == [4, 4, 4]


def test_abort_then_immediate_readd(engine: nb.Engine) -> None:
    for _ in range(5):
        h = engine.generate("Once upon", long_params(), request_id="early")
        final = engine.abort("early")
        assert final is not None and final.outputs[0].finish_reason == "abort"
        assert h.done() and h.status is S.FINISHED_ABORTED
        r = engine.generate(
            "Once upon", nb.SamplingParams(max_tokens=3, ignore_eos=True), request_id="early"
        ).result(timeout=WAIT_S)
        assert len(r.outputs[0].token_ids) == 3


def test_readd_while_abort_pending_is_rejected(engine: nb.Engine, tmp_path: Path) -> None:
    """The replica's core is held (a utility waits for a file) so the re-add certainly
    comes before the core's confirmation: it must be rejected, and abort() must wait."""
    h = engine.generate("Once", long_params(), request_id="race")
    wait_first_token(h)
    gate_file = str(tmp_path / "open")

    def gate(core: Any, path: str = gate_file) -> None:
        import os
        import time

        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.005)

    held = engine._client.run_utility(gate, replica=replica_of(engine, h))  # type: ignore[attr-defined]
    t = threading.Thread(target=engine.abort, args=("race",))
    t.start()
    while h.status is not S.RELEASING:
        assert not h.done()
        time.sleep(0.001)
    with pytest.raises(nb.RequestIdInUseError) as exc:
        engine.generate("Once", nb.SamplingParams(max_tokens=3), request_id="race")
    assert exc.value.status is S.RELEASING
    time.sleep(0.2)
    assert t.is_alive() and not h.done()  # abort() has not returned: not confirmed
    Path(gate_file).touch()
    held.result(timeout=WAIT_S)
    t.join(WAIT_S)
    assert not t.is_alive()
    assert h.done() and h.final_output is not None
    assert h.final_output.outputs[0].finish_reason == "abort"
    r = engine.generate(
        "Once", nb.SamplingParams(max_tokens=3, ignore_eos=True), request_id="race"
    ).result(timeout=WAIT_S)
    assert len(r.outputs[0].token_ids) == 3 and r.outputs[0].finish_reason == "length"


def test_readd_race_stress_never_mixes(engine: nb.Engine) -> None:
    abort_and_readd_race(engine, "race2", rounds=8)


def test_stop_string_then_immediate_reuse(engine: nb.Engine) -> None:
    ref = engine.generate(
        "Once upon", nb.SamplingParams(max_tokens=30, ignore_eos=True, temperature=0)
    ).result(timeout=WAIT_S)
    text = ref.outputs[0].text
    assert len(text) > 12
    stop = text[8:11]
    first = text.find(stop)
    for _ in range(3):
        params = nb.SamplingParams(
            max_tokens=30, ignore_eos=True, temperature=0, stop=[stop], output_kind=Kind.DELTA
        )
        h = engine.generate("Once upon", params, request_id="stopper")
        outs = list(h)
        assert "".join(o.outputs[0].text for o in outs) == text[:first]
        assert outs[-1].outputs[0].finish_reason == "stop"
        h2 = engine.generate(
            "Once upon", nb.SamplingParams(max_tokens=12, ignore_eos=True), request_id="stopper"
        )
        r2 = h2.result(timeout=WAIT_S)
        assert len(r2.outputs[0].token_ids) == 12 and r2.outputs[0].finish_reason == "length"


def test_lost_replica_fails_only_its_requests_then_restart(engine: nb.Engine) -> None:
    dash = engine.dashboard()
    handles = [engine.generate(f"Prompt {i}", long_params(), request_id=f"k{i}") for i in range(4)]
    for h in handles:
        wait_first_token(h)
    where = {h.request_id: replica_of(engine, h) for h in handles}
    assert set(where.values()) == {0, 1}
    victims = [h for h in handles if where[h.request_id] == 0]
    survivors = [h for h in handles if where[h.request_id] == 1]
    ray.kill(engine._client._replicas[0].actor)  # type: ignore[attr-defined]
    for h in victims:
        with pytest.raises(nb.EngineDeadError, match="Replica 0"):
            h.result(timeout=WAIT_S)
        with pytest.raises(nb.EngineDeadError, match="Replica 0"):
            list(h)
        assert h.status is S.FINISHED_ERROR
        assert h.final_output is not None and h.final_output.outputs[0].finish_reason == "error"
    assert engine.is_alive
    health = engine.replicas()
    assert [r["alive"] for r in health] == [False, True]
    assert "Replica 0" in (health[0]["error"] or "")
    deadline = time.monotonic() + WAIT_S  # the dashboard shows the lost replica
    while not (
        "replica 0 (ray): down" in dash.replicas.value
        and "replica 1 (ray): alive" in dash.replicas.value
    ):
        assert time.monotonic() < deadline, dash.replicas.value
        time.sleep(0.05)
    for h in survivors:
        assert not h.done()
        n = len(h.token_ids)
        deadline = time.monotonic() + WAIT_S
        while len(h.token_ids) <= n:  # still streaming on replica 1
            assert time.monotonic() < deadline
            time.sleep(0.005)
    # New work goes to the live replica.
    r = engine.generate("After", nb.SamplingParams(max_tokens=4, ignore_eos=True)).result(
        timeout=WAIT_S
    )
    assert len(r.outputs[0].token_ids) == 4
    for h in survivors:
        assert h.cancel().outputs[0].finish_reason == "abort"  # type: ignore[union-attr]
    engine.restart_replica(0)
    assert [r["alive"] for r in engine.replicas()] == [True, True]
    hs = [
        engine.generate(f"Again {i}", nb.SamplingParams(max_tokens=3, ignore_eos=True))
        for i in range(2)
    ]
    assert sorted(replica_of(engine, h) for h in hs) == [0, 1]
    assert all(len(h.result(timeout=WAIT_S).outputs[0].token_ids) == 3 for h in hs)


def test_core_failure_in_a_replica_fails_only_its_requests(engine: nb.Engine) -> None:
    a = engine.generate("First", long_params(), request_id="fa")
    b = engine.generate("Second", long_params(), request_id="fb")
    wait_first_token(a)
    wait_first_token(b)
    bad, good = replica_of(engine, a), replica_of(engine, b)
    assert bad != good

    def break_model(core: Any) -> None:
        def execute(batch: Any) -> Any:
            raise RuntimeError("injected forward failure")

        core.runner.execute = execute

    engine._client.run_utility(break_model, replica=bad).result(timeout=WAIT_S)  # type: ignore[attr-defined]
    with pytest.raises(nb.EngineDeadError, match=f"Replica {bad} .*injected forward failure"):
        a.result(timeout=WAIT_S)
    assert a.final_output is not None and a.final_output.outputs[0].finish_reason == "error"
    assert engine.is_alive and not b.done()
    assert [r["alive"] for r in engine.replicas()][bad] is False
    assert b.cancel().outputs[0].finish_reason == "abort"  # type: ignore[union-attr]
    engine.restart_replica(bad)
    assert all(r["alive"] for r in engine.replicas())
    r = engine.generate("Back", nb.SamplingParams(max_tokens=2, ignore_eos=True)).result(
        timeout=WAIT_S
    )
    assert len(r.outputs[0].token_ids) == 2


def test_engine_dies_when_its_last_replica_is_lost(ray_cluster: Any, tiny_model: Path) -> None:
    # num_cpus=0: the module's engine already holds both CPUs of the cluster.
    eng = nb.Engine(
        str(tiny_model),
        backend="ray",
        data_parallel_size=1,
        resources_per_replica={"num_cpus": 0},
        **ENGINE_KW,
    )
    try:
        h = eng.generate("Alone", long_params())
        wait_first_token(h)
        ray.kill(eng._client._replicas[0].actor)  # type: ignore[attr-defined]
        with pytest.raises(nb.EngineDeadError, match="Replica 0"):
            h.result(timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while eng.is_alive:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(nb.EngineDeadError):
            eng.generate("After", nb.SamplingParams(max_tokens=2))
        with pytest.raises(nb.EngineDeadError):
            eng.restart_replica(0)
    finally:
        eng.shutdown()
    assert ray.is_initialized()


def test_attach_to_a_running_cluster_by_address(ray_cluster: Any, tiny_model: Path) -> None:
    # A separate driver (as a notebook would be) joins the running cluster by address,
    # serves a request, and its shutdown leaves the cluster (and its own Ray client) up.
    script = (
        "import nbengine as nb, ray\n"
        f"eng = nb.Engine({str(tiny_model)!r}, backend='ray', data_parallel_size=1,"
        f" ray_address={ray_cluster.address!r}, resources_per_replica={{'num_cpus': 0}},"
        f" **{ENGINE_KW!r})\n"
        "out = eng.generate('Hello', nb.SamplingParams(max_tokens=3, ignore_eos=True))"
        ".result(timeout=120)\n"
        "nodes = len([n for n in ray.nodes() if n['Alive']])\n"
        "eng.shutdown()\n"
        "print('RESULT', len(out.outputs[0].token_ids), nodes, ray.is_initialized())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT 3 2 True" in proc.stdout, proc.stdout[-2000:]
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2  # the cluster is still up


def test_backend_arguments_are_checked(ray_cluster: Any, tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be at least 1"):
        nb.Engine(str(tiny_model), backend="ray", data_parallel_size=0)
    with pytest.raises(ValueError, match="resources_per_replica takes"):
        nb.Engine(str(tiny_model), backend="ray", resources_per_replica={"gpus": 1})
    with pytest.raises(ValueError, match="routing must be"):
        nb.Engine(str(tiny_model), backend="ray", routing="random")


def test_unpicklable_utility_fails_alone_and_replica_keeps_order(engine: nb.Engine) -> None:
    lock = threading.Lock()
    fut = engine._client.run_utility(lambda core: lock, replica=0)  # type: ignore[attr-defined]
    with pytest.raises(Exception):  # noqa: B017 - whatever pickling raises, it fails alone
        fut.result(timeout=WAIT_S)
    # The replica's message sequence has no gap: later calls and requests still run.
    assert engine._client.run_utility(  # type: ignore[attr-defined]
        lambda core: core.num_unfinished_requests() >= 0, replica=0
    ).result(timeout=WAIT_S)
    hs = [
        engine.generate(f"Still {i}", nb.SamplingParams(max_tokens=2, ignore_eos=True))
        for i in range(4)
    ]
    assert all(len(h.result(timeout=WAIT_S).outputs[0].token_ids) == 2 for h in hs)
