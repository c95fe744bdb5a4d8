"""The paged KV cache bookkeeping: a block pool, per-request block tables, prefix caching.

The physical K/V tensors live in the model runner; this module only decides which
block ids hold which request's positions. Position ``p`` of a request lives in
block ``block_table[p // block_size]`` at offset ``p % block_size``.

Prefix caching (as in vLLM v1): every FULL block of a request's tokens gets a
chained hash ``H(parent_hash, token ids of the block)``, so equal hashes mean equal
whole prefixes. A block whose K/V has been computed is registered under its hash.
When its last user frees it, it goes to the free queue but keeps its hash, so a
later request with the same prefix can take it back (a prefix hit) until the block
is handed out again for new tokens (LRU eviction: the free queue is popped from
the head; a request's blocks are released tail first so its tail is evicted first).

Sliding windows: when every attention layer of the model is windowed (``sliding_window``
given: the largest window of any layer), a request's blocks that lie wholly before the
oldest key its next query can see are released after each step (``free_outside_window``).
Their block-table entries become placeholders (``None`` here, block id 0 for the runner),
which the attention path never reads (ops/attention.py gathers only the window's blocks).
Models that mix windowed and full-attention layers keep every block: a full layer reads it.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from nbengine.core.request import Request

BlockHash = bytes


@dataclass(slots=True)
class KVBlock:
    """One physical block. ``ref_cnt == 0`` iff the block is in the free queue."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set iff registered in the prefix cache


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The chained hash of one full block: depends on the whole prefix before it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash if parent_hash is not None else b"\x00root")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def salt_root(cache_salt: str | None, lora_key: str | None = None) -> BlockHash | None:
    """The parent hash of a request's first block: None (the shared root) without a salt
    and without a LoRA adapter; a block computed under an adapter's load (``lora_key``,
    docs/lora.md) is shared only with requests under that same load."""
    if cache_salt is None and lora_key is None:
        return None
    if lora_key is None:
        assert cache_salt is not None
        return b"\x00salt" + hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=16).digest()
    h = hashlib.blake2b(lora_key.encode("utf-8"), digest_size=16)
    if cache_salt is not None:
        h.update(b"\x00salt" + cache_salt.encode("utf-8"))
    return b"\x00lora" + h.digest()


class BlockPool:
    """Blocks ``0..num_blocks-1``, a LRU free queue and the hash -> cached block map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order = eviction order (head first). Holds exactly the ref_cnt == 0 blocks.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def take(self, n: int) -> list[KVBlock]:
        """Hand out ``n`` free blocks (caller checked availability), evicting their hashes."""
        out: list[KVBlock] = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Add a reference to prefix-hit blocks, taking free ones back out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference from each block, in the given order (first freed = first evicted)."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} released twice"
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def register(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Make a computed full block findable by its hash (first writer wins)."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True


@dataclass(slots=True)
class _RequestBlocks:
    # One entry per block of positions; None where a block fell out of the sliding window
    # and went back to the pool (always a prefix of the list).
    blocks: list[KVBlock | None] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered (or hit) in the prefix cache
    num_dropped: int = 0  # leading entries that are None


class KVCacheManager:
    """Allocates blocks to requests and serves prefix-cache hits.

    Invariants:
    - A request holding blocks holds exactly the blocks for its first
      ``num_computed_tokens + (tokens scheduled this step)`` positions.
    - A block is in the free queue iff no request holds it.
    - Only blocks whose K/V has actually been computed are registered in the cache.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}.")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, _RequestBlocks] = {}
        # Chained hashes of the full blocks of each live request's tokens (kept across preemption).
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        self.prefix_cache_queries = 0  # cumulative, in tokens
        self.prefix_cache_hits = 0  # cumulative, in tokens

    # ---- counters -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0.0 .. 1.0)."""
        return self.num_used_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_fitting_tokens(self, request: Request) -> int:
        """How many positions after the computed ones ``allocate_slots`` can give
        ``request`` now: its held blocks' room plus every free block's."""
        entry = self.req_to_blocks.get(request.request_id)
        held = len(entry.blocks) if entry is not None else 0
        return (held + self.pool.num_free_blocks) * self.block_size - request.num_computed_tokens

    # ---- prefix cache ---------------------------------------------------------------
    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """The request's full-block hashes, extended to cover all its current tokens."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            # cache_salt: a salted root, so only requests with the same salt share blocks.
            # LoRA: blocks computed under one adapter load are its own (docs/lora.md).
            parent = hashes[-1] if hashes else salt_root(request.cache_salt, request.lora_key)
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request's tokens, as (blocks, num_hit_tokens).

        Never covers the whole sequence: the last token must be computed to get logits,
        so hits are capped at ``num_tokens - 1`` rounded down to whole blocks. Requests
        with ``prompt_logprobs`` never hit (their prompt positions need logits). Changes
        no state: blocks are only claimed by ``allocate_slots``.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for h in hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup in the prefix-cache counters."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens

    # ---- allocation -----------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] = (),
    ) -> bool:
        """Make room for ``num_new_tokens`` more positions after the computed ones.

        ``computed_blocks`` (prefix hits from ``get_computed_blocks``) are only given on
        admission, when the request holds no blocks yet; they cover the positions just
        before the new ones. Returns False, changing nothing, if the pool is short.
        """
        entry = self.req_to_blocks.get(request.request_id)
        held = len(entry.blocks) if entry is not None else 0
        if computed_blocks and held:
            raise RuntimeError(
                f"request {request.request_id!r} already holds blocks; prefix hits are "
                "only applied on admission"
            )
        num_hit_tokens = len(computed_blocks) * self.block_size
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_new_blocks = max(0, self.blocks_needed(total) - held - len(computed_blocks))
        # Free-queue blocks reclaimed by the hit no longer count as available.
        num_reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_reclaimed:
            return False
        if entry is None:
            entry = self.req_to_blocks[request.request_id] = _RequestBlocks()
        if computed_blocks:
            self.pool.touch(computed_blocks)
            entry.blocks.extend(computed_blocks)
            entry.num_cached_blocks = len(computed_blocks)
        entry.blocks.extend(self.pool.take(num_new_blocks))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose K/V is now computed."""
        if not self.enable_prefix_caching:
            return
        entry = self.req_to_blocks.get(request.request_id)
        if entry is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(entry.blocks))
        if num_full <= entry.num_cached_blocks:
            return
        hashes = self._block_hashes(request)
        for i in range(entry.num_cached_blocks, num_full):
            block = entry.blocks[i]
            if block is not None:
                self.pool.register(block, hashes[i])
        entry.num_cached_blocks = num_full

    def free_beyond(self, request: Request, num_tokens: int) -> int:
        """Release the request's blocks past those holding its first ``num_tokens``
        positions (speculative decoding: the slots of rejected drafts), tail first.
        Returns how many blocks were released."""
        entry = self.req_to_blocks.get(request.request_id)
        if entry is None:
            return 0
        keep = self.blocks_needed(num_tokens)
        tail = entry.blocks[keep:]
        if not tail:
            return 0
        del entry.blocks[keep:]
        entry.num_cached_blocks = min(entry.num_cached_blocks, keep)
        released = [b for b in reversed(tail) if b is not None]
        self.pool.release(released)
        return len(released)

    def free_outside_window(self, request: Request) -> int:
        """Release the request's blocks that no sliding window can reach any more.

        The next query sits at position ``num_computed_tokens`` and sees keys from
        ``num_computed_tokens - sliding_window + 1`` on; blocks wholly before that are
        released (oldest first, so they are evicted first). Call it after
        ``cache_computed_blocks``, so the released blocks keep their prefix-cache hashes.
        Returns how many blocks were released (0 without a ``sliding_window``).
        """
        entry = self.req_to_blocks.get(request.request_id)
        if self.sliding_window is None or entry is None:
            return 0
        oldest_key = request.num_computed_tokens - self.sliding_window + 1
        drop = min(max(0, oldest_key) // self.block_size, len(entry.blocks))
        if drop <= entry.num_dropped:
            return 0
        released = [b for b in entry.blocks[entry.num_dropped : drop] if b is not None]
        self.pool.release(released)
        for i in range(entry.num_dropped, drop):
            entry.blocks[i] = None
        entry.num_dropped = drop
        return len(released)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its dropped sliding-window blocks not counted)."""
        entry = self.req_to_blocks.get(request_id)
        return 0 if entry is None else len(entry.blocks) - entry.num_dropped

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table; dropped sliding-window blocks read as block 0."""
        entry = self.req_to_blocks.get(request_id)
        if entry is None:
            return []
        return [0 if b is None else b.block_id for b in entry.blocks]

    def free(self, request: Request, forget: bool = True) -> None:
        """Release the request's blocks, tail first, so its tail is evicted first.

        ``forget=False`` keeps the request's block hashes (a preempted request resumes
        with the same tokens).
        """
        entry = self.req_to_blocks.pop(request.request_id, None)
        if entry is not None:
            self.pool.release([b for b in reversed(entry.blocks) if b is not None])
        if forget:
            self.req_to_block_hashes.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash (only when no request holds blocks)."""
        return self.pool.reset_prefix_cache()
