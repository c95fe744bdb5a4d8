"""engine.dashboard(): rows per request, per-row Cancel, Cancel all, KV usage, charts."""

from __future__ import annotations

import re

import plotly.graph_objects as go

import nbengine as nb
from nbengine.dashboard.dashboard import Dashboard
from nbengine.request import RequestStatus

from support.requests import long_params, wait_until


def _rows(dash: Dashboard) -> dict[str, str]:
    """request id -> status name, for the rows shown."""
    out = {}
    for row in dash.rows:
        if row.box.layout.display == "none":
            continue
        rid = re.sub("<[^>]+>", "", row.id_cell.value)
        status = re.search(r'data-status="(\w+)"', row.badge.value)
        assert status is not None
        out[rid] = status.group(1)
    return out


def test_rows_appear_and_cancel_all_aborts_every_live_request(engine: nb.Engine) -> None:
    dash = engine.dashboard()
    assert engine.dashboard() is dash
    assert isinstance(dash.figure, go.FigureWidget)
    handles = [
        engine.generate("Once upon a time", long_params(), request_id=f"dash-{i}") for i in range(3)
    ]
    wait_until(lambda: all(h.status is RequestStatus.RUNNING for h in handles), what="RUNNING")
    wait_until(
        lambda: {f"dash-{i}": "RUNNING" for i in range(3)}.items() <= _rows(dash).items(),
        what="three RUNNING rows",
    )
    assert not dash.cancel_all.disabled
    assert re.search(r"\d+ live", dash.title.value)
    dash.cancel_all.click()
    for h in handles:
        final = h.result(timeout=60)
        assert final.status is RequestStatus.FINISHED_ABORTED
        assert final.outputs[0].finish_reason == "abort"
    wait_until(
        lambda: all(_rows(dash).get(f"dash-{i}") == "FINISHED_ABORTED" for i in range(3)),
        what="rows to show FINISHED_ABORTED",
    )
    wait_until(lambda: dash.cancel_all.disabled, what="Cancel all to disable")
    assert engine.num_unfinished_requests() == 0


def test_row_cancel_aborts_only_its_request(engine: nb.Engine) -> None:
    dash = engine.dashboard()
    a = engine.generate("Once upon a time", long_params(), request_id="row-a")
    b = engine.generate("Once upon a time", long_params(), request_id="row-b")
    try:
        wait_until(lambda: _rows(dash).get("row-a") == "RUNNING", what="row-a RUNNING")
        with engine.monitor.updater.lock:
            row = next(r for r in dash.rows if r.request_id == "row-a")
            row.cancel.click()
        assert row.cancel.disabled
        assert a.result(timeout=60).status is RequestStatus.FINISHED_ABORTED
        wait_until(lambda: _rows(dash).get("row-a") == "FINISHED_ABORTED", what="row-a aborted")
        assert not b.done() and _rows(dash).get("row-b") == "RUNNING"
    finally:
        b.cancel()


def test_kv_usage_and_charts_show_engine_activity(engine: nb.Engine) -> None:
    dash = engine.dashboard()
    h = engine.generate("The cat sat on the mat", nb.SamplingParams(max_tokens=40, ignore_eos=True))
    h.result()
    wait_until(lambda: "blocks" in dash.kv_label.value, what="the KV label")
    assert re.search(r"\d+ / 1024 blocks", dash.kv_label.value)
    assert dash.kv_bar.max == 1024
    assert "prefix-cache hit rate" in dash.kv_label.value
    # Next to the KV cache: the device it lives on, with its memory.
    wait_until(lambda: dash.device_label.value != "", what="the device label")
    assert re.fullmatch(r"on cpu · \d+ cores( · [\d.]+ [GMT]iB memory)?", dash.device_label.value)
    wait_until(lambda: len(dash.figure.data[2].x) > 0, what="the charts to fill")
    names = [t.name for t in dash.figure.data]
    assert names == ["generated tok/s", "prompt tok/s", "running", "waiting"]
    assert max(dash.figure.data[0].y) > 0
    assert dash._repr_mimebundle_()["text/plain"] == "Dashboard()"


def test_kv_bar_adds_up_every_replicas_latest_step(fresh_engine: nb.Engine) -> None:
    # With data-parallel replicas each core has its own KV cache: the bar shows their sum,
    # not whichever replica stepped last. Two replicas' steps are fed to the metrics log.
    from nbengine.core.messages import StepStats

    dash = fresh_engine.dashboard()
    for replica, used in ((0, 3), (1, 5)):
        fresh_engine.monitor.metrics.on_step(
            StepStats(
                step=1,
                start_time=0.0,
                duration_s=0.01,
                num_requests=1,
                num_prefill_tokens=0,
                num_decode_tokens=1,
                num_running=1,
                num_waiting=0,
                kv_blocks_used=used,
                kv_blocks_total=10,
                prefix_cache_queries=4,
                prefix_cache_hits=1 + replica,
                num_preemptions=0,
                replica=replica,
            )
        )
    wait_until(lambda: "8 / 20 blocks" in dash.kv_label.value, what="the summed KV label")
    assert dash.kv_bar.max == 20 and dash.kv_bar.value == 8
    assert "prefix-cache hit rate 38%" in dash.kv_label.value  # (1 + 2) / (4 + 4)


def test_replica_health_line_shows_the_core_and_its_death() -> None:
    import tempfile

    from nbengine.testing import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(tmp, arch="llama")
        engine = nb.Engine(str(model), dtype="float32", num_kv_blocks=64)
        try:
            dash = engine.dashboard()
            engine.generate("Once", nb.SamplingParams(max_tokens=4)).result(timeout=60)
            wait_until(
                lambda: "replica 0 (inproc): alive" in dash.replicas.value, what="the replica line"
            )
            assert re.search(r"\d+ steps", dash.replicas.value)
        finally:
            engine.shutdown()
        # The final refresh at shutdown shows the core as down.
        assert "replica 0 (inproc): down" in dash.replicas.value


def test_source_column_tells_server_requests_from_the_notebook(engine: nb.Engine) -> None:
    dash = engine.dashboard()
    mine = engine.generate("Once upon a time", long_params(), request_id="src-nb")
    served = engine.generate("Once upon a time", long_params(), request_id="server:src-http")
    try:

        def sources() -> dict[str, str]:
            return {
                re.sub("<[^>]+>", "", r.id_cell.value): r.source.value
                for r in dash.rows
                if r.box.layout.display != "none"
            }

        wait_until(lambda: {"src-nb", "server:src-http"} <= sources().keys(), what="both rows")
        assert sources()["src-nb"] == "notebook"
        assert sources()["server:src-http"] == "server"
    finally:
        mine.cancel()
        served.cancel()
