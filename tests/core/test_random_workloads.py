"""Random workloads against the fake runner's simulated KV cache.

Whatever the mix of prompt lengths, shared prefixes, pool pressure, budgets,
policies and aborts, every request must produce exactly the tokens it would
produce alone (no gap, no repeat), be reported finished once, and leave every
KV block free at the end. The fake runner raises if any position reads a wrong
token through its block table.
"""

from __future__ import annotations

import random

import pytest

from nbengine.request import FinishReason, RequestStatus

from .fake_runner import Collected, expected_tokens, make_core, make_request


@pytest.mark.parametrize("seed", range(24))
def test_random_workload(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 8])
    core = make_core(
        num_kv_blocks=rng.randint(12, 40),
        block_size=block_size,
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_num_seqs=rng.choice([2, 4, 16]),
        policy=rng.choice(["fcfs", "priority"]),
        enable_prefix_caching=rng.random() < 0.7,
        enable_chunked_prefill=rng.random() < 0.8,
        max_model_len=48,
        vocab_size=1000,
        eos=999,
    )
    prefixes = [[rng.randrange(900) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    expected: dict[str, tuple[list[int], int]] = {}
    aborted: set[str] = set()
    c = Collected()
    pending = 14
    for _step in range(2000):
        if pending and rng.random() < 0.4:
            rid = f"r{pending}"
            prompt = rng.choice(prefixes) + [rng.randrange(900) for _ in range(rng.randint(1, 10))]
            max_tokens = rng.randint(1, 12)
            core.add_request(
                make_request(rid, prompt, priority=rng.randint(0, 2), max_tokens=max_tokens)
            )
            expected[rid] = (prompt, max_tokens)
            pending -= 1
        if core.scheduler.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(core.scheduler.requests))
            core.abort_requests([victim])
            aborted.add(victim)
        if not pending and not core.has_unfinished_requests():
            break
        c.add(core.step())
    else:
        raise AssertionError("workload did not finish")
    rest = core.collect_removals()
    if rest is not None:
        c.add(rest)
    for rid, (prompt, max_tokens) in expected.items():
        assert c.finished_count.get(rid) == 1, rid
        got = c.tokens.get(rid, [])
        if rid in aborted:
            assert c.finish[rid] == FinishReason.ABORT
            assert got == expected_tokens(prompt, len(got), 1000)
        elif c.status[rid] == RequestStatus.FINISHED_IGNORED:
            # Only a prompt over the budget with chunked prefill off can be ignored here.
            assert not core.scheduler.enable_chunked_prefill and got == []
            assert len(prompt) > core.scheduler.max_num_batched_tokens
        else:
            limit = min(48, core.scheduler.pool_tokens)  # a request never outgrows the pool
            n = min(max_tokens, limit - len(prompt))
            assert got == expected_tokens(prompt, n, 1000), rid
            assert c.finish[rid] == FinishReason.LENGTH
    kv = core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.req_to_blocks == {}
    assert not core.scheduler.waiting and not core.scheduler.running
