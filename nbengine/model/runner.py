"""ModelRunner: turns a SchedulerOutput into one forward pass and one sampled token per request.

Per step: flatten the scheduled chunks (single-token chunks first, so the attention op
can batch them), build input ids, positions and the attention metadata (slot mapping,
gather tables, masks) once, run the model under ``torch.inference_mode``, project to
logits only the rows that are needed (the last row of every chunk that samples, and the
prompt rows of requests that asked for ``prompt_logprobs``), then sample.

The execution path is chosen once, when the runner is built: the device path
(``uses_device_path``) or the host path, and on the host path how the model's logits are
computed (``_ModuleForward``, or ``_PlannedForward`` for a model that declares
``PlannedDecode``, model/protocol.py). With a plan, a decode-only step is one call for
the logits, or for the tokens themselves when every request's token is its logits'
argmax and nothing else is asked of them (``Sampler.argmax_suffices``).

The runner validates nothing user-facing (the frontend does); it asserts the
SchedulerOutput invariants cheaply.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nbengine.config import EngineConfig
from nbengine.core.request import Request
from nbengine.core.scheduler_output import (
    ModelRunnerOutput,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
)
from nbengine.core.spec_decode import prefix_view
from nbengine.lora.layers import LoRALayers
from nbengine.model.draft import DraftModelProposer
from nbengine.model.loader import LoadedModel, load_model
from nbengine.model.memory_plan import MemoryPlan, plan_memory
from nbengine.model.protocol import CausalLM, PlannedDecode
from nbengine.model.step_inputs import StagedInputs, StepStager
from nbengine.model.tokenizer import Tokenizer
from nbengine.ops.attention import (
    AttentionMetadata,
    ChunkSpec,
    StagedAttention,
    build_attention_metadata,
)
from nbengine.ops.linear import (
    amx_min_rows,
    linear_mode,
    pack_linears,
)
from nbengine.ops.quant import dense_min_rows, dense_supported
from nbengine.ops.rejection import accepted_drafts
from nbengine.ops.sampling import Sampler, topk_logprobs
from nbengine.ops.staged_sampling import StagedSampling, logprob_pieces, unpack_logprobs
from nbengine.outputs import PositionLogprobs

logger = logging.getLogger(__name__)


def kv_block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one KV block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


@dataclass(slots=True)
class _Step:
    """One step's flattened chunks as host lists (``ModelRunner._flatten``)."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    specs: list[ChunkSpec] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    # One entry per sample row: its chunk, and the request as the sampler sees it (a
    # chunk with drafts has one row per verified position: docs/speculative-decoding.md).
    sample_chunks: list[ScheduledChunk] = field(default_factory=list)
    sample_views: list[Request] = field(default_factory=list)
    has_drafts: bool = False
    # A seeded request with drafts: its generator's state before the step's draws (see
    # ``_rewind_seeded``), by request key.
    seeded_states: dict[str, tuple[torch.Generator, torch.Tensor]] = field(default_factory=dict)
    plp_rows: list[int] = field(default_factory=list)
    plp_targets: list[int] = field(default_factory=list)
    plp_ks: list[int] = field(default_factory=list)
    plp_spans: list[tuple[str, bool, int]] = field(default_factory=list)  # (key, lead None, n)
    lora_spans: list[tuple[int, int]] = field(default_factory=list)  # (adapter id, rows)


@dataclass(slots=True)
class _ForwardArgs:
    """A host step's model inputs, as ``CausalLM.__call__`` takes them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]


class _ModuleForward:
    """The host path's generic forward: the model over every row, then its head over the
    rows that are needed. Serves every ``CausalLM``."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model

    def greedy_tokens(self, step: _Step, args: _ForwardArgs) -> list[int] | None:
        """The step's sampled tokens computed without logits; None: sample the logits."""
        return None

    def logits(self, step: _Step, args: _ForwardArgs) -> torch.Tensor | None:
        """float32 logits of the sample rows, then the prompt-logprob rows; None when the
        step has neither (only intermediate prefill chunks)."""
        hidden = self.model(args.input_ids, args.positions, args.meta, args.kv_caches)
        rows = step.sample_rows + step.plp_rows
        if not rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64)])


class _PlannedForward(_ModuleForward):
    """The host path's forward for a ``PlannedDecode`` model: a decode-only step where
    every row samples goes to the model's decode plan first (one call for the logits, or
    for the tokens when their argmax is all the sampler would do); what the plan declines,
    and every other step, takes the generic forward."""

    def __init__(self, model: CausalLM, planned: PlannedDecode, sampler: Sampler) -> None:
        super().__init__(model)
        self.planned = planned  # the same object as ``model``, typed for its capability
        self.sampler = sampler

    @staticmethod
    def _decode_only(step: _Step, meta: AttentionMetadata) -> bool:
        return len(step.sample_rows) == meta.num_decodes == len(step.ids)

    def greedy_tokens(self, step: _Step, args: _ForwardArgs) -> list[int] | None:
        if not self._decode_only(step, args.meta) or not self.sampler.argmax_suffices(
            step.sample_views
        ):
            return None
        return self.planned.decode_greedy(args.input_ids, args.positions, args.meta, args.kv_caches)

    def logits(self, step: _Step, args: _ForwardArgs) -> torch.Tensor | None:
        if self._decode_only(step, args.meta):
            logits = self.planned.decode_logits(
                args.input_ids, args.positions, args.meta, args.kv_caches
            )
            if logits is not None:
                return logits
        return super().logits(step, args)


def uses_device_path(device: str, device_path: bool | None = None) -> bool:
    """Whether a runner on ``device`` takes the device path (docs/architecture.md,
    "Devices"): always off the CPU; on the CPU when asked (``device_path=True``) or, with
    ``device_path`` None, when the environment sets ``NBENGINE_DEVICE_PATH=1``."""
    if device != "cpu":
        return True
    if device_path is not None:
        return device_path
    return os.environ.get("NBENGINE_DEVICE_PATH", "0") == "1"


class ModelRunner:
    """Owns the model, its paged KV cache and the sampler.

    ``device_path``: run the CPU through the device path (see ``uses_device_path``);
    None decides from the device and ``NBENGINE_DEVICE_PATH``.
    """

    def __init__(self, config: EngineConfig, device_path: bool | None = None) -> None:
        self.config = config
        self.device: str = config.model.device
        # The device path: one staged input copy and one result copy per step, torch ops
        # only (no native kernels, no oneDNN packing, no decode plans).
        self.device_path: bool = uses_device_path(self.device, device_path)
        plans: list[MemoryPlan] = []

        def plan(
            files: list[Path], cfg: dict[str, Any], arch: str, dtype: torch.dtype, max_len: int
        ) -> None:
            plans.append(plan_memory(config, files, cfg, arch, dtype, max_len))

        # bfloat16 weights packed for the native kernels come from the load cache where it
        # has them (model/packed_cache.py; a oneDNN twin, as the plan decides, is made
        # again from the weights); not on the device path.
        pack_cache = (
            (lambda: plans[0].onednn_twin_bytes > 0)
            if config.model.quantization is None
            and not self.device_path
            and linear_mode() != "onednn"
            else None
        )
        # Weights + KV cache are checked against free memory before any weight is loaded.
        loaded: LoadedModel = load_model(config.model, before_weights=plan, pack_cache=pack_cache)
        self.memory_plan: MemoryPlan = plans[0]
        self.loaded = loaded
        self.model: CausalLM = loaded.model
        # The most rows of a decode step the model's decode plan may take (None: no limit).
        # A larger step runs the module path, whose products (oneDNN's) round differently:
        # the scheduler keeps speculative drafts from pushing a step past it.
        plan_max_rows: int | None = None
        self.decode_plan_max_rows: int | None = None
        if (
            loaded.model is not None
            and loaded.dtype == torch.bfloat16
            and config.model.quantization is None
            and not self.device_path
        ):
            # Native (or oneDNN) prepacked weights; on AMX CPUs with a oneDNN twin for
            # products of many rows, as the memory plan decided (ops/linear.py).
            twin = self.memory_plan.onednn_twin_bytes > 0
            n_packed = pack_linears(loaded.model, config.scheduler.max_num_seqs, twin)
            how = " (with oneDNN twins)" if twin else ""
            logger.info(
                "Packed %d bfloat16 linear layers%s (%d more from the load cache).",
                n_packed,
                how,
                loaded.packed_from_cache,
            )
            if loaded.pack_cache is not None:  # a miss: store them for the next load
                loaded.pack_cache.store(loaded.model)
                loaded.pack_cache = None
            tiles = amx_min_rows(twin)
            if tiles is not None:
                # From that many rows the products run on AMX tiles (or the twins) and
                # round otherwise than alone: larger decode steps take the module path,
                # and speculative drafts keep a step below it.
                plan_max_rows = tiles - 1
        elif (
            loaded.model is not None
            and loaded.dtype == torch.bfloat16
            and config.model.quantization is not None
            and not self.device_path
            and dense_supported()
        ):
            # Quantized products of many rows dequantize into oneDNN (ops/quant.py), so
            # larger decode steps take the module path there too.
            plan_max_rows = dense_min_rows() - 1
        # LoRA adapters (docs/lora.md): hooks on the linear layers as packed or quantized.
        self.lora: LoRALayers | None = (
            LoRALayers(loaded.model, self.device, loaded.dtype) if config.lora.enable_lora else None
        )
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.dtype = loaded.dtype
        self.block_size: int = config.cache.block_size
        self.max_model_len: int = loaded.max_model_len
        self.vocab_size: int = loaded.vocab_size
        self.eos_token_ids: frozenset[int] = loaded.eos_token_ids
        # Every layer windowed: the scheduler frees KV blocks behind this window.
        self.kv_sliding_window: int | None = loaded.kv_sliding_window

        m = self.model
        per_block = kv_block_bytes(
            m.num_layers, self.block_size, m.num_kv_heads, m.head_dim, self.dtype
        )
        # The plan sized the pool from config.json; the built model must agree with it.
        assert per_block == self.memory_plan.kv_block_bytes, "memory plan disagrees with the model"
        n_blocks = self.memory_plan.num_kv_blocks
        self.num_kv_blocks: int = n_blocks
        shape = (n_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        dev = self.device
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=self.dtype, device=dev),
                torch.zeros(shape, dtype=self.dtype, device=dev),
            )
            for _ in range(m.num_layers)
        ]
        # The distinct attention windows of the model's layers (None: full attention).
        self._windows: tuple[int | None, ...] = tuple(set(m.layer_windows))
        self._stager = StepStager(dev)
        assert config.model.seed is not None, "ModelConfig draws a seed when given none"
        self.sampler = Sampler(config.model.seed, config.model.logprobs_mode)
        # The execution path, chosen once: each step runs _execute_step, whose forward
        # (host path) is the model's decode plan where it declares one.
        self._forward: _ModuleForward = _ModuleForward(m)
        if isinstance(m, PlannedDecode):
            # Native decode plans are the CPU default path's; the device path runs torch ops.
            m.configure_decode_plans(enabled=not self.device_path, max_rows=plan_max_rows)
            self.decode_plan_max_rows = plan_max_rows
            self._forward = _PlannedForward(m, m, self.sampler)
        self._execute_step: Callable[[_Step, ModelRunnerOutput], ModelRunnerOutput] = (
            self._execute_on_device if self.device_path else self._execute_on_host
        )
        # Speculative decoding with a draft model: its proposer (model/draft.py), which the
        # engine core hands to the scheduler; None for other methods.
        self.draft_proposer: DraftModelProposer | None = None
        if config.speculative.method == "draft_model":
            self.draft_proposer = DraftModelProposer.load(config, loaded)
        logger.info(
            "Loaded %s from %s (%s on %s%s, max_model_len=%d); "
            "KV cache: %d blocks of %d tokens (%.1f MiB).",
            loaded.architecture,
            loaded.path,
            self.dtype,
            self.device,
            ", device path" if self.device_path else "",
            self.max_model_len,
            n_blocks,
            self.block_size,
            n_blocks * per_block / (1 << 20),
        )

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        """Compute the scheduled chunks, write their K/V, sample where ``chunk.sample``."""
        out = ModelRunnerOutput()
        if batch.is_empty:
            return out
        step = self._flatten(batch)
        lora = self.lora
        if lora is None or not lora.begin_step(step.lora_spans):
            return self._execute_step(step, out)
        # A step with adapter rows runs the module path: the decode plan's one native
        # call cannot add the deltas (docs/lora.md, "Cost").
        planned = self.model if isinstance(self.model, PlannedDecode) else None
        if planned is not None:
            planned.pause_decode_plans(True)
        try:
            return self._execute_step(step, out)
        finally:
            lora.end_step()
            if planned is not None:
                planned.pause_decode_plans(False)

    def _execute_on_host(self, step: _Step, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """One step on the CPU's default path: the forward chosen at construction, then
        the sampler (unless the forward produced the tokens itself)."""
        meta = build_attention_metadata(step.specs, self.block_size)
        forward = self._forward
        with torch.inference_mode():
            args = _ForwardArgs(
                torch.tensor(step.ids, dtype=torch.int64),
                torch.tensor(step.positions, dtype=torch.int64),
                meta,
                self.kv_caches,
            )
            tokens = forward.greedy_tokens(step, args)
            if tokens is not None:
                self._sampled(step, tokens, [None] * len(tokens), out)
                return out
            logits = forward.logits(step, args)
            if logits is None:  # only intermediate prefill chunks: nothing to sample
                return out
            n_s = len(step.sample_rows)
            tokens, lps = self.sampler(logits[:n_s], step.sample_views)
            self._sampled(step, tokens, lps, out)
            if step.plp_spans:
                plp = topk_logprobs(logits[n_s:].log_softmax(dim=-1), step.plp_targets, step.plp_ks)
                self._prompt_logprobs(step, plp, out)
        return out

    @staticmethod
    def _sampled(
        step: _Step,
        tokens: list[int],
        lps: list[PositionLogprobs | None],
        out: ModelRunnerOutput,
    ) -> None:
        """Hand each sampling chunk its token; a chunk with drafts its verified run (the
        accepted drafts and the token sampled after them, ops/rejection.py)."""
        if not step.has_drafts:
            for c, tok, lp in zip(step.sample_chunks, tokens, lps):
                out.sampled[c.request.request_id] = SampledToken(tok, lp)
            return
        row = 0
        chunks = step.sample_chunks
        while row < len(chunks):
            c = chunks[row]
            drafts = c.draft_token_ids
            if not drafts:
                out.sampled[c.request.request_id] = SampledToken(tokens[row], lps[row])
                row += 1
                continue
            n = len(drafts) + 1  # the chunk's rows: one per verified position
            m = accepted_drafts(drafts, tokens[row : row + n])
            rid = c.request.request_id
            out.spec_sampled[rid] = [
                SampledToken(tokens[row + j], lps[row + j]) for j in range(m + 1)
            ]
            seeded = step.seeded_states.get(rid)
            if seeded is not None:
                ModelRunner._rewind_seeded(*seeded, m + 1)
            row += n

    @staticmethod
    def _rewind_seeded(generator: torch.Generator, before: torch.Tensor, kept: int) -> None:
        """Leave a seeded request's generator as if only its ``kept`` positions had drawn.

        The sampler draws one uniform per random row, in row order, from the request's
        own generator (ops/sampling.py, ``draw_uniforms``): the kept positions used the
        first ``kept`` draws of the step, exactly the draws their plain steps would
        have made. Undoing the rejected rows' draws keeps every later position on the
        same draw as without speculation, so a seeded request's tokens are those of a
        run without it, whichever steps carry drafts (core/spec_decode.py, ``DraftPolicy``).
        """
        if torch.equal(generator.get_state(), before):
            return  # its rows drew nothing (greedy)
        generator.set_state(before)
        for _ in range(kept):
            torch.rand(1, dtype=torch.float64, generator=generator)

    def _flatten(self, batch: SchedulerOutput) -> _Step:
        """The step's chunks flattened (single-token chunks first) into host lists."""
        chunks: list[ScheduledChunk] = [c for c in batch.chunks if c.num_tokens == 1]
        chunks += [c for c in batch.chunks if c.num_tokens != 1]
        bs = self.block_size
        step = _Step()
        # Bound once: this loop runs per chunk on every step of the CPU's default path too.
        ids, positions, specs = step.ids, step.positions, step.specs
        sample_rows, sample_chunks = step.sample_rows, step.sample_chunks
        sample_views = step.sample_views
        max_len = self.max_model_len
        row = 0
        for c in chunks:
            req = c.request
            end = c.start_pos + c.num_tokens
            assert 0 < c.num_tokens and end <= req.num_tokens, "chunk beyond the request's tokens"
            assert c.sample == (end == req.num_tokens), "sample flag disagrees with chunk end"
            assert len(c.block_table) * bs >= end, "block table too short for the chunk"
            assert end <= max_len, "chunk beyond max_model_len"
            ids.extend(req.all_token_ids[c.start_pos : end])
            drafts = c.draft_token_ids
            # The request's rows in this step, its drafts' rows included: each gets its
            # adapter's delta (docs/lora.md).
            step.lora_spans.append((req.lora_int_id, c.num_tokens + len(drafts)))
            if drafts:
                # Speculative decoding: the drafts follow the decoded token, each position
                # a one-token row of its own (a decode at that position). Every layer
                # writes the step's K/V before it attends (ops/attention_kernels.py,
                # the decode plan's kernel alike), so row j sees the rows before it
                # exactly as a chunk would, and a step of decodes and drafts stays a
                # decode step (the decode plan's fast path). Every row samples.
                n = len(drafts)
                assert c.num_tokens == 1 and c.sample, "drafts only follow a decode"
                assert len(c.block_table) * bs >= end + n, "block table too short for drafts"
                assert end + n <= max_len, "drafts beyond max_model_len"
                ids.extend(drafts)
                positions.extend(range(c.start_pos, end + n))
                step.has_drafts = True
                seed = req.sampling_params.seed
                if seed is not None:
                    if req.generator is None:  # as the sampler would create it
                        req.generator = torch.Generator().manual_seed(seed)
                    gen = req.generator
                    step.seeded_states[req.request_id] = (gen, gen.get_state())
                for j in range(n + 1):
                    specs.append(ChunkSpec(c.start_pos + j, 1, c.block_table))
                    sample_rows.append(row + j)
                    sample_chunks.append(c)
                    sample_views.append(prefix_view(req, drafts[:j]))
                row += 1 + n
                continue
            positions.extend(range(c.start_pos, end))
            specs.append(ChunkSpec(c.start_pos, c.num_tokens, c.block_table))
            if c.sample:
                sample_rows.append(row + c.num_tokens - 1)
                sample_chunks.append(c)
                sample_views.append(req)
            k = req.sampling_params.prompt_logprobs
            # Prompt logprobs are produced during the first prefill only (no outputs yet).
            if k is not None and req.num_output_tokens == 0 and c.start_pos < req.num_prompt_tokens:
                last = min(end, req.num_prompt_tokens - 1)  # logits at p predict token p + 1
                count = max(0, last - c.start_pos)
                for p in range(c.start_pos, c.start_pos + count):
                    step.plp_rows.append(row + p - c.start_pos)
                    step.plp_targets.append(req.all_token_ids[p + 1])
                    step.plp_ks.append(k)
                step.plp_spans.append((req.request_id, c.start_pos == 0, count))
            row += c.num_tokens
        return step

    @staticmethod
    def _prompt_logprobs(step: _Step, plp: list[PositionLogprobs], out: ModelRunnerOutput) -> None:
        """Hand each request its prompt logprobs (a leading None for its first token)."""
        i = 0
        for key, lead_none, count in step.plp_spans:
            entries: list[PositionLogprobs | None] = [None] if lead_none else []
            entries.extend(plp[i : i + count])
            i += count
            out.prompt_logprobs[key] = entries

    # --- the device path (docs/architecture.md, "Devices") ---------------------------

    def _execute_on_device(self, step: _Step, out: ModelRunnerOutput) -> ModelRunnerOutput:
        """One step with one host-to-device copy of its inputs and one device-to-host copy
        of its results; nothing else in between waits for the device."""
        stager = self._stager
        stager.reset()
        h_ids, h_pos = stager.ints(step.ids), stager.ints(step.positions)
        attention = StagedAttention(step.specs, self.block_size, self._windows, stager)
        rows = step.sample_rows + step.plp_rows
        h_rows = stager.ints(rows)
        sampling = StagedSampling(self.sampler, step.sample_views, self.vocab_size, stager)
        plp_ks = [self.vocab_size if k < 0 else k for k in step.plp_ks]
        h_plp = stager.ints(step.plp_targets) if step.plp_rows else -1
        views = self._to_device(stager)
        with torch.inference_mode():
            result = self._device_step(
                views, h_ids, h_pos, attention, h_rows, len(rows), sampling, h_plp, plp_ks
            )
        if result is None:  # only intermediate prefill chunks: nothing to sample
            return out
        host = self._to_host(result).tolist()
        tokens, lps, at = sampling.unpack(host, 0)
        self._sampled(step, tokens, lps, out)
        if step.plp_spans:
            plp, _ = unpack_logprobs(host, at, step.plp_targets, plp_ks)
            self._prompt_logprobs(step, plp, out)
        return out

    def _device_step(
        self,
        views: StagedInputs,
        h_ids: int,
        h_pos: int,
        attention: StagedAttention,
        h_rows: int,
        n_rows: int,
        sampling: StagedSampling,
        h_plp: int,
        plp_ks: list[int],
    ) -> torch.Tensor | None:
        """The forward pass and the sampler, on the device, from the staged ``views``;
        returns the results packed into one float64 vector (None: nothing sampled)."""
        meta = attention.build(views, self.device)
        hidden = self.model(views[h_ids], views[h_pos], meta, self.kv_caches)
        if not n_rows:
            return None
        logits = self.model.compute_logits(hidden[views[h_rows]])
        n_s = sampling.n
        pieces = sampling.sample(logits[:n_s], views)
        if h_plp >= 0:
            plp = logits[n_s:].log_softmax(dim=-1)
            pieces += logprob_pieces(plp, views[h_plp], max(plp_ks))
        return torch.cat([p.to(torch.float64).flatten() for p in pieces])

    def _to_device(self, stager: StepStager) -> StagedInputs:
        """The step's one host-to-device copy (``non_blocking`` from pinned memory)."""
        return stager.to_device()

    def _to_host(self, result: torch.Tensor) -> torch.Tensor:
        """The step's one device-to-host copy (it waits for the step to finish)."""
        return result.to("cpu")

    def shutdown(self) -> None:
        """Drop the model and the KV cache tensors."""
        self.kv_caches = []
        self.draft_proposer = None
        self.model = None  # type: ignore[assignment]
        self._forward = None  # type: ignore[assignment]
        self.loaded = None  # type: ignore[assignment]
