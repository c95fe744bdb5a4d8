"""MetricsLog on synthetic lifecycle events: rows, columns, derived timings, bounds."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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


def _walk(
    log: MetricsLog,
    rid: str,
    key: str,
    t0: float,
    statuses: list[S],
    tokens: int = 0,
    dt: float = 1.0,
) -> float:
    prev: S | None = None
    t = t0
    for st in statuses:
        n = tokens if S.is_finished(st) or st == S.RELEASING else 0
        log.on_event(Ev(rid, key, prev, st, t, wall_time=1000 + t, num_output_tokens=n))
        prev = st
        t += dt
    return t


def _step(
    i: int,
    t: float,
    used: int = 3,
    total: int = 10,
    hits: int = 0,
    queries: int = 0,
    running: int = 1,
    waiting: int = 0,
) -> StepStats:
    return StepStats(
        step=i,
        start_time=t,
        duration_s=0.01,
        num_requests=running,
        num_prefill_tokens=4 if i == 0 else 0,
        num_decode_tokens=running,
        num_running=running,
        num_waiting=waiting,
        kv_blocks_used=used,
        kv_blocks_total=total,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_preemptions=0,
    )


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
    _walk(
        log,
        "b",
        "b#2",
        1.0,
        [S.QUEUED, S.WAITING, S.RUNNING, S.RELEASING, S.FINISHED_ABORTED],
        tokens=0,
    )

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
    t = _walk(
        log, "r", "r#1", 0.0, [S.QUEUED, S.WAITING, S.RUNNING, S.RELEASING, S.FINISHED_ABORTED]
    )
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
    assert df["replica"].tolist() == [0, 0]


def test_latest_step_per_replica() -> None:
    # Two data-parallel cores step in turn: each keeps its own latest figures, which the
    # dashboard adds up (separate KV caches), and step_stats() says which core ran a step.
    log = MetricsLog()
    for i, (replica, used) in enumerate([(0, 2), (1, 5), (0, 3)]):
        st = _step(i, 1.0 + i / 10, used=used, total=8)
        st.replica = replica
        log.on_step(st)
    latest = log.latest_steps()
    assert sorted(latest) == [0, 1]
    assert latest[0].kv_blocks_used == 3 and latest[1].kv_blocks_used == 5
    assert log.step_stats()["replica"].tolist() == [0, 1, 0]


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
        _walk(
            log,
            f"r{i}",
            f"r{i}#1",
            float(i),
            [S.QUEUED, S.WAITING, S.RUNNING, S.FINISHED_STOPPED],
            tokens=1,
        )
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
            _walk(
                log,
                f"w{i}",
                f"w{i}#1",
                float(i),
                [S.QUEUED, S.WAITING, S.RUNNING, S.FINISHED_STOPPED],
                tokens=2,
            )
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


# ---------------------------------------------------------------- a known engine run

PROMPT = (
    "Once upon a time, in a small village at the edge of a great forest, there lived a "
    "girl named Lily. Every morning she walked to the river to fetch water."
)


@pytest.fixture(scope="module")
def known_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, ...]]:
    """A fresh engine that ran: 8 tokens (length), one abort, 8 tokens again (cache hit)."""
    import nbengine as nb
    from nbengine.testing import make_tiny_model

    path = make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "llama",
        arch="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    with nb.Engine(
        str(path),
        num_kv_blocks=256,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
    ) as engine:
        params = nb.SamplingParams(max_tokens=8, ignore_eos=True)
        first = engine.generate(PROMPT, params, request_id="first").result(timeout=120)
        h = engine.generate(
            PROMPT, nb.SamplingParams(max_tokens=1500, ignore_eos=True), request_id="aborted"
        )
        deadline = time.monotonic() + 60
        while len(h.token_ids) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        aborted = h.cancel(timeout=60)
        again = engine.generate(PROMPT, params, request_id="first").result(timeout=120)
        n_prompt = len(engine.tokenizer.encode(PROMPT))
        yield engine, n_prompt, first, aborted, again


def test_engine_events_one_row_per_transition(known_run: tuple[Any, ...]) -> None:
    engine, _, _, aborted, _ = known_run
    ev = engine.events()
    assert list(ev.columns) == list(EVENT_COLUMNS)
    first, second = sorted(set(ev[ev["request_id"] == "first"]["key"]))
    walk = ev[ev["key"] == first]
    assert walk["to_status"].tolist() == ["QUEUED", "WAITING", "RUNNING", "FINISHED_LENGTH_CAPPED"]
    assert walk["from_status"].tolist()[1:] == walk["to_status"].tolist()[:-1]
    assert walk["num_output_tokens"].tolist()[-1] == 8
    assert walk["time"].is_monotonic_increasing
    ab = ev[ev["request_id"] == "aborted"]
    assert ab["to_status"].tolist()[-2:] == ["RELEASING", "FINISHED_ABORTED"]
    assert ab["num_output_tokens"].tolist()[-1] == len(aborted.outputs[0].token_ids)
    assert ev[ev["key"] == second]["to_status"].tolist()[-1] == "FINISHED_LENGTH_CAPPED"


def test_engine_request_stats_values(known_run: tuple[Any, ...]) -> None:
    engine, n_prompt, first, aborted, again = known_run
    df = engine.request_stats()
    assert list(df.columns) == list(REQUEST_COLUMNS)
    assert df["request_id"].tolist() == ["first", "aborted", "first"]
    assert df["status"].tolist() == [
        "FINISHED_LENGTH_CAPPED",
        "FINISHED_ABORTED",
        "FINISHED_LENGTH_CAPPED",
    ]
    assert df["finish_reason"].tolist() == ["length", "abort", "length"]
    assert (df["prompt_tokens"] == n_prompt).all()
    assert df["output_tokens"].tolist() == [8, len(aborted.outputs[0].token_ids), 8]
    assert df["preemptions"].tolist() == [0, 0, 0]
    for _, row in df.iterrows():
        assert 0 <= row["queue_time"] <= row["ttft"] <= row["e2e_time"]
    done = df[df["finish_reason"] == "length"]
    assert (done["itl_mean"] >= 0).all() and (done["itl_p99"] >= done["itl_mean"]).all()
    # The repeated prompt hits the prefix cache in whole blocks; the first one cannot.
    assert df["num_cached_tokens"].iloc[0] == 0
    cached = int(df["num_cached_tokens"].iloc[2])
    assert cached > 0 and cached % 16 == 0
    assert cached == again.num_cached_tokens


def test_engine_step_stats_values(known_run: tuple[Any, ...]) -> None:
    engine, n_prompt, *_ = known_run
    df = engine.step_stats()
    assert list(df.columns) == list(STEP_COLUMNS)
    steps = df["step"].tolist()
    assert steps == list(range(steps[0], steps[0] + len(steps)))  # one row per step
    assert len(df) >= 8 + 8
    assert (df["kv_blocks_total"] == 256).all()
    assert (df["batch_size"] >= 1).all() and (df["running"] >= 0).all()
    assert df["running"].max() == 1 and df["waiting"].max() <= 1
    assert (df["step_time"] > 0).all()
    assert df["prefill_tokens"].iloc[0] == n_prompt  # the first step prefills the prompt
    assert df["prefix_cache_hit_rate"].iloc[-1] > 0
