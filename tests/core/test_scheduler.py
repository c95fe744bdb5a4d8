"""Scheduler behaviour through EngineCore.step() with a deterministic fake runner.

Scenarios 1-15 of shared/reference/vllm-behaviour.md, plus chunked prefill, mixed
batches, max_num_seqs, preemption resume, ignored prompts and prompt logprobs.
"""

from __future__ import annotations

import pytest

from nbengine.core.messages import EngineCoreRequest
from nbengine.request import FinishReason, RequestStatus
from nbengine.sampling_params import SamplingParams

from .fake_runner import Collected, expected_tokens, make_core, make_request, run_all


def kv_clean(core) -> None:
    kv = core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.req_to_blocks == {}


# ---- scenarios 1-8 -------------------------------------------------------------------
def test_add_then_step_moves_waiting_to_running():  # 1
    core = make_core()
    core.add_request(make_request("r", [1, 2, 3]))
    assert (core.scheduler.num_waiting, core.scheduler.num_running) == (1, 0)
    core.step()
    assert (core.scheduler.num_waiting, core.scheduler.num_running) == (0, 1)


def test_two_requests_admitted_together_and_drain():  # 2
    core = make_core()
    core.add_request(make_request("a", [1, 2, 3], max_tokens=5))
    core.add_request(make_request("b", [4, 5], max_tokens=7))
    first = core.step()
    assert {o.request_id for o in first.outputs} == {"a", "b"}
    assert core.scheduler.num_running == 2
    c = Collected()
    c.add(first)
    run_all(core, c)
    assert core.scheduler.num_waiting == core.scheduler.num_running == 0
    assert not core.has_unfinished_requests()
    assert c.tokens["a"] == expected_tokens([1, 2, 3], 5)
    assert c.tokens["b"] == expected_tokens([4, 5], 7)
    kv_clean(core)


def test_abort_running_and_finished_set_handed_over():  # 3
    core = make_core()
    core.add_request(make_request("r", [1, 2, 3]))
    core.step()
    core.abort_requests(["r"])
    assert core.scheduler.num_running == 0
    assert not core.has_unfinished_requests()
    assert core.scheduler.has_finished_requests()
    out = core.step()
    assert out.finished == {"r"}
    (o,) = out.outputs
    assert o.finish_reason == FinishReason.ABORT and o.status == RequestStatus.FINISHED_ABORTED
    assert not core.scheduler.has_finished_requests()
    kv_clean(core)


def test_abort_one_then_two():  # 4
    core = make_core()
    for k in "abc":
        core.add_request(make_request(k, [1, 2, 3]))
    core.step()
    assert core.scheduler.num_running == 3
    core.abort_requests(["b"])
    assert core.scheduler.num_running == 2
    core.abort_requests(["a", "c"])
    assert core.scheduler.num_running == 0
    kv_clean(core)


def test_finish_waiting_requests_one_at_a_time():  # 5
    core = make_core()
    for i in range(10):
        core.add_request(make_request(f"r{i}", [1, 2]))
    for i in range(10):
        core.scheduler.finish_requests(f"r{i}", RequestStatus.FINISHED_ABORTED)
        assert f"r{i}" not in core.scheduler.requests
        assert core.scheduler.num_waiting == 10 - i - 1
        assert core.num_unfinished_requests() == 10 - i - 1


def test_abort_unknown_finished_or_twice_is_noop():  # 6
    core = make_core()
    core.add_request(make_request("done", [1, 2], max_tokens=1))
    core.add_request(make_request("live", [1, 2], max_tokens=50))
    core.step()
    assert "done" not in core.scheduler.requests
    before = (
        core.scheduler.num_waiting,
        core.scheduler.num_running,
        core.num_unfinished_requests(),
    )
    core.abort_requests(["nope", "done"])
    assert (
        core.scheduler.num_waiting,
        core.scheduler.num_running,
        core.num_unfinished_requests(),
    ) == before
    core.abort_requests(["live"])
    core.abort_requests(["live"])
    out = core.step()
    assert out.finished == {"live"}
    assert not core.has_unfinished_requests()


def test_same_key_again_after_finish():  # 7
    core = make_core()
    core.add_request(make_request("x", [1, 2], max_tokens=3))
    c1 = run_all(core)
    core.add_request(make_request("x", [5, 6], max_tokens=4))
    c2 = run_all(core)
    assert c1.tokens["x"] == [3, 4, 5]
    assert c2.tokens["x"] == [7, 8, 9, 10]
    assert core.scheduler.num_waiting == core.scheduler.num_running == 0
    kv_clean(core)


def test_non_str_id_raises_type_error_and_duplicate_value_error():  # 8
    core = make_core()
    with pytest.raises(TypeError, match="request_id must be a string"):
        core.add_request(make_request(7, [1, 2]))  # type: ignore[arg-type]
    core.add_request(make_request("x", [1, 2]))
    with pytest.raises(ValueError, match="already held"):
        core.add_request(make_request("x", [1, 2]))
    assert core.num_unfinished_requests() == 1


def test_invalid_prompt_raises_and_holds_nothing():
    core = make_core(vocab_size=100)
    with pytest.raises(ValueError, match="out of range"):
        core.add_request(make_request("x", [1, 100]))
    with pytest.raises(ValueError, match="empty prompt"):
        core.add_request(make_request("y", []))
    assert core.num_unfinished_requests() == 0


# ---- 9-10: stop checks ----------------------------------------------------------------
def test_eos_stops_with_stop_reason_none():  # 9
    core = make_core(eos=99)
    core.add_request(make_request("r", [95], max_tokens=20))
    c = run_all(core)
    assert c.tokens["r"] == [96, 97, 98, 99]
    assert c.finish["r"] == FinishReason.STOP and c.stop_reason["r"] is None
    assert c.status["r"] == RequestStatus.FINISHED_STOPPED


def test_stop_token_id_sets_stop_reason():  # 9
    core = make_core()
    core.add_request(make_request("r", [10], max_tokens=20, stop_token_ids=[13]))
    c = run_all(core)
    assert c.tokens["r"] == [11, 12, 13]
    assert c.finish["r"] == FinishReason.STOP and c.stop_reason["r"] == 13


def test_max_tokens_is_length_capped():  # 9
    core = make_core()
    core.add_request(make_request("r", [10], max_tokens=4))
    c = run_all(core)
    assert c.tokens["r"] == [11, 12, 13, 14]
    assert c.status["r"] == RequestStatus.FINISHED_LENGTH_CAPPED
    assert c.finish["r"] == FinishReason.LENGTH and c.stop_reason["r"] is None


def test_ignore_eos_continues_past_eos():  # 9
    core = make_core()
    core.add_request(make_request("r", [97], max_tokens=5, ignore_eos=True))
    c = run_all(core)
    assert c.tokens["r"] == [98, 99, 0, 1, 2]
    assert c.finish["r"] == FinishReason.LENGTH


def test_max_model_len_caps_length():
    core = make_core(max_model_len=6)
    core.add_request(make_request("r", [1, 2, 3, 4], max_tokens=None))
    c = run_all(core)
    assert c.tokens["r"] == [5, 6]
    assert c.finish["r"] == FinishReason.LENGTH


def test_min_tokens_gates_eos_and_stop_tokens():  # 10
    core = make_core()
    core.add_request(make_request("eos", [97], max_tokens=6, min_tokens=3))
    core.add_request(make_request("stop", [10], max_tokens=6, min_tokens=3, stop_token_ids=[11]))
    c = run_all(core)
    assert c.tokens["eos"] == [98, 99, 0, 1, 2, 3]
    assert c.finish["eos"] == FinishReason.LENGTH
    assert c.tokens["stop"] == [11, 12, 13, 14, 15, 16]


# ---- 11-12: preemption ----------------------------------------------------------------
def test_fcfs_preemption_and_resume_without_gap():  # 11
    # 6 blocks of 4 tokens; each request grows to 8 + 10 = 18 tokens (5 blocks).
    core = make_core(num_kv_blocks=6, block_size=4)
    a_prompt, b_prompt = list(range(1, 9)), list(range(30, 38))
    core.add_request(make_request("a", a_prompt, max_tokens=10))
    core.add_request(make_request("b", b_prompt, max_tokens=10))
    c = Collected()
    preempted = None
    for _ in range(100):
        if not core.has_unfinished_requests():
            break
        batch = core.step()
        c.add(batch)
        if batch.step.num_preemptions and preempted is None:
            preempted = [e for e in batch.events if e.status == RequestStatus.PREEMPTED]
            victim = core.scheduler.requests[preempted[0].request_id]
            assert victim.request_id == "b"  # the most recently admitted
            assert victim.status == RequestStatus.PREEMPTED and victim.num_preemptions == 1
            assert core.scheduler.waiting[0] is victim
            assert victim.num_computed_tokens == 0
            assert core.scheduler.kv.get_block_ids("b") == []
            # The token sampled before the preemption is kept.
            assert victim.output_token_ids == c.tokens["b"]
    assert preempted is not None
    assert c.tokens["a"] == expected_tokens(a_prompt, 10)
    assert c.tokens["b"] == expected_tokens(b_prompt, 10)
    assert all(v == 1 for v in c.finished_count.values())
    kv_clean(core)


def test_priority_preempts_lowest_priority_running():  # 12
    core = make_core(num_kv_blocks=6, block_size=4, policy="priority")
    # "low" arrives first, so FCFS would preempt "high" (the later one).
    core.add_request(make_request("low", list(range(1, 9)), priority=5, max_tokens=10))
    core.add_request(make_request("high", list(range(30, 38)), priority=0, max_tokens=10))
    c = Collected()
    victims = []
    while core.has_unfinished_requests():
        batch = core.step()
        c.add(batch)
        victims += [e.request_id for e in batch.events if e.status == RequestStatus.PREEMPTED]
    assert victims and set(victims) == {"low"}
    assert c.tokens["high"] == expected_tokens(list(range(30, 38)), 10)
    assert c.tokens["low"] == expected_tokens(list(range(1, 9)), 10)
    kv_clean(core)


def test_priority_admission_order():  # 12
    core = make_core(policy="priority", max_num_seqs=1)
    core.add_request(make_request("p5", [1], priority=5, max_tokens=1))
    core.add_request(make_request("p0-late", [1], priority=0, max_tokens=1, arrival=20.0))
    core.add_request(make_request("p0-early", [1], priority=0, max_tokens=1, arrival=10.0))
    order = []
    while core.has_unfinished_requests():
        order += sorted(core.step().finished)
    assert order == ["p0-early", "p0-late", "p5"]


def test_fcfs_admission_order_under_max_num_seqs():
    core = make_core(max_num_seqs=2)
    for k in "abcde":
        core.add_request(make_request(k, [1, 2], max_tokens=3))
    running_sets = []
    while core.has_unfinished_requests():
        core.step()
        running_sets.append({r.request_id for r in core.scheduler.running})
        assert core.scheduler.num_running <= 2
    assert running_sets[0] == {"a", "b"}
    for batch in core.runner.batches:
        assert len(batch.chunks) <= 2


# ---- 13-15: aborts --------------------------------------------------------------------
def test_abort_waiting_and_preempted():  # 13
    core = make_core(num_kv_blocks=6, block_size=4)
    core.add_request(make_request("a", list(range(1, 9)), max_tokens=10))
    core.add_request(make_request("b", list(range(30, 38)), max_tokens=10))
    while not any(r.status == RequestStatus.PREEMPTED for r in core.scheduler.waiting):
        core.step()
    victim = core.scheduler.waiting[0]
    core.add_request(make_request("w", [1, 2]))
    core.abort_requests([victim.request_id, "w"])
    assert core.scheduler.num_waiting == 0
    assert victim.status == RequestStatus.FINISHED_ABORTED
    out = core.step()
    assert {victim.request_id, "w"} <= out.finished
    run_all(core)
    kv_clean(core)


def test_kv_blocks_return_after_every_finish_or_abort():  # 14
    core = make_core(num_kv_blocks=20, block_size=4)
    core.add_request(make_request("stop", [95], max_tokens=20))
    core.add_request(make_request("len", list(range(10)), max_tokens=6))
    core.add_request(make_request("abort", list(range(20)), max_tokens=50))
    core.step()
    core.step()
    core.abort_requests(["abort"])
    assert "abort" not in core.scheduler.kv.req_to_blocks
    run_all(core)
    kv_clean(core)


def test_abort_during_final_step_wins():  # 15
    core = make_core()
    core.add_request(make_request("r", [1, 2, 3], max_tokens=1))
    core.runner.on_execute = lambda batch: core.abort_requests(["r"])
    out = core.step()
    assert out.finished == {"r"}
    (o,) = out.outputs
    assert o.finish_reason == FinishReason.ABORT and o.new_token_ids == []
    assert o.status == RequestStatus.FINISHED_ABORTED
    kv_clean(core)


# ---- chunked prefill, mixed batches, ignored prompts ---------------------------------------
def test_chunked_prefill_respects_budget_and_mixes_with_decodes():
    core = make_core(max_num_batched_tokens=8, num_kv_blocks=64)
    core.add_request(make_request("short", [1, 2], max_tokens=10))
    core.step()  # short: prefill + first token
    long_prompt = list(range(1, 21))
    core.add_request(make_request("long", long_prompt, max_tokens=3))
    c = run_all(core)
    mixed = 0
    for batch in core.runner.batches:
        assert batch.total_num_tokens <= 8
        kinds = [ch.is_prefill for ch in batch.chunks]
        assert kinds == sorted(kinds)  # decodes first
        if batch.num_decode_tokens and batch.num_prefill_tokens:
            mixed += 1
    assert mixed >= 2  # the long prompt was split across steps next to decodes
    long_chunks = [
        ch
        for b in core.runner.batches
        for ch in b.chunks
        if ch.request.request_id == "long" and ch.is_prefill
    ]
    assert len(long_chunks) >= 3 and not any(ch.sample for ch in long_chunks[:-1])
    assert c.tokens["long"] == expected_tokens(long_prompt, 3)


def test_no_chunked_prefill_admits_prompts_whole():
    core = make_core(max_num_batched_tokens=10, enable_chunked_prefill=False)
    core.add_request(make_request("a", list(range(1, 7)), max_tokens=2))
    core.add_request(make_request("b", list(range(1, 7)), max_tokens=2))
    core.add_request(make_request("big", list(range(1, 12)), max_tokens=2))
    c = run_all(core)
    for batch in core.runner.batches:
        for ch in batch.chunks:
            if ch.is_prefill:
                # Whole prompt in one chunk (b starts after its prefix-cache hit on a).
                assert ch.start_pos % 4 == 0 and ch.sample
                assert ch.start_pos + ch.num_tokens == ch.request.num_prompt_tokens
    assert c.status["big"] == RequestStatus.FINISHED_IGNORED
    assert c.tokens["a"] == c.tokens["b"] == [7, 8]


def test_too_long_prompt_is_ignored_with_reason():
    core = make_core(max_model_len=16, num_kv_blocks=64)
    core.add_request(make_request("long", list(range(17))))
    core.add_request(make_request("ok", list(range(16)), max_tokens=5))
    out = core.step()
    ign = [o for o in out.outputs if o.request_id == "long"]
    assert ign and ign[0].status == RequestStatus.FINISHED_IGNORED
    assert ign[0].finish_reason == FinishReason.LENGTH and "max_model_len" in ign[0].error
    assert "long" in out.finished
    c = Collected()
    c.add(out)
    run_all(core, c)
    assert c.tokens["ok"] == [16]  # prompt == max_model_len: exactly one token


def test_prompt_larger_than_pool_is_ignored():
    core = make_core(num_kv_blocks=4, block_size=4)
    core.add_request(make_request("big", list(range(17))))
    batch = core.collect_removals()
    assert batch is not None and batch.finished == {"big"}
    assert "KV blocks" in batch.outputs[0].error
    assert not core.has_unfinished_requests()


def test_single_request_longer_than_pool_is_length_capped():
    core = make_core(num_kv_blocks=3, block_size=4)
    core.add_request(make_request("r", [1, 2, 3], max_tokens=100))
    c = run_all(core)
    assert c.tokens["r"] == expected_tokens([1, 2, 3], 9)  # 12 = pool tokens
    assert c.finish["r"] == FinishReason.LENGTH
    kv_clean(core)


# ---- prompt logprobs, events, stats ---------------------------------------------------------
def test_prompt_logprobs_forwarded_once_per_position_across_preemption():
    core = make_core(num_kv_blocks=6, block_size=4, max_num_batched_tokens=5)
    pa, pb = list(range(1, 9)), list(range(30, 38))
    core.add_request(make_request("a", pa, max_tokens=10, prompt_logprobs=1))
    core.add_request(make_request("b", pb, max_tokens=10, prompt_logprobs=1))
    c = run_all(core)
    assert any(b.step and b.step.num_preemptions for b in c.batches)
    for key, prompt in (("a", pa), ("b", pb)):
        lps = c.prompt_logprobs[key]
        assert len(lps) == len(prompt) and lps[0] is None
        assert [next(iter(d)) for d in lps[1:]] == prompt[1:]
        assert c.tokens[key] == expected_tokens(prompt, 10)


def test_events_and_step_stats():
    core = make_core()
    core.add_request(make_request("r", [1, 2, 3], max_tokens=2))
    first = core.step()
    assert [e.status for e in first.events] == [RequestStatus.WAITING, RequestStatus.RUNNING]
    second = core.step()
    assert [e.status for e in second.events] == [RequestStatus.FINISHED_LENGTH_CAPPED]
    assert second.events[0].num_output_tokens == 2
    s1, s2 = first.step, second.step
    assert (s1.num_prefill_tokens, s1.num_decode_tokens, s1.num_requests) == (3, 0, 1)
    assert (s2.num_prefill_tokens, s2.num_decode_tokens) == (0, 1)
    assert s1.kv_blocks_used == 1 and s1.kv_blocks_total == 64
    assert s2.kv_blocks_used == 0 and s2.num_running == 0 and s2.step == s1.step + 1


def test_logprobs_and_seed_generator():
    core = make_core()
    core.add_request(make_request("r", [1], max_tokens=2, logprobs=1, seed=7))
    req = core.scheduler.requests["r"]
    assert req.generator is not None and req.generator.initial_seed() == 7
    out = core.step()
    assert out.outputs[0].new_logprobs == [{2: out.outputs[0].new_logprobs[0][2]}]


def test_eos_from_request_overrides_runner_default():
    core = make_core(eos=99)
    req = EngineCoreRequest(
        "r", [1], SamplingParams(max_tokens=10), 0.0, eos_token_ids=frozenset({3})
    )
    core.add_request(req)
    c = run_all(core)
    assert c.tokens["r"] == [2, 3] and c.finish["r"] == FinishReason.STOP
