"""Stateful fuzzing of a real ``nb.Engine``: random interleavings of the whole API.

Every rule draws all its arguments up front (no preconditions, no draws that depend on
timing), so a run is reproducible even though outcomes race with the engine threads.

Hypothesis drives generate (random lengths, min_tokens, ignore_eos, stop strings,
n=1..2, every output kind), abort (single ids, lists, unknown ids), handle.cancel,
id reuse (after the final output / after abort returns, and while live), partial
iteration with early close (sync and async), full iteration, and bursts of calls
from several threads, on a tiny random model.

Most incarnations carry a *marker*: a ``logit_bias`` that forces one token, distinct
between consecutive incarnations of the same id, so an output that reached the
wrong incarnation would show a foreign token.

Checked after every rule: the core holds no request the frontend has forgotten.
Checked per handle: exactly one final output; token counts within max_tokens and
at least min_tokens (unless aborted); only the incarnation's own marker tokens.
Checked at the end of each run: empty registry, empty core, every KV block free,
and after shutdown no thread left beyond the ones that existed before.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

import nbengine as nb
from nbengine.request import RequestStatus

from support.engine_state import (
    assert_core_within_frontend,
    assert_quiescent,
    call_with_timeout,
)
from support.requests import WAIT_S
from support.threads import engine_threads

SP = nb.SamplingParams
KINDS = list(nb.RequestOutputKind)
IDS = ["a", "b", "c"]
FUZZ_KW: dict[str, Any] = dict(
    num_kv_blocks=96,
    block_size=8,
    max_num_seqs=16,
    max_num_batched_tokens=128,
    max_model_len=384,
)
LONG_MAX = 100_000  # "runs until aborted" (really: until max_model_len)


@dataclass(slots=True, eq=False)
class Rec:
    """What the test knows about one incarnation."""

    handle: nb.RequestHandle
    request_id: str
    prompt: str
    params: nb.SamplingParams
    marker: int | None  # every output token must be this id (None: unconstrained)
    long: bool
    finals: list[nb.RequestHandle] = field(default_factory=list)  # done-callback calls
    consumed: bool = False
    checked: bool = False


class EngineLifecycle(RuleBasedStateMachine):
    model_path: Path  # set by the test function

    def __init__(self) -> None:
        super().__init__()
        self.baseline_threads = {t.ident for t in threading.enumerate()}
        self.engine = nb.Engine(str(self.model_path), **FUZZ_KW)
        tok = self.engine.tokenizer
        eos = set(self.engine._eos_token_ids)
        # Marker tokens: plain ASCII words that decode the same alone and repeated.
        self.markers: list[int] = []
        for tid in range(tok.vocab_size):
            text = tok.decode([tid])
            if (
                tid not in eos
                and tid not in tok.all_special_ids
                and len(text) >= 2
                and text.strip().isalpha()
                and text.isascii()
                and tok.decode([tid, tid]) == text * 2
            ):
                self.markers.append(tid)
            if len(self.markers) == 16:
                break
        assert len(self.markers) >= 4
        self.marker_text = {m: tok.decode([m]) for m in self.markers}
        self.eos = min(eos)
        self.recs: list[Rec] = []
        self.current: dict[str, Rec] = {}  # id -> its latest incarnation (main-thread ids)
        self.counter = itertools.count()
        self.last_marker: dict[str, int] = {}

    # ------------------------------------------------------------------ helpers

    def _pick_marker(self, rid: str, salt: int) -> int:
        choices = [m for m in self.markers if m != self.last_marker.get(rid)]
        m = choices[salt % len(choices)]
        self.last_marker[rid] = m
        return m

    def _params(
        self,
        *,
        max_tokens: int,
        min_tokens: int,
        ignore_eos: bool,
        stop: bool,
        n: int,
        kind: nb.RequestOutputKind,
        marker: int | None,
        force_eos: bool,
    ) -> SP:
        bias: dict[int, float] | None = None
        stop_strings = None
        if marker is not None:
            bias = {marker: 100.0}
            if stop:
                stop_strings = [self.marker_text[marker] * 2]
        elif force_eos:
            bias = {self.eos: 100.0}
        elif stop:
            stop_strings = ["e", "th"]
        return SP(
            n=n,
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            ignore_eos=ignore_eos,
            stop=stop_strings,
            logit_bias=bias,
            output_kind=kind,
        )

    def _start(
        self, rid: str | None, params: SP, marker: int | None, long: bool, register: bool = True
    ) -> Rec:
        k = next(self.counter)
        prompt = f"{rid or 'auto'} number {k}"
        handle = self.engine.generate(prompt, params, request_id=rid)
        rec = Rec(handle, handle.request_id, prompt, params, marker, long)
        # Done callbacks run on the loop thread; list.append is atomic.
        handle.add_done_callback(rec.finals.append)
        if register:
            self.recs.append(rec)
            if rid is not None:
                self.current[rid] = rec
        return rec

    def _live_longs(self) -> list[Rec]:
        return [r for r in self.recs if r.long and not r.handle.done()]

    def _check_final(self, rec: Rec) -> None:
        """Per-handle invariants, once its final output is delivered."""
        h = rec.handle
        final = h.final_output
        assert final is not None and h.done()
        # Done callbacks run on the loop thread just after the final output is published
        # (and its waiters woken), so a caller may see done() a moment before they ran.
        deadline = time.monotonic() + WAIT_S
        while not rec.finals and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(rec.finals) == 1, f"{len(rec.finals)} final outputs for {rec.request_id}"
        assert final.finished
        assert final.request_id == rec.request_id
        assert final.prompt == rec.prompt, "an output of another incarnation"
        assert RequestStatus.is_finished(final.status)
        assert h.status is final.status
        p = rec.params
        assert sorted(c.index for c in final.outputs) == list(range(p.n))
        for comp in final.outputs:
            n_tok = len(comp.token_ids)
            assert comp.finish_reason in ("stop", "length", "abort"), comp.finish_reason
            if rec.marker is not None:
                foreign = set(comp.token_ids) - {rec.marker}
                assert not foreign, f"{rec.request_id}: tokens {foreign} of another incarnation"
            assert p.max_tokens is not None and n_tok <= p.max_tokens
            if comp.finish_reason == "abort":
                assert comp.stop_reason is None
                continue
            assert n_tok >= p.min_tokens, (n_tok, p.min_tokens, comp.finish_reason)
            if comp.finish_reason == "length" and not rec.long:
                assert n_tok == p.max_tokens
            if isinstance(comp.stop_reason, str):
                assert comp.stop_reason in p.stop_strings
                if rec.marker is not None:  # the text was cut where the stop string began
                    full = self.marker_text[rec.marker] * n_tok
                    assert full.startswith(comp.text) and len(comp.text) < len(full)
        rec.checked = True

    def _check_stream(self, rec: Rec, outs: list[nb.RequestOutput], complete: bool) -> None:
        finished = [o.finished for o in outs]
        assert sum(finished) <= 1 and (not any(finished) or finished[-1])
        for o in outs:
            assert o.request_id == rec.request_id and o.prompt == rec.prompt
            if rec.marker is not None:
                for c in o.outputs:
                    assert set(c.token_ids) <= {rec.marker}, "foreign tokens in the stream"
        if not complete:
            return
        assert finished and finished[-1], "a fully iterated stream ended without a final output"
        final = rec.handle.final_output
        assert final is not None
        kind = rec.params.output_kind
        if kind is nb.RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
        for comp in final.outputs:
            if kind is nb.RequestOutputKind.DELTA:
                got = [
                    t for o in outs for c in o.outputs if c.index == comp.index for t in c.token_ids
                ]
                text = "".join(c.text for o in outs for c in o.outputs if c.index == comp.index)
                assert got == comp.token_ids
                assert text == comp.text
            else:
                last = [c for o in outs for c in o.outputs if c.index == comp.index][-1]
                assert last.token_ids == comp.token_ids
                assert last.text == comp.text

    def _after_free(self, rid: str) -> None:
        """``rid`` was just released: it must be reusable at once."""
        marker = self._pick_marker(rid, next(self.counter))
        params = self._params(
            max_tokens=3,
            min_tokens=0,
            ignore_eos=True,
            stop=False,
            n=1,
            kind=nb.RequestOutputKind.DELTA,
            marker=marker,
            force_eos=False,
        )
        self._start(rid, params, marker, long=False)

    # -------------------------------------------------------------------- rules

    @rule(
        rid=st.sampled_from([*IDS, None]),
        max_tokens=st.integers(1, 8),
        min_tokens=st.integers(0, 4),
        ignore_eos=st.booleans(),
        stop=st.booleans(),
        n=st.integers(1, 2),
        kind=st.sampled_from(KINDS),
        style=st.sampled_from(["marker", "marker", "natural", "eos"]),
        salt=st.integers(0, 1000),
    )
    def generate(
        self,
        rid: str | None,
        max_tokens: int,
        min_tokens: int,
        ignore_eos: bool,
        stop: bool,
        n: int,
        kind: nb.RequestOutputKind,
        style: str,
        salt: int,
    ) -> None:
        marker = self._pick_marker(rid or "auto", salt) if style == "marker" else None
        params = self._params(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            stop=stop,
            n=n,
            kind=kind,
            marker=marker,
            force_eos=style == "eos",
        )
        prev = self.current.get(rid) if rid is not None else None
        try:
            self._start(rid, params, marker, long=False)
        except nb.RequestIdInUseError as exc:
            assert prev is not None and exc.request_id == rid
            assert not RequestStatus.is_finished(exc.status)
            return
        if prev is not None:
            # Registration succeeded, so the previous incarnation was delivered first.
            assert prev.handle.done(), "an id was reused while its request was live"

    @rule(
        rid=st.sampled_from([*IDS, None]),
        n=st.integers(1, 2),
        kind=st.sampled_from(KINDS),
        salt=st.integers(0, 1000),
    )
    def generate_long(self, rid: str | None, n: int, kind: nb.RequestOutputKind, salt: int) -> None:
        if len(self._live_longs()) >= 2:
            return  # keep the machine's load bounded
        marker = self._pick_marker(rid or "auto", salt)
        params = SP(
            n=n, max_tokens=LONG_MAX, ignore_eos=True, logit_bias={marker: 100.0}, output_kind=kind
        )
        prev = self.current.get(rid) if rid is not None else None
        try:
            self._start(rid, params, marker, long=True)
        except nb.RequestIdInUseError:
            assert prev is not None
            return
        if prev is not None:
            assert prev.handle.done()

    @rule(pick=st.integers(0, 10_000))
    def reuse_while_live(self, pick: int) -> None:
        live = [r for r in self._live_longs() if self.current.get(r.request_id) is r]
        if not live:
            return
        rec = live[pick % len(live)]
        try:
            self.engine.generate("intruder", SP(max_tokens=2), request_id=rec.request_id)
        except nb.RequestIdInUseError as exc:
            assert rec.request_id in str(exc)
        else:  # only possible if it reached max_model_len in between
            raise AssertionError("generate() accepted the id of a live request")

    @rule(
        picks=st.lists(
            st.sampled_from([*IDS, "unknown-1", "unknown-2"]), min_size=1, max_size=3, unique=True
        ),
        as_list=st.booleans(),
        reuse=st.booleans(),
    )
    def abort(self, picks: list[str], as_list: bool, reuse: bool) -> None:
        target = picks if as_list or len(picks) > 1 else picks[0]
        before = {rid: self.current.get(rid) for rid in picks}
        result = self.engine.abort(target, timeout=WAIT_S)
        results = result if isinstance(result, list) else [result]
        assert len(results) == len(picks)
        for rid, out in zip(picks, results):
            rec = before[rid]
            if out is None:
                assert rec is None or rec.handle.done()
                continue
            assert rec is not None, f"abort returned an output for unknown id {rid!r}"
            assert out.finished and out.request_id == rid
            assert rec.handle.done() and rec.handle.final_output is out
            if rec.params.n == 1:
                assert out.status is RequestStatus.FINISHED_ABORTED
                assert out.outputs[0].finish_reason == "abort"
            self._check_final(rec)
            if reuse:
                self._after_free(rid)
        again = self.engine.abort(target, timeout=WAIT_S)  # idempotent: a no-op now
        if not reuse:
            assert again is None or again == [None] * len(picks)

    @rule(pick=st.integers(0, 10_000), reuse=st.booleans())
    def cancel(self, pick: int, reuse: bool) -> None:
        if not self.recs:
            return
        rec = self.recs[pick % len(self.recs)]
        out = rec.handle.cancel(timeout=WAIT_S)
        assert rec.handle.done()
        assert out is rec.handle.final_output
        self._check_final(rec)
        if reuse and self.current.get(rec.request_id) is rec:
            self._after_free(rec.request_id)

    @rule(pick=st.integers(0, 10_000), k=st.integers(0, 3), use_async=st.booleans())
    def partial_iteration(self, pick: int, k: int, use_async: bool) -> None:
        candidates = [r for r in self.recs if not r.consumed]
        if not candidates:
            return
        rec = candidates[pick % len(candidates)]
        rec.consumed = True
        h = rec.handle

        def sync_part() -> tuple[list[nb.RequestOutput], bool]:
            outs: list[nb.RequestOutput] = []
            it = iter(h)
            for out in it:
                outs.append(out)
                if len(outs) > k:
                    break
            ended = bool(outs) and outs[-1].finished
            it.close()  # early close: cancels, confirmed before close() returns
            return outs, ended

        def async_part() -> tuple[list[nb.RequestOutput], bool]:
            async def main() -> tuple[list[nb.RequestOutput], bool]:
                outs: list[nb.RequestOutput] = []
                it = h.__aiter__()
                async for out in it:
                    outs.append(out)
                    if len(outs) > k:
                        break
                await it.aclose()  # type: ignore[attr-defined]
                return outs, bool(outs) and outs[-1].finished

            return asyncio.run(main())

        canceller = None
        if rec.long and rec.params.output_kind is nb.RequestOutputKind.FINAL_ONLY:
            # Its only output comes at the end: cancel it from another thread while the
            # consumer is blocked (the stream then ends normally with "abort").
            def cancel_soon() -> None:
                time.sleep(0.3)
                h.cancel(timeout=WAIT_S)

            canceller = threading.Thread(target=cancel_soon, name="rel-canceller")
            canceller.start()
        outs, ended = call_with_timeout(async_part if use_async else sync_part)
        if canceller is not None:
            canceller.join(WAIT_S)
            assert not canceller.is_alive()
        self._check_stream(rec, outs, complete=ended)
        if not use_async:
            assert h.done(), "closing a sync iterator early did not finish the request"
        final = h.result(timeout=WAIT_S)
        assert final.finished
        self._check_final(rec)

    @rule(pick=st.integers(0, 10_000))
    def iterate_fully(self, pick: int) -> None:
        candidates = [r for r in self.recs if not r.consumed and not r.long]
        if not candidates:
            return
        rec = candidates[pick % len(candidates)]
        rec.consumed = True
        outs = call_with_timeout(lambda: list(rec.handle))
        self._check_stream(rec, outs, complete=True)
        self._check_final(rec)

    @rule(pick=st.integers(0, 10_000))
    def wait_result(self, pick: int) -> None:
        candidates = [r for r in self.recs if not r.long]
        if not candidates:
            return
        rec = candidates[pick % len(candidates)]
        rec.handle.result(timeout=WAIT_S)
        self._check_final(rec)

    @rule(num_threads=st.integers(2, 3), seed=st.integers(0, 10_000))
    def threads(self, num_threads: int, seed: int) -> None:
        """Several threads at once: a race for one id, then mixed private work."""
        engine = self.engine
        barrier = threading.Barrier(num_threads, timeout=WAIT_S)
        won: list[Rec] = []
        lost: list[BaseException] = []
        errors: list[BaseException] = []
        recs: list[Rec] = []
        lock = threading.Lock()

        def worker(i: int) -> None:
            try:
                marker = self.markers[(seed + i) % len(self.markers)]
                shared = SP(max_tokens=LONG_MAX, ignore_eos=True, logit_bias={marker: 100.0})
                barrier.wait()
                try:
                    rec = self._start("shared", shared, marker, long=True, register=False)
                    with lock:
                        won.append(rec)
                        recs.append(rec)
                except nb.RequestIdInUseError as exc:
                    with lock:
                        lost.append(exc)
                barrier.wait()  # every thread has tried while the winner is live
                for j in range(3):
                    m = self.markers[(seed + i * 3 + j) % len(self.markers)]
                    action = (seed + i + j) % 4
                    p = SP(
                        max_tokens=1 + (seed + j) % 6,
                        ignore_eos=action != 3,
                        logit_bias={m: 100.0},
                        n=1 + (j % 2),
                        output_kind=KINDS[(i + j) % 3],
                    )
                    rec = self._start(f"t{i}-{j}", p, m, long=False, register=False)
                    with lock:
                        recs.append(rec)
                    if action == 0:
                        rec.handle.result(timeout=WAIT_S)
                    elif action == 1:
                        rec.handle.cancel(timeout=WAIT_S)
                    elif action == 2:
                        engine.abort([rec.request_id, "unknown"], timeout=WAIT_S)
                    else:
                        rec.consumed = True
                        outs = list(rec.handle)
                        self._check_stream(rec, outs, complete=True)
                    assert_core_within_frontend(engine)  # concurrently with the others
                barrier.wait()
                if i == 0:
                    assert engine.abort("shared", timeout=WAIT_S) is not None
            except BaseException as exc:  # reported on the test's thread
                errors.append(exc)
                barrier.abort()

        workers = [
            threading.Thread(target=worker, args=(i,), name=f"rel-worker-{i}")
            for i in range(num_threads)
        ]
        for t in workers:
            t.start()
        for t in workers:
            t.join(WAIT_S * 2)
            assert not t.is_alive(), "a worker thread hangs"
        if errors:
            raise errors[0]
        assert len(won) == 1, f"{len(won)} threads got the same live id"
        assert len(lost) == num_threads - 1
        assert all(isinstance(e, nb.RequestIdInUseError) for e in lost)
        for rec in recs:
            rec.handle.result(timeout=WAIT_S)
            self._check_final(rec)
        self.recs.extend(recs)

    # --------------------------------------------------------------- invariants

    @invariant()
    def core_holds_nothing_the_frontend_forgot(self) -> None:
        assert_core_within_frontend(self.engine)

    @invariant()
    def one_final_output_per_handle(self) -> None:
        for rec in self.recs:
            assert len(rec.finals) <= 1
            if rec.handle.done() and not rec.checked:
                self._check_final(rec)

    def teardown(self) -> None:
        engine = self.engine
        try:
            for rec in self.recs:
                if not rec.handle.done():
                    rec.handle.cancel(timeout=WAIT_S)
            for rec in self.recs:
                rec.handle.result(timeout=WAIT_S)
                self._check_final(rec)
            assert_quiescent(engine)
        finally:
            engine.shutdown()
        assert engine_threads() == []
        extra = [t for t in threading.enumerate() if t.ident not in self.baseline_threads]
        assert extra == [], f"threads left after shutdown: {extra}"


def test_engine_lifecycle_fuzz(tiny_model: Path) -> None:
    EngineLifecycle.model_path = tiny_model
    run_state_machine_as_test(
        EngineLifecycle,
        settings=settings(
            # CI: a fixed, reproducible profile (~60 s). Bug hunting: set
            # NBENGINE_FUZZ_EXAMPLES=200 NBENGINE_FUZZ_RANDOM=1.
            max_examples=int(os.environ.get("NBENGINE_FUZZ_EXAMPLES", "8")),
            stateful_step_count=20,
            deadline=None,
            derandomize=os.environ.get("NBENGINE_FUZZ_RANDOM") != "1",
            database=None,
            print_blob=True,
            # No shrinking: each step drives real threads; a failing run prints its steps.
            phases=[Phase.explicit, Phase.reuse, Phase.generate],
            suppress_health_check=list(HealthCheck),
        ),
    )
