"""MetricsLog on synthetic lifecycle events: rows, columns, derived timings, bounds."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import pytest

from nbengine.core.messages import StepStats
from nbengine.metrics import EVENT_COLUMNS, REQUEST_COLUMNS, STEP_COLUMNS, MetricsLog
from nbengine.request import RequestStatus as S


@dataclass
class Ev:
    request_id: str
    key: str
    from_status: S | None
    to_status: S
    time: float
    wall_time: float = 0.0
    num_output_tokens: int = 0
    step: int | None = None


def _walk(log: MetricsLog, rid: str, key: str, t0: float, statuses: list[S], tokens: int = 0,
          dt: float = 1.0) -> float:
    prev: S | None = None
    t = t0
    for st in statuses:
        n = tokens if S.is_finished(st) or st == S.RELEASING else 0
        log.on_event(Ev(rid, key, prev, st, t, wall_time=1000 + t, num_output_tokens=n))
        prev = st
        t += dt
    return t


def _step(i: int, t: float, used: int = 3, total: int = 10, hits: int = 0, queries: int = 0,
          running: int = 1, waiting: int = 0) -> StepStats:
    return StepStats(step=i, start_time=t, duration_s=0.01, num_requests=running,
                     num_prefill_tokens=4 if i == 0 else 0, num_decode_tokens=running,
                     num_running=running, num_waiting=waiting, kv_blocks_used=used,
                     kv_blocks_total=total, prefix_cache_queries=queries,
                     prefix_cache_hits=hits, num_preemptions=0)


def test_one_row_per_transition_with_names() -> None:
    log = MetricsLog()
    _walk(log, "a", "a#1", 10.0, [S.QUEUED, S.WAITING, S.RUNNING, S.FINISHED_STOPPED], tokens=5)
    df = log.events()
    assert list(df.columns) == list(EVENT_COLUMNS)
    assert len(df) == 4
    assert df["to_status"].tolist() == ["QUEUED", "WAITING", "RUNNING", "FINISHED_STOPPED"]
    assert df["from_status"].tolist()[1:] == ["QUEUED", "WAITING", "RUNNING"]
    assert df["from_status"].isna().tolist()[0]
    assert df["time"].tolist() == [10.0, 11.0, 12.0, 13.0]
    assert (df["wall_time"] - df["time"]).eq(1000).all()


def test_request_stats_timings_and_finish_reasons() -> None:
    log = MetricsLog()
    log.on_request("a#1", "a", num_prompt_tokens=7, arrival_time=0.0)
    log.on_event(Ev("a", "a#1", None, S.QUEUED, 0.0))
    log.on_event(Ev("a", "a#1", S.QUEUED, S.WAITING, 0.5))
    log.on_event(Ev("a", "a#1", S.WAITING, S.RUNNING, 2.0))
    log.on_tokens("a#1", 1, 3.0, num_cached_tokens=4)  # first token: ttft 3.0
    log.on_tokens("a#1", 2, 3.5)
    log.on_tokens("a#1", 4, 4.5)  # two tokens at once: gaps 1.0 and 0.0
    log.on_tokens("a#1", 4, 9.0)  # repeated count: ignored
    log.on_event(Ev("a", "a#1", S.RUNNING, S.PREEMPTED, 5.0, num_output_tokens=4))
    log.on_event(Ev("a", "a#1", S.PREEMPTED, S.RUNNING, 5.5, num_output_tokens=4))
    log.on_event(Ev("a", "a#1", S.RUNNING, S.FINISHED_LENGTH_CAPPED, 6.0, num_output_tokens=4))
    _walk(log, "b", "b#2", 1.0, [S.QUEUED, S.WAITING, S.RUNNING, S.RELEASING,
                                  S.FINISHED_ABORTED], tokens=0)

    df = log.request_stats()
    assert list(df.columns) == list(REQUEST_COLUMNS)
    assert df["request_id"].tolist() == ["a", "b"]
    a, b = df.iloc[0], df.iloc[1]
    assert a["status"] == "FINISHED_LENGTH_CAPPED" and a["finish_reason"] == "length"
    assert a["prompt_tokens"] == 7 and a["output_tokens"] == 4
    assert a["queue_time"] == pytest.approx(2.0)
    assert a["ttft"] == pytest.approx(3.0)
    assert a["itl_mean"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert a["itl_p99"] == pytest.approx(1.0)
    assert a["e2e_time"] == pytest.approx(6.0)
    assert a["preemptions"] == 1
    assert a["num_cached_tokens"] == 4
    assert b["status"] == "FINISHED_ABORTED" and b["finish_reason"] == "abort"
    assert b["output_tokens"] == 0 and math.isnan(b["ttft"]) and math.isnan(b["itl_mean"])
    assert b["e2e_time"] == pytest.approx(4.0)


def test_live_request_has_no_finish() -> None:
    log = MetricsLog()
    _walk(log, "x", "x#1", 0.0, [S.QUEUED, S.WAITING, S.RUNNING])
    row = log.request_stats().iloc[0]
    assert row["status"] == "RUNNING"
    assert row["finish_reason"] is None
    assert math.isnan(row["e2e_time"])


def test_reused_id_gives_one_row_per_incarnation() -> None:
    log = MetricsLog()
    t = _walk(log, "r", "r#1", 0.0, [S.QUEUED, S.WAITING, S.RUNNING, S.RELEASING,
                                      S.FINISHED_ABORTED])
    _walk(log, "r", "r#2", t, [S.QUEUED, S.WAITING, S.RUNNING, S.FINISHED_STOPPED], tokens=3)
    df = log.request_stats()
    assert df["request_id"].tolist() == ["r", "r"]
    assert df["key"].tolist() == ["r#1", "r#2"]
    assert df["finish_reason"].tolist() == ["abort", "stop"]


def test_step_stats_columns_and_derived_values() -> None:
    log = MetricsLog()
    log.on_step(_step(0, 1.0, used=2, total=8, hits=0, queries=16))
    log.on_step(_step(1, 1.1, used=4, total=8, hits=8, queries=32, running=2, waiting=1))
    df = log.step_stats()
    assert list(df.columns) == list(STEP_COLUMNS)
    assert df["step"].tolist() == [0, 1]
    assert df["kv_usage"].tolist() == [0.25, 0.5]
    assert df["prefix_cache_hit_rate"].tolist() == [0.0, 0.25]
    assert df["running"].tolist() == [1, 2] and df["waiting"].tolist() == [0, 1]
    assert df["prefill_tokens"].tolist() == [4, 0]


def test_empty_frames_have_columns() -> None:
    log = MetricsLog()
    assert list(log.events().columns) == list(EVENT_COLUMNS)
    assert list(log.request_stats().columns) == list(REQUEST_COLUMNS)
    assert list(log.step_stats().columns) == list(STEP_COLUMNS)
    assert len(log.events()) == len(log.request_stats()) == len(log.step_stats()) == 0


def test_memory_is_bounded_and_live_requests_survive() -> None:
    log = MetricsLog(max_events=50, max_requests=5, max_steps=7, max_itl_samples=8)
    _walk(log, "live", "live#1", 0.0, [S.QUEUED, S.WAITING, S.RUNNING])
    for i in range(40):
        _walk(log, f"r{i}", f"r{i}#1", float(i), [S.QUEUED, S.WAITING, S.RUNNING,
                                                  S.FINISHED_STOPPED], tokens=1)
    for i in range(30):
        log.on_step(_step(i, float(i)))
    for n in range(1, 100):
        log.on_tokens("live#1", n, float(n))
    assert len(log.events()) == 50
    assert log.total_events == 3 + 40 * 4
    df = log.request_stats()
    assert len(df) == 5
    assert "live" in df["request_id"].tolist()  # never evicted while live
    assert df["request_id"].tolist()[-1] == "r39"  # newest finished kept
    assert log.step_stats()["step"].tolist() == list(range(23, 30))
    live = df[df["request_id"] == "live"].iloc[0]
    assert live["itl_mean"] == pytest.approx(1.0)  # mean over every gap, not only the kept ones
    assert live["output_tokens"] == 99


def test_invalid_bounds_raise() -> None:
    with pytest.raises(ValueError, match="max_events"):
        MetricsLog(max_events=0)


def test_readers_see_consistent_snapshots_while_writer_runs() -> None:
    log = MetricsLog(max_events=1000)
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            _walk(log, f"w{i}", f"w{i}#1", float(i), [S.QUEUED, S.WAITING, S.RUNNING,
                                                      S.FINISHED_STOPPED], tokens=2)
            i += 1

    th = threading.Thread(target=writer)
    th.start()
    try:
        for _ in range(30):
            df = log.request_stats()
            # A summary is never seen half-built: finished rows always carry their reason.
            finished = df[df["status"] == "FINISHED_STOPPED"]
            assert (finished["finish_reason"] == "stop").all()
            assert (finished["output_tokens"] == 2).all()
    finally:
        stop.set()
        th.join()
