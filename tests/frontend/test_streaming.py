"""Streaming through the real engine: output kinds, n>1, stop strings, logprobs."""

from __future__ import annotations

import threading

import pytest
from fe_util import byte_token_ids

import nbengine as nb
from nbengine import RequestOutputKind as Kind
from nbengine.frontend.observer import EngineObserver

PROMPTS = ["Once upon a time", "The cat sat on", "Hello", "naïve café 🎉 — 日本"]


def test_100_concurrent_requests_get_exactly_max_tokens(engine: nb.Engine) -> None:
    handles = []
    for i in range(100):
        kind = Kind.DELTA if i % 2 == 0 else Kind.FINAL_ONLY
        params = nb.SamplingParams(max_tokens=8, ignore_eos=True, output_kind=kind, seed=i)
        handles.append(engine.generate(PROMPTS[i % 4], params, request_id=f"load-{i}"))
    for i, h in enumerate(handles):
        outs = list(h)
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        ids = [t for o in outs for t in o.outputs[0].token_ids]
        assert len(ids) == 8
        if i % 2 == 1:
            assert len(outs) == 1  # FINAL_ONLY: exactly one output
        assert outs[-1].outputs[0].finish_reason == "length"
        assert h.status is nb.RequestStatus.FINISHED_LENGTH_CAPPED
    assert engine.num_unfinished_requests() == 0


@pytest.mark.parametrize("n", [1, 3])
def test_only_last_output_is_finished(engine: nb.Engine, n: int) -> None:
    for kind in (Kind.DELTA, Kind.CUMULATIVE):
        params = nb.SamplingParams(n=n, max_tokens=6, ignore_eos=True, output_kind=kind, seed=3)
        outs = list(engine.generate("Once", params))
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        final = outs[-1]
        assert final.request_id == outs[0].request_id
        total = dict.fromkeys(range(n), 0)
        for o in outs:
            for c in o.outputs:
                total[c.index] = (
                    total[c.index] + len(c.token_ids) if kind is Kind.DELTA else len(c.token_ids)
                )
        assert total == dict.fromkeys(range(n), 6)


def test_n3_children_forwarded_by_index_and_result_has_all(engine: nb.Engine) -> None:
    params = nb.SamplingParams(n=3, max_tokens=5, ignore_eos=True, seed=7, output_kind=Kind.DELTA)
    h = engine.generate("The cat", params)
    finished_seen: set[int] = set()
    for out in h:
        for c in out.outputs:
            assert c.index not in finished_seen  # a finished child is never re-sent
            if c.finish_reason is not None:
                finished_seen.add(c.index)
    assert finished_seen == {0, 1, 2}
    res = h.result()
    assert [c.index for c in res.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in res.outputs)
    # Seeded children use seed+i: child i equals a single request seeded with 7+i.
    for i, c in enumerate(res.outputs):
        single = engine.generate(
            "The cat", nb.SamplingParams(max_tokens=5, ignore_eos=True, seed=7 + i)
        ).result()
        assert single.outputs[0].token_ids == c.token_ids


def test_multibyte_delta_equals_cumulative_equals_decode(engine: nb.Engine) -> None:
    """Weights biased to emit UTF-8 lead and continuation bytes as separate tokens."""
    tok = engine.tokenizer
    split = byte_token_ids(tok, "€🎉é".encode())
    bias = dict.fromkeys(split, 8.0)
    for seed in range(4):
        results = {}
        for kind in (Kind.DELTA, Kind.CUMULATIVE):
            params = nb.SamplingParams(
                max_tokens=40, ignore_eos=True, seed=seed, logit_bias=bias, output_kind=kind
            )
            outs = list(engine.generate(PROMPTS[seed], params))
            if kind is Kind.DELTA:
                text = "".join(o.outputs[0].text for o in outs)
                ids = [t for o in outs for t in o.outputs[0].token_ids]
            else:
                texts = [o.outputs[0].text for o in outs]
                for a, b in zip(texts, texts[1:]):
                    assert b.startswith(a)  # cumulative text only grows
                text, ids = texts[-1], outs[-1].outputs[0].token_ids
            results[kind] = (text, ids)
        (dt, di), (ct, ci) = results[Kind.DELTA], results[Kind.CUMULATIVE]
        assert di == ci and len(di) == 40
        assert dt == ct == tok.decode(di)
        assert sum(t in split for t in di) > 10  # the bias really produced split bytes


def test_stream_interval_request_can_only_raise_it(engine: nb.Engine) -> None:
    params = nb.SamplingParams(
        max_tokens=11, ignore_eos=True, stream_interval=4, output_kind=Kind.DELTA
    )
    outs = list(engine.generate("Hello", params))
    sizes = [len(o.outputs[0].token_ids) for o in outs]
    # A lagging consumer only sees merged (larger) deltas, so this holds whatever the timing.
    assert sum(sizes) == 11
    assert all(s >= 4 for s in sizes[1:-1])


def test_stop_string_finishes_and_id_is_reusable_at_once(engine: nb.Engine) -> None:
    # Find a stop string this greedy model produces after a few tokens.
    ref = engine.generate(
        "Once upon", nb.SamplingParams(max_tokens=30, ignore_eos=True, temperature=0)
    ).result()
    text = ref.outputs[0].text
    assert len(text) > 12
    stop = text[8:11]
    first = text.find(stop)
    for include in (False, True):
        params = nb.SamplingParams(
            max_tokens=30,
            ignore_eos=True,
            temperature=0,
            stop=[stop],
            include_stop_str_in_output=include,
            output_kind=Kind.DELTA,
        )
        h = engine.generate("Once upon", params, request_id="stopper")
        outs = list(h)
        got = "".join(o.outputs[0].text for o in outs)
        assert got == (text[: first + len(stop)] if include else text[:first])
        last = outs[-1].outputs[0]
        assert last.finish_reason == "stop" and last.stop_reason == stop
        assert h.status is nb.RequestStatus.FINISHED_STOPPED
        # The id is free the moment the final output is seen; the new request is not
        # hit by the stop-string ABORT of the old one.
        h2 = engine.generate(
            "Once upon", nb.SamplingParams(max_tokens=12, ignore_eos=True), request_id="stopper"
        )
        r2 = h2.result()
        assert len(r2.outputs[0].token_ids) == 12 and r2.outputs[0].finish_reason == "length"


def test_logprobs_accumulate_with_decoded_tokens(engine: nb.Engine) -> None:
    params = nb.SamplingParams(
        max_tokens=5, ignore_eos=True, logprobs=2, seed=1, output_kind=Kind.DELTA
    )
    h = engine.generate("Hello", params)
    outs = list(h)
    res = h.result().outputs[0]
    assert res.logprobs is not None and len(res.logprobs) == 5
    total = 0.0
    for tid, pos in zip(res.token_ids, res.logprobs):
        assert tid in pos
        assert pos[tid].decoded_token == engine.tokenizer.decode([tid], skip_special_tokens=False)
        total += pos[tid].logprob
    assert res.cumulative_logprob == pytest.approx(total)
    assert outs[-1].outputs[0].cumulative_logprob == pytest.approx(total)


def test_handle_state_readable_while_streaming(engine: nb.Engine) -> None:
    h = engine.generate("Hi", nb.SamplingParams(max_tokens=4, ignore_eos=True))
    res = h.result()
    assert h.done() and h.text == res.outputs[0].text and h.token_ids == res.outputs[0].token_ids
    snap = h.snapshot()
    assert snap["finished"] and snap["status"] is nb.RequestStatus.FINISHED_LENGTH_CAPPED
    assert snap["num_output_tokens"] == 4 and snap["first_token_time"] is not None
    events = engine.events()
    statuses = list(events[events.request_id == h.request_id].to_status)
    assert statuses[0] == "QUEUED"
    assert statuses[-1] == "FINISHED_LENGTH_CAPPED"
    assert "RUNNING" in statuses


def test_generate_from_many_threads(engine: nb.Engine) -> None:
    results: dict[int, int] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for j in range(5):
                r = engine.generate(
                    "Hi", nb.SamplingParams(max_tokens=3, ignore_eos=True), request_id=f"t{k}-{j}"
                ).result()
                results[k * 10 + j] = len(r.outputs[0].token_ids)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(results) == 30 and set(results.values()) == {3}


def test_metrics_hooks_see_requests_tokens_events_and_steps(engine: nb.Engine) -> None:
    seen: dict[str, list] = {"req": [], "tok": []}

    class Recorder(EngineObserver):
        def on_request(self, *a: object) -> None:
            seen["req"].append(a)

        def on_tokens(self, *a: object) -> None:
            seen["tok"].append(a)

    recorder = Recorder()
    engine.add_observer(recorder)
    try:
        steps_before = len(engine.step_stats())
        h = engine.generate(
            "Hi", nb.SamplingParams(n=2, max_tokens=3, ignore_eos=True), request_id="hooks"
        )
        h.result()
    finally:
        engine.remove_observer(recorder)
    keys = {a[0] for a in seen["req"]}
    assert len(keys) == 2 and all(a[1] == "hooks" for a in seen["req"])
    for key in keys:
        counts = [a[1] for a in seen["tok"] if a[0] == key]
        assert counts == sorted(counts) and counts[-1] == 3
    assert len(engine.step_stats()) > steps_before
    events = engine.events()
    ev = events[events.request_id == "hooks"]
    assert set(ev.key) == keys and (ev.step.dropna() >= 0).all()


def test_prompt_logprobs_once_per_position_with_n(engine: nb.Engine) -> None:
    """n > 1 returns one prompt_logprobs entry per prompt position, not n copies."""
    h = engine.generate(
        "Once upon a time",
        nb.SamplingParams(n=3, max_tokens=2, prompt_logprobs=2, ignore_eos=True, seed=0),
    )
    final = h.result(timeout=60)
    plp = final.prompt_logprobs
    assert plp is not None and len(plp) == len(final.prompt_token_ids)
    assert plp[0] is None and all(p is not None for p in plp[1:])


def test_n_up_to_the_documented_cap(engine: nb.Engine) -> None:
    from nbengine.sampling_params import MAX_N

    final = engine.generate("Once", nb.SamplingParams(n=MAX_N, max_tokens=1, seed=1)).result(120)
    assert [c.index for c in final.outputs] == list(range(MAX_N))
    assert all(len(c.token_ids) == 1 for c in final.outputs)
    with pytest.raises(ValueError, match=f"n must be at most {MAX_N}"):
        nb.SamplingParams(n=MAX_N + 1)
