"""The block pool and prefix cache, directly and through the core."""

from __future__ import annotations

from nbengine.core.kv_cache import KVCacheManager
from nbengine.core.request import Request
from nbengine.sampling_params import SamplingParams

from .fake_runner import Collected, make_core, make_request, run_all


def req(rid: str, tokens: list[int], **params: object) -> Request:
    return Request(rid, list(tokens), SamplingParams(**params), frozenset(), 0.0)  # type: ignore[arg-type]


def compute(kv: KVCacheManager, r: Request, n: int, hit=()) -> None:
    """Allocate and 'compute' n more tokens of r."""
    assert kv.allocate_slots(r, n, hit)
    r.num_computed_tokens += len(hit) * kv.block_size + n
    kv.cache_computed_blocks(r)


def test_allocate_and_free_counts():
    kv = KVCacheManager(8, 4)
    r = req("a", range(10))
    assert kv.allocate_slots(r, 10)
    assert len(kv.get_block_ids("a")) == 3 and kv.num_used_blocks == 3
    assert abs(kv.usage - 3 / 8) < 1e-9
    kv.free(r)
    assert kv.num_free_blocks == 8 and kv.req_to_blocks == {}


def test_allocate_failure_changes_nothing():
    kv = KVCacheManager(4, 4)
    a, b = req("a", range(12)), req("b", range(100, 108))
    assert kv.allocate_slots(a, 12)
    assert not kv.allocate_slots(b, 8)
    assert kv.num_free_blocks == 1 and "b" not in kv.req_to_blocks


def test_prefix_hit_chained_and_capped():
    kv = KVCacheManager(16, 4)
    a = req("a", range(12))
    compute(kv, a, 12)
    # Same first 8 tokens, different third block: two blocks hit.
    b = req("b", list(range(8)) + [50, 51, 52, 53, 54])
    blocks, n = kv.get_computed_blocks(b)
    assert n == 8 and [x.block_id for x in blocks] == kv.get_block_ids("a")[:2]
    # An identical 12-token prompt hits only 8: the last token must be computed.
    c = req("c", range(12))
    assert kv.get_computed_blocks(c)[1] == 8
    # Same third block after a different second block: no hit beyond the first (chained).
    d = req("d", list(range(4)) + [60, 61, 62, 63] + list(range(8, 12)) + [1])
    assert kv.get_computed_blocks(d)[1] == 4


def test_prefix_hit_on_free_block_reclaims_it_and_eviction_is_lru():
    kv = KVCacheManager(4, 4)
    a = req("a", range(9))
    compute(kv, a, 9)  # blocks for [0-3], [4-7] cached, [8] partial
    ids_a = kv.get_block_ids("a")
    kv.free(a)
    assert kv.num_free_blocks == 4
    # A request with the same 8-token prefix takes the cached blocks back out of the queue.
    b = req("b", list(range(8)) + [70])
    hit, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, 1, hit)
    assert kv.get_block_ids("b")[:2] == ids_a[:2]
    assert kv.num_free_blocks == 1
    kv.free(b)
    # Unrelated requests take blocks: the tail of the freed request is evicted first,
    # so the first cached block survives longest.
    c = req("c", range(200, 203))
    compute(kv, c, 3)
    e = req("e", range(300, 303))
    compute(kv, e, 3)
    f = req("f", range(400, 403))
    compute(kv, f, 3)
    probe = req("p", list(range(8)) + [1])
    assert kv.get_computed_blocks(probe)[1] == 4


def test_no_hits_for_prompt_logprobs_or_disabled_cache():
    kv = KVCacheManager(8, 4)
    compute(kv, req("a", range(9)), 9)
    assert kv.get_computed_blocks(req("b", range(9), prompt_logprobs=1)) == ([], 0)
    off = KVCacheManager(8, 4, enable_prefix_caching=False)
    a = req("a", range(9))
    compute(off, a, 9)
    assert off.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert off.req_to_block_hashes == {} and off.pool.num_cached_blocks == 0


def test_output_blocks_are_cached_too():
    kv = KVCacheManager(8, 4)
    a = req("a", range(3))
    compute(kv, a, 3)
    for t in (3, 4, 5, 6):  # decode: the sampled token is computed one step later
        a.append_output_token(t)
        compute(kv, a, 1)
    b = req("b", range(9))
    assert kv.get_computed_blocks(b)[1] == 4


def test_shared_prefix_hits_and_same_outputs_as_without_cache():
    shared = list(range(1, 13))  # 3 full blocks of 4
    prompts = {"a": shared + [40, 41], "b": shared + [50], "c": shared + [60, 61, 62]}

    def run(enable: bool) -> tuple[Collected, object]:
        core = make_core(enable_prefix_caching=enable, block_size=4)
        core.add_request(make_request("a", prompts["a"], max_tokens=6))
        c = Collected()
        c.add(core.step())  # a's prompt is computed first
        core.add_request(make_request("b", prompts["b"], max_tokens=6))
        core.add_request(make_request("c", prompts["c"], max_tokens=6))
        run_all(core, c)
        return c, core

    with_cache, core_on = run(True)
    without, core_off = run(False)
    assert with_cache.tokens == without.tokens
    kv_on = core_on.scheduler.kv
    assert kv_on.prefix_cache_hits == 24  # b and c each hit the 12 shared tokens
    assert kv_on.prefix_cache_queries == 14 + 13 + 15
    assert core_off.scheduler.kv.prefix_cache_hits == 0
    last = with_cache.batches[-1].step
    assert last.prefix_cache_hits == 24
    b_prefill = [
        ch
        for batch in core_on.runner.batches
        for ch in batch.chunks
        if ch.request.request_id == "b" and ch.is_prefill
    ]
    assert b_prefill[0].start_pos == 12
    assert kv_on.num_free_blocks == kv_on.num_blocks


def test_sliding_window_frees_blocks_behind_the_window():
    kv = KVCacheManager(16, 4, sliding_window=6)
    r = req("a", range(10))
    compute(kv, r, 10)  # positions 0..9; the next query (10) sees 5..10: block 0 is out
    assert kv.free_outside_window(r) == 1
    ids = kv.get_block_ids("a")
    assert len(ids) == 3 and ids[0] == 0 and kv.num_used_blocks == 2
    assert kv.num_held_blocks("a") == 2
    for _ in range(6):  # decode to 16 computed tokens: the query at 16 sees 11..16
        r.append_output_token(1)
        compute(kv, r, 1)
        kv.free_outside_window(r)
    assert kv.num_held_blocks("a") == 2 and len(kv.get_block_ids("a")) == 4
    assert kv.get_block_ids("a")[:2] == [0, 0]
    kv.free(r)
    assert kv.num_free_blocks == 16


def test_window_freed_blocks_keep_their_prefix_hashes():
    kv = KVCacheManager(16, 4, sliding_window=4)
    a = req("a", range(13))
    compute(kv, a, 13)
    assert kv.free_outside_window(a) == 2  # the query at 13 sees 10..13
    b = req("b", range(13))
    hit, n = kv.get_computed_blocks(b)
    assert n == 12  # blocks 0-1 came back from the free queue, block 2 is still a's
    compute(kv, b, 1, hit)
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16


def test_without_a_window_nothing_is_freed_early():
    kv = KVCacheManager(8, 4)
    r = req("a", range(30))
    compute(kv, r, 30)
    assert kv.free_outside_window(r) == 0 and kv.num_used_blocks == 8
