"""OutputProcessor on synthetic core batches: deterministic, no threads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fe_util import byte_token_ids

import nbengine as nb
from nbengine import RequestOutputKind as Kind
from nbengine import RequestStatus as S
from nbengine.core.messages import EngineCoreOutput, EngineCoreOutputs, StatusEvent
from nbengine.frontend.detokenizer import IncrementalDetokenizer
from nbengine.frontend.handles import RequestHandle
from nbengine.frontend.observer import EngineObserver, ObserverList
from nbengine.frontend.output_processor import ChildState, LiveRequest, OutputProcessor
from nbengine.model.tokenizer import Tokenizer
from nbengine.outputs import RequestMetrics
from nbengine.request import FinishReason


class _EventRecorder(EngineObserver):
    def __init__(self, events: list) -> None:
        self.on_event = events.append  # type: ignore[method-assign]


class Harness:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.aborts: list[list[str]] = []
        self.events = []
        observers = ObserverList()
        observers.add(_EventRecorder(self.events))
        self.proc = OutputProcessor(tok, self.aborts.append, observers)

    def add(self, rid: str, params: nb.SamplingParams, interval: int = 1) -> RequestHandle:
        h = RequestHandle(None, rid, params, None, [1, 2, 3], time.monotonic())  # type: ignore[arg-type]
        n = params.n
        children = [
            ChildState(
                key=f"{rid}#{i}",
                index=i,
                params=params,
                detok=IncrementalDetokenizer(self.tok, params),
            )
            for i in range(n)
        ]
        live = LiveRequest(
            rid,
            1,
            h,
            params,
            None,
            [1, 2, 3],
            children,
            RequestMetrics(time.monotonic()),
            max(interval, params.stream_interval),
        )
        self.proc.add(live)
        return h

    def step(self, outs=(), finished=(), events=()) -> None:
        self.proc.process(
            EngineCoreOutputs(outputs=list(outs), finished=set(finished), events=list(events))
        )


def take(h: RequestHandle):
    with h._cond:
        out = h._take_locked()
    return None if out is RequestHandle._NOTHING else out


def tok_out(key: str, tid: int, reason: FinishReason | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(key, [tid], finish_reason=reason)


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model)


def test_stream_interval_first_and_final_always_sent(tok: Tokenizer) -> None:
    hn = Harness(tok)
    h = hn.add(
        "r", nb.SamplingParams(max_tokens=10, output_kind=Kind.DELTA, stream_interval=2), interval=4
    )  # engine floor 4 beats the request's 2
    ids = byte_token_ids(tok, b"abcdefghij")
    sizes = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        hn.step(
            [tok_out("r#0", t, FinishReason.LENGTH if last else None)],
            finished=["r#0"] if last else [],
        )
        out = take(h)
        if out is not None:
            sizes.append(len(out.outputs[0].token_ids))
            assert out.finished == last
    assert sizes == [1, 4, 4, 1]
    assert h.result().outputs[0].text == "abcdefghij"
    assert hn.proc.num_unfinished() == 0


def test_stop_string_sends_abort_once_and_waits_for_confirmation(tok: Tokenizer) -> None:
    hn = Harness(tok)
    h = hn.add("r", nb.SamplingParams(stop="STOP", output_kind=Kind.DELTA))
    got = ""
    for t in byte_token_ids(tok, b"abc STOP def"):
        hn.step([tok_out("r#0", t)])  # the core keeps producing until it sees the ABORT
        out = take(h)
        if out is not None:
            assert not out.finished
            got += out.outputs[0].text
    assert hn.aborts == [["r#0"]]  # exactly once
    assert h.status is S.RELEASING and not h.done() and "r" in hn.proc.requests
    hn.step(finished=["r#0"])
    final = take(h)
    assert final is not None and final.finished
    got += final.outputs[0].text
    assert got == "abc "
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "STOP"
    assert h.status is S.FINISHED_STOPPED and hn.proc.num_unfinished() == 0
    hn.step([tok_out("r#0", 5)], finished=["r#0"])  # stale: dropped silently
    assert take(h) is None


def test_unknown_keys_dropped_and_eos_needs_no_abort(tok: Tokenizer) -> None:
    hn = Harness(tok)
    h = hn.add("r", nb.SamplingParams())
    hn.step([tok_out("zzz#9", 5), tok_out("r#0", 70)], finished=["zzz#9"])
    hn.step(
        [
            EngineCoreOutput(
                "r#0",
                [2],
                finish_reason=FinishReason.STOP,
                stop_reason=None,
                status=S.FINISHED_STOPPED,
            )
        ],
        finished=["r#0"],
    )
    r = h.result()
    assert r.outputs[0].finish_reason == "stop" and r.outputs[0].stop_reason is None
    assert hn.aborts == []


def test_abort_parent_aborts_every_child_and_wins_over_same_step_finish(tok: Tokenizer) -> None:
    hn = Harness(tok)
    h = hn.add("p", nb.SamplingParams(n=2, output_kind=Kind.CUMULATIVE))
    hn.step(
        [tok_out("p#0", 70), tok_out("p#1", 71)],
        events=[
            StatusEvent("p#0", S.RUNNING, time.monotonic()),
            StatusEvent("p#1", S.RUNNING, time.monotonic()),
        ],
    )
    assert h.status is S.RUNNING
    fut = hn.proc.request_abort(hn.proc.requests["p"])
    assert hn.aborts == [["p#0", "p#1"]] and h.status is S.RELEASING
    # Child 0 hit max_tokens in the step the abort arrived in: the abort wins.
    hn.step([tok_out("p#0", 72, FinishReason.LENGTH)], finished=["p#0"])
    assert not fut.done() and not h.done()
    hn.step(finished=["p#1"])
    final = fut.result(0)
    assert [c.finish_reason for c in final.outputs] == ["abort", "abort"]
    assert all(c.stop_reason is None for c in final.outputs)
    assert final.status is S.FINISHED_ABORTED
    assert hn.proc.requests == {} and hn.proc.keys == {}
    # Stream: only the last output is finished, children merged by index.
    outs = []
    while (o := take(h)) is not None:
        outs.append(o)
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    transitions = [(e.key, e.to_status) for e in hn.events]
    assert ("p#0", S.RELEASING) in transitions and ("p#0", S.FINISHED_ABORTED) in transitions


def test_lagging_delta_consumer_gets_merged_output(tok: Tokenizer) -> None:
    hn = Harness(tok)
    h = hn.add("r", nb.SamplingParams(output_kind=Kind.DELTA, logprobs=1))
    ids = byte_token_ids(tok, b"xyz")
    for i, t in enumerate(ids):
        last = i == 2
        out = EngineCoreOutput(
            "r#0",
            [t],
            new_logprobs=[{t: nb.Logprob(-0.5 * (i + 1), 1)}],
            finish_reason=FinishReason.LENGTH if last else None,
        )
        hn.step([out], finished=["r#0"] if last else [])
    merged = take(h)  # three puts, one get
    assert merged is not None and merged.finished
    c = merged.outputs[0]
    assert c.text == "xyz" and c.token_ids == ids and c.finish_reason == "length"
    assert c.cumulative_logprob == pytest.approx(-3.0)
    assert [p[t].decoded_token for p, t in zip(c.logprobs, ids)] == ["x", "y", "z"]
    assert take(h) is None


def test_fail_all_raises_engine_dead(tok: Tokenizer) -> None:
    hn = Harness(tok)
    h = hn.add("r", nb.SamplingParams(output_kind=Kind.DELTA))
    hn.step([tok_out("r#0", 70)])
    hn.proc.fail_all("boom")
    assert take(h) is not None  # outputs before the failure are still delivered
    with pytest.raises(nb.EngineDeadError, match="boom"):
        take(h)
    with pytest.raises(nb.EngineDeadError, match="boom"):
        h.result()
    assert h.final_output is not None and h.final_output.outputs[0].finish_reason == "error"


def test_abort_after_a_stop_string_matched_keeps_the_stop(tok: Tokenizer) -> None:
    """A finish the frontend already decided (RELEASING after a stop string) stands: a
    later abort is a no-op for it, as in vLLM."""
    hn = Harness(tok)
    h = hn.add("r", nb.SamplingParams(max_tokens=50, stop="cd"))
    for t in byte_token_ids(tok, b"abcd"):
        hn.step([tok_out("r#0", t)])
    assert h.status is S.RELEASING and hn.aborts == [["r#0"]]
    fut = hn.proc.request_abort(hn.proc.requests["r"])
    assert hn.aborts == [["r#0"]]  # nothing more to abort
    hn.step(finished=["r#0"])  # the core confirms the release
    final = fut.result(0)
    comp = final.outputs[0]
    assert (comp.finish_reason, comp.stop_reason, comp.text) == ("stop", "cd", "ab")
    assert h.status is S.FINISHED_STOPPED and final.status is S.FINISHED_STOPPED


def test_abort_of_n2_keeps_the_stopped_completion(tok: Tokenizer) -> None:
    hn = Harness(tok)
    h = hn.add("r", nb.SamplingParams(n=2, max_tokens=50, stop="cd"))
    for a, b in zip(byte_token_ids(tok, b"abcd"), byte_token_ids(tok, b"wxyz")):
        hn.step([tok_out("r#0", a), tok_out("r#1", b)])
    hn.proc.request_abort(hn.proc.requests["r"])
    hn.step(finished=["r#0", "r#1"])
    final = h.result(0)
    reasons = [(c.finish_reason, c.stop_reason) for c in final.outputs]
    assert reasons == [("stop", "cd"), ("abort", None)]
    assert final.status is S.FINISHED_ABORTED  # the most severe outcome names the request


class _CountingList(list):  # type: ignore[type-arg]
    """A list that counts how often it is walked (for the O(1)-per-event test)."""

    walks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        _CountingList.walks += 1
        return super().__iter__()


def test_child_events_cost_o1_whatever_n(tok: Tokenizer) -> None:
    """A request with many completions is never re-scanned per child event: adding it
    walks its children once, and a step that touches one child walks none."""
    hn = Harness(tok)
    params = nb.SamplingParams(n=512, max_tokens=5)
    h = RequestHandle(None, "big", params, None, [1, 2, 3], time.monotonic())  # type: ignore[arg-type]
    children = _CountingList(
        ChildState(
            key=f"big#{i}", index=i, params=params, detok=IncrementalDetokenizer(tok, params)
        )
        for i in range(512)
    )
    live = LiveRequest(
        "big", 1, h, params, None, [1, 2, 3], children, RequestMetrics(time.monotonic()), 1
    )
    _CountingList.walks = 0
    hn.proc.add(live)
    assert _CountingList.walks == 1
    _CountingList.walks = 0
    hn.step([tok_out("big#7", 70)], events=[StatusEvent("big#7", S.RUNNING, time.monotonic())])
    hn.step([tok_out("big#7", 71, FinishReason.LENGTH)], finished=["big#7"])
    assert _CountingList.walks == 0
    assert h.status is S.QUEUED  # 511 children still queued: the request is not running yet
    out = take(h)
    assert out is not None and [c.index for c in out.outputs] == [7]
