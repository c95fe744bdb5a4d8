"""Attention metadata: where a step's tokens sit in the paged KV cache, and what each reads.

Cache layout, per layer: ``k_cache`` and ``v_cache`` each ``[num_blocks, block_size,
num_kv_heads, head_dim]``. Position ``p`` of a request lives in block
``block_table[p // block_size]`` at offset ``p % block_size``; its flat slot is
``block * block_size + offset``.

A step's batch is flattened: the tokens of every scheduled chunk are concatenated.
Each chunk attends to its cached prefix ``[0, start_pos)`` plus, causally, to itself.
``AttentionMetadata`` is built once per step and shared by all layers: the slot mapping
(where each new token's K/V is written) at once, and what each attention path of
ops/attention_kernels.py reads on first use:

- the decode groups: single-token chunks sorted by context length and split into groups
  of similar length (``DecodeGroup``), each with its padded block tables and a boolean
  length mask over the gathered blocks;
- per multi-token chunk (prefill), its query rows and, over a cached prefix, the slots
  of its context and the causal mask (``PrefillMeta``);
- for the native kernel, one block-table row and key count per token
  (``token_block_tables``, ``token_seq_lens``).

Sliding-window layers (``window=w``: the query at position ``p`` sees keys ``p - w + 1 .. p``,
transformers' convention) get decode groups that start at the block holding the oldest
visible key and masks that hide the rest, so blocks that fell out of every window may
already be back in the pool (the KV cache manager frees them for models whose every layer
is windowed; their block-table entries then name a placeholder that is never read). A
step whose every context fits in the window is full attention (``effective_window``).

On the runner's device path (a GPU, or the CPU with ``NBENGINE_DEVICE_PATH=1``;
docs/architecture.md, "Devices") ``StagedAttention`` builds the same decode groups and
prefill inputs from one staged copy of the step's lists, for every window the model
uses, with masks and context slots computed on the device; the native kernel is off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(slots=True)
class ChunkSpec:
    """One chunk of the flattened batch: positions ``[start_pos, start_pos + num_tokens)``."""

    start_pos: int
    num_tokens: int
    block_table: Sequence[int]


@dataclass(slots=True)
class PrefillMeta:
    """Per multi-token chunk: where its queries are and which cached K/V it reads."""

    q_start: int
    num_tokens: int
    start_pos: int
    # [L] slots of the keys the chunk reads (its context), None: only its own fresh K/V.
    ctx_slots: torch.Tensor | None
    # [num_tokens, L] bool (True = attend), None: plain causal over the fresh K/V.
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeGroup:
    """Decodes of similar context length, attended to in one SDPA call."""

    rows: torch.Tensor  # [b] int64: the decodes' indices among the first num_decodes tokens
    block_tables: torch.Tensor  # [b, n_blocks] int64 (padding -> block 0)
    mask: torch.Tensor  # [b, 1, 1, n_blocks * block_size] bool, True = attend


@dataclass(slots=True)
class AttentionMetadata:
    """Step-wide attention inputs, built once per step and shared by all layers.

    The slot mapping is built at once (every path writes K/V first). What each attention
    path reads (``decode_groups`` and ``prefills`` for the SDPA path, the per-token
    ``token_block_tables``/``token_seq_lens`` for the native kernel) is built the first
    time it is asked for, so a step pays only for the path it takes.

    Invariant: the first ``num_decodes`` chunks are single-token decodes; the prefill
    chunks follow in order.
    """

    chunks: Sequence[ChunkSpec]
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    num_decodes: int
    device: torch.device | str = "cpu"
    # False on the runner's device path: attention runs in torch ops only (SDPA).
    use_native: bool = True
    # SDPA-path inputs per attention window (None = full attention), built on first use.
    _decode_groups: dict[int | None, list[DecodeGroup]] = field(
        default_factory=dict, init=False, repr=False
    )
    _prefills: dict[int | None, list[PrefillMeta]] = field(
        default_factory=dict, init=False, repr=False
    )
    _token_tables: tuple[torch.Tensor | None, torch.Tensor | None] | None = field(
        default=None, init=False, repr=False
    )
    _max_seq_len: int | None = field(default=None, init=False, repr=False)
    _long_prefill: bool | None = field(default=None, init=False, repr=False)

    @property
    def long_prefill(self) -> bool:
        """Whether a prefill chunk reaches past ``NATIVE_PREFILL_MAX_KEYS`` keys (its
        attention then takes SDPA, the decodes still the native kernel)."""
        if self._long_prefill is None:
            self._long_prefill = any(
                c.start_pos + c.num_tokens > NATIVE_PREFILL_MAX_KEYS
                for c in self.chunks[self.num_decodes :]
            )
        return self._long_prefill

    @property
    def max_seq_len(self) -> int:
        """The longest context any token of the step attends to (its position + 1)."""
        if self._max_seq_len is None:
            self._max_seq_len = max((c.start_pos + c.num_tokens for c in self.chunks), default=0)
        return self._max_seq_len

    def effective_window(self, window: int | None) -> int | None:
        """``window``, or None when every context of the step fits in it (full attention)."""
        if window is None or self.max_seq_len <= window:
            return None
        return window

    @property
    def decode_groups(self) -> list[DecodeGroup]:
        """The decodes, grouped by similar context length (SDPA path, full attention)."""
        return self.decode_groups_for(None)

    def decode_groups_for(self, window: int | None) -> list[DecodeGroup]:
        """The decode groups of a layer with attention window ``window`` (None: full)."""
        groups = self._decode_groups.get(window)
        if groups is None:
            groups = self._decode_groups[window] = _decode_groups(
                self.chunks[: self.num_decodes], self.block_size, self.device, window
            )
        return groups

    @property
    def prefills(self) -> list[PrefillMeta]:
        """Per prefill chunk: its query rows and cached context (SDPA path, full attention)."""
        return self.prefills_for(None)

    def prefills_for(self, window: int | None) -> list[PrefillMeta]:
        """The prefill chunks' inputs for a layer with attention window ``window``."""
        metas = self._prefills.get(window)
        if metas is None:
            metas = self._prefills[window] = _prefill_metas(
                self.chunks, self.num_decodes, self.block_size, self.device, window
            )
        return metas

    @property
    def token_block_tables(self) -> torch.Tensor | None:
        """[T, max_blocks] int32: each token's block table (native path; None if no chunks)."""
        return self._tables()[0]

    @property
    def token_seq_lens(self) -> torch.Tensor | None:
        """[T] int32: the keys each token sees, its position + 1 (native path)."""
        return self._tables()[1]

    def _tables(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self._token_tables is None:
            self._token_tables = _token_tables(self.chunks, self.block_size, self.device)
        return self._token_tables


# Longest context (cached + new tokens) whose prefill chunk runs in the native kernel;
# measured (9 query heads over 3 KV heads, head_dim 64, 512-token chunks): the kernel is
# faster than SDPA up to about a thousand keys and ~25% slower at 2-8 thousand.
NATIVE_PREFILL_MAX_KEYS = 1024


def _slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of ``positions`` given a request's ``block_table`` (both int64)."""
    return block_table[positions // block_size] * block_size + positions % block_size


def _length_groups(
    n_blocks: Sequence[int], min_group: int = 8, ratio: float = 0.6
) -> list[list[int]]:
    """Split decode indices, longest first, into groups of similar block counts.

    A new group starts when a decode needs fewer than ``ratio`` times the blocks of its
    group's longest member and the group already holds ``min_group`` decodes (few, large
    SDPA calls; padding at most ~1/ratio of the computed keys).
    """
    order = sorted(range(len(n_blocks)), key=lambda i: -n_blocks[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (
            len(groups[-1]) < min_group or n_blocks[i] >= ratio * n_blocks[groups[-1][0]]
        ):
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]  # one group == all decodes in batch order


def _token_tables(
    chunks: Sequence[ChunkSpec], block_size: int, device: torch.device | str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One block-table row and key count per token: a chunk's tokens share its table and
    token ``i`` sees ``start_pos + i + 1`` keys (causal over the cache)."""
    if not chunks:
        return None, None
    needed = [(c.start_pos + c.num_tokens + block_size - 1) // block_size for c in chunks]
    most = max(needed)
    rows = [list(c.block_table[:nb]) + [0] * (most - nb) for c, nb in zip(chunks, needed)]
    tables = torch.tensor(rows, dtype=torch.int32, device=device)
    counts = [c.num_tokens for c in chunks]
    if any(n != 1 for n in counts):
        tables = tables.repeat_interleave(torch.tensor(counts, device=device), dim=0)
    lens: list[int] = []
    for c in chunks:
        lens.extend(range(c.start_pos + 1, c.start_pos + c.num_tokens + 1))
    return tables, torch.tensor(lens, dtype=torch.int32, device=device)


def build_attention_metadata(
    chunks: Sequence[ChunkSpec], block_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """The metadata for ``chunks`` in flattened order (single-token chunks first).

    Builds the slot mapping now; the per-path inputs are built on first use (see
    ``AttentionMetadata``).
    """
    num_decodes = 0
    for c in chunks:
        if c.num_tokens != 1:
            break
        num_decodes += 1
    assert all(c.num_tokens > 1 for c in chunks[num_decodes:]), "decodes must come first"
    for c in chunks:
        assert len(c.block_table) * block_size >= c.start_pos + c.num_tokens, (
            "block table too short"
        )

    # One list and one tensor: per-chunk torch ops cost more than the Python loop here.
    slot_mapping = torch.tensor(step_slots(chunks, block_size), dtype=torch.int64, device=device)
    return AttentionMetadata(chunks, block_size, slot_mapping, num_decodes, device)


def step_slots(chunks: Sequence[ChunkSpec], block_size: int) -> list[int]:
    """The flat cache slot of every new token of ``chunks``, in flattened order."""
    slots: list[int] = []
    for c in chunks:
        table = c.block_table
        for p in range(c.start_pos, c.start_pos + c.num_tokens):
            slots.append(table[p // block_size] * block_size + p % block_size)
    return slots


class StagedAttention:
    """``AttentionMetadata`` built from one staged copy (the runner's device path).

    ``__init__`` runs on the host: it computes, as lists, the slot mapping, the decode
    groups of every attention window the model uses and each prefill chunk's block
    table, and stages them (``stage``: ``StepStager`` of model/step_inputs.py, or any
    object with its ``ints`` method). ``build(views)`` then makes the metadata from the
    copied views, computing masks and context slots on the device: no other transfer.
    The native kernels are off on this path (``use_native=False``).
    """

    def __init__(
        self,
        chunks: Sequence[ChunkSpec],
        block_size: int,
        windows: Sequence[int | None],
        stage: _IntStager,
    ) -> None:
        num_decodes = 0
        for c in chunks:
            if c.num_tokens != 1:
                break
            num_decodes += 1
        assert all(c.num_tokens > 1 for c in chunks[num_decodes:]), "decodes must come first"
        self.chunks, self.block_size, self.num_decodes = chunks, block_size, num_decodes
        self.slots = stage.ints(step_slots(chunks, block_size))
        max_len = max((c.start_pos + c.num_tokens for c in chunks), default=0)
        # The windows this step's layers effectively use (AttentionMetadata.effective_window).
        self.windows = sorted(
            {None if w is None or max_len <= w else w for w in windows},
            key=lambda w: -1 if w is None else w,
        )
        self.groups: dict[int | None, list[tuple[int, int, int, int, int]]] = {}
        for w in self.windows:
            self.groups[w] = [
                (
                    stage.ints(g.rows),
                    stage.ints([b for row in g.tables for b in row]),
                    stage.ints(g.lo),
                    stage.ints(g.hi),
                    len(g.tables[0]),
                )
                for g in _decode_group_lists(chunks[:num_decodes], block_size, w)
            ]
        self.tables = [stage.ints(list(c.block_table)) for c in chunks[num_decodes:]]

    def build(self, views: _Views, device: torch.device | str) -> AttentionMetadata:
        """The step's metadata over the copied ``views`` (every per-window input built)."""
        bs = self.block_size
        meta = AttentionMetadata(
            self.chunks, bs, views[self.slots], self.num_decodes, device, use_native=False
        )
        tables = [views[h] for h in self.tables]
        for w in self.windows:
            meta._decode_groups[w] = [
                _decode_group(views[rows], views[flat].view(-1, nb), views[lo], views[hi], bs, w)
                for rows, flat, lo, hi, nb in self.groups[w]
            ]
            meta._prefills[w] = _prefill_metas(self.chunks, self.num_decodes, bs, device, w, tables)
        return meta


class _IntStager(Protocol):
    def ints(self, values: Sequence[int]) -> int: ...


class _Views(Protocol):
    def __getitem__(self, handle: int) -> torch.Tensor: ...


@dataclass(slots=True)
class _DecodeGroupLists:
    """One decode group as host lists (``_decode_group_lists``)."""

    rows: list[int]
    tables: list[list[int]]  # padded to the group's block count
    lo: list[int]  # first visible key, counted from the row's first gathered block
    hi: list[int]  # one past the last visible key, same origin


def _decode_group_lists(
    decodes: Sequence[ChunkSpec], block_size: int, window: int | None
) -> list[_DecodeGroupLists]:
    """The decode groups of ``_decode_groups`` as host lists."""
    if not decodes:
        return []
    ends = [c.start_pos + 1 for c in decodes]  # keys [first, end) are visible
    firsts = [0 if window is None else max(0, e - window) for e in ends]
    first_blks = [f // block_size for f in firsts]
    n_blks = [(e + block_size - 1) // block_size - fb for e, fb in zip(ends, first_blks)]
    tables = [list(c.block_table[fb : fb + nb]) for c, fb, nb in zip(decodes, first_blks, n_blks)]
    out: list[_DecodeGroupLists] = []
    for rows in _length_groups(n_blks):
        nb = max(n_blks[i] for i in rows)
        out.append(
            _DecodeGroupLists(
                rows,
                [tables[i] + [0] * (nb - len(tables[i])) for i in rows],
                # Positions counted from each row's first gathered block.
                [firsts[i] - first_blks[i] * block_size for i in rows],
                [ends[i] - first_blks[i] * block_size for i in rows],
            )
        )
    return out


def _decode_group(
    rows: torch.Tensor,
    block_tables: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    block_size: int,
    window: int | None,
) -> DecodeGroup:
    """A ``DecodeGroup`` from its tensors; the mask is computed where they are."""
    pos = torch.arange(block_tables.shape[1] * block_size, dtype=torch.int64, device=hi.device)
    mask = pos[None, :] < hi[:, None]
    if window is not None:
        mask &= pos[None, :] >= lo[:, None]
    return DecodeGroup(rows=rows, block_tables=block_tables, mask=mask[:, None, None, :])


def _decode_groups(
    decodes: Sequence[ChunkSpec],
    block_size: int,
    device: torch.device | str,
    window: int | None = None,
) -> list[DecodeGroup]:
    """Decodes grouped by similar context length, with padded block tables and masks.

    With a ``window``, each decode's table starts at the block holding its oldest visible
    key, and the mask also hides the keys of that block older than the window.
    """
    groups: list[DecodeGroup] = []
    for g in _decode_group_lists(decodes, block_size, window):
        groups.append(
            _decode_group(
                torch.tensor(g.rows, dtype=torch.int64, device=device),
                torch.tensor(g.tables, dtype=torch.int64, device=device),
                torch.tensor(g.lo, dtype=torch.int64, device=device),
                torch.tensor(g.hi, dtype=torch.int64, device=device),
                block_size,
                window,
            )
        )
    return groups


def _prefill_metas(
    chunks: Sequence[ChunkSpec],
    num_decodes: int,
    block_size: int,
    device: torch.device | str,
    window: int | None = None,
    tables: Sequence[torch.Tensor] | None = None,
) -> list[PrefillMeta]:
    """Per prefill chunk: where its queries are and, over a cached prefix, the slots of its
    context and the causal (and, with a ``window``, sliding) mask over it.

    ``tables``: each prefill chunk's block table already on ``device`` (the runner's
    device path stages them); None builds them from the chunks' lists.
    """
    prefills: list[PrefillMeta] = []
    q_start = num_decodes
    for j, c in enumerate(chunks[num_decodes:]):
        ctx_slots = mask = None
        total = c.start_pos + c.num_tokens
        windowed = window is not None and total > window
        # The oldest key any query of the chunk sees.
        first = max(0, c.start_pos - window + 1) if window is not None else 0
        if c.start_pos > 0:
            table = (
                torch.tensor(list(c.block_table), dtype=torch.int64, device=device)
                if tables is None
                else tables[j]
            )
            ctx_slots = _slots(
                table, torch.arange(first, total, dtype=torch.int64, device=device), block_size
            )
        if c.start_pos > 0 or windowed:
            # Query i sits at position start_pos + i; key j at position first + j (the
            # fresh K/V alone when there is no cached prefix: then first == start_pos == 0).
            q_pos = torch.arange(c.start_pos, total, dtype=torch.int64, device=device)[:, None]
            k_pos = torch.arange(first, total, dtype=torch.int64, device=device)[None, :]
            mask = k_pos <= q_pos
            if windowed:
                assert window is not None
                mask &= k_pos > q_pos - window
        prefills.append(PrefillMeta(q_start, c.num_tokens, c.start_pos, ctx_slots, mask))
        q_start += c.num_tokens
    return prefills
