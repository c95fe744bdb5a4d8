"""DecodePlan: a Llama-family decoder stack run by one native call per decode-only step.

The module path (model/llama.py) already runs every bfloat16 operation in a native kernel,
but between them sit about ten Python calls per layer; for a small model decoding one
sequence that is a third of the step. For steps in which every scheduled chunk is a
single token, ``DecodePlan.run`` hands the whole stack to ``nb_decoder_decode``
(ops/kernels.c), which chains the same kernels in the same order, so the results are
bit-identical to the module path (tests/model/test_decode_plan.py checks that).

With weight-only quantization (ops/quant.py) the plan runs the quantized kernels in
place of the bfloat16 ones, with the same per-call choices (rows below or above the tile
threshold), so it stays bit-identical to the module path.

With the head in the plan, a step is one call from token ids: the kernel looks up their
embeddings itself (``DecodePlan.logits``), and for a greedy step whose requests need
nothing but the argmax (``DecodePlan.greedy``) it picks each row's token too (as the
sampler's native argmax does), so no Python runs between the token ids and the next
tokens.

A plan is built once per model and KV cache: it holds raw pointers to the model's packed
weights and to the cache tensors, which stay alive and in place for the runner's life.

Threads: with one or two sequences, the kernel splits every weight stream between the
threads of one parallel region (one core cannot read memory at full speed). That is
about a third faster on an idle machine and twice as slow when another process holds
the second core, so ``ThreadChooser`` times both and keeps the faster (by the mean of
its recent steps without the slowest), re-trying one thread when the team's steps slow
down and the team now and then. Both give the same values (each output is computed by
one thread alone).
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from nbengine.ops import native
from nbengine.ops.attention import AttentionMetadata
from nbengine.ops.linear import NativeLinear
from nbengine.ops.quant import QuantLinear

if TYPE_CHECKING:
    from collections.abc import Sequence

    from nbengine.model.llama import DecoderLayer, LlamaForCausalLM

_P = ctypes.c_void_p


class _Layer(ctypes.Structure):
    _fields_ = [
        *[
            (name, _P)
            for name in (
                "input_norm",
                "post_norm",
                "qkv",
                "qkv_bias",
                "o",
                "o_bias",
                "gate_up",
                "gate_up_bias",
                "down",
                "down_bias",
                "k_cache",
                "v_cache",
            )
        ],
        ("window", ctypes.c_int64),  # sliding window; 0: full attention
        *[(name, _P) for name in ("qkv_scales", "o_scales", "gate_up_scales", "down_scales")],
    ]


class _Decoder(ctypes.Structure):
    _fields_ = [
        *[
            (name, ctypes.c_int64)
            for name in (
                "num_layers",
                "hidden",
                "intermediate",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "block_size",
            )
        ],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cos", _P),
        ("sin", _P),
        ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", _P),
        ("lm_head", _P),
        ("vocab", ctypes.c_int64),
        ("qbits", ctypes.c_int64),
        ("qgroup", ctypes.c_int64),
        ("lm_head_scales", _P),
        ("embed", _P),
    ]


class ThreadChooser:
    """Picks 1 or ``n`` threads for the plan's small steps by their recent timings.

    Each choice keeps its last ``window`` step times and is judged by their mean without
    the slowest one: one slow step (a first call that pays for page faults and the thread
    pool's start) cannot turn the choice, and neither can the scattered slow steps of a
    two-thread plan whose spinning partner lost its core for a moment to another thread
    of this process, as long as its steps stay faster on average. The team is timed
    ``min_samples`` times first, then one thread: a first one-thread step slower than
    ``drift`` times the team's score keeps the team at once (on an idle machine it takes
    about twice as long: a fresh engine's first decode then pays for one such step, not
    ``min_samples``), and otherwise both are timed ``min_samples`` times before either is
    preferred. After that the other choice is re-timed now and then (probed) in case the
    machine changed, and how often depends on which one is kept, because a probe costs a
    step at the slower choice's speed:

    - **One thread kept.** Its steps do not show when the team would be faster again (a
      core that another process frees does not speed up one thread), so the team is
      probed on a schedule: ``first_probe`` calls after the choice turned, then at twice
      the previous distance after each probe that changed nothing, up to every
      ``probe_every`` calls. So a choice made during a busy spell of a few hundred
      milliseconds is undone soon after it, and a lasting one costs a probe in 64 steps.
    - **The team kept.** Its own steps show what would make one thread faster: a core
      lost to another process slows every team step (the partner spins at the barriers
      while it waits). So one thread is probed as soon as the team's score has grown to
      ``drift`` times its score when it was last chosen or confirmed, and otherwise only
      every ``team_probe_every`` calls. On an idle machine a one-thread probe takes twice
      a team step, and the schedule above probed five times in a 256-token W2 (about 2%
      of its time, and all of its slowest steps; docs/benchmarks.md, "W2 int8 against
      CTranslate2 on the Intel host").

    (An exponential average of all timings, the first version, let one slow step keep a
    two-thread plan on one thread for hundreds of steps; the median of five, the second,
    turned to one thread whenever three of five two-thread steps were slow, which on two
    CPUs shared with the engine's other threads happened every hundred steps or so, and
    stayed there until the next probe: W2 bf16 repeats ran at 10.5 or 20 ms a token.)
    """

    def __init__(
        self,
        probe_every: int = 64,
        window: int = 8,
        min_samples: int = 3,
        first_probe: int = 8,
        team_probe_every: int = 1024,
        drift: float = 1.2,
    ) -> None:
        if not 2 <= min_samples <= window:
            raise ValueError(f"min_samples must be in 2..window, got {min_samples}")
        if drift <= 1.0:
            raise ValueError(f"drift must be above 1, got {drift}")
        self.probe_every = probe_every
        self.first_probe = min(first_probe, probe_every)
        self.team_probe_every = team_probe_every
        self.drift = drift
        self._distance = self.first_probe  # calls from one probe to the next
        self._next_probe = 0  # the call that probes next, once a choice is kept
        self.min_samples = min_samples
        self.samples: dict[int, deque[float]] = {}
        self.window = window
        self.calls = 0
        self._kept = 0  # the faster choice by the scores; 0 while both are being timed
        self._probe_again = False
        self._reference = 0.0  # the team's score when last chosen or confirmed

    def choose(self, n: int) -> int:
        if n <= 1:
            return 1
        self.calls += 1
        if self._kept not in (0, 1, n):  # the thread count changed: time both again
            self.samples.clear()
            self._kept = 0
        if not self._kept:  # still timing: the team first, then one thread
            return n if len(self.samples.get(n, ())) < self.min_samples else 1
        other = 1 if self._kept == n else n
        if self._probe_again:
            return other
        if self._kept == n and _score(self.samples[n]) > self.drift * self._reference:
            return other  # the team slowed down: has one thread become faster?
        if self.calls >= self._next_probe:
            distance = self.team_probe_every if self._kept == n else self._distance
            self._next_probe = self.calls + distance
            return other
        return self._kept

    def record(self, threads: int, seconds: float) -> None:
        samples = self.samples.setdefault(threads, deque(maxlen=self.window))
        samples.append(seconds)
        if len(self.samples) < 2:
            return
        if not self._kept and min(map(len, self.samples.values())) < self.min_samples:
            # Not both timed fully yet: choose only if one thread is clearly the slower.
            team = self.samples[max(self.samples)]
            fastest_one = min(self.samples[1])
            if len(team) < self.min_samples or fastest_one <= self.drift * _score(team):
                return
        before = self._kept
        probing = bool(before) and threads != before
        self._kept = kept = min(self.samples, key=lambda k: _score(self.samples[k]))
        # A probe faster than the kept choice's score is repeated at once: after a busy
        # spell the choice turns back within a few steps instead of a few probes' worth.
        self._probe_again = probing and threads != kept and seconds < _score(self.samples[kept])
        if kept > 1 and (kept != before or (probing and not self._probe_again)):
            # The team chosen or confirmed: its score now is what later steps are held to.
            self._reference = _score(self.samples[kept])
            self._next_probe = self.calls + self.team_probe_every
        elif kept != before:  # one thread chosen (or the first choice): probe soon
            self._distance = self.first_probe
            self._next_probe = self.calls + self._distance
        elif probing and not self._probe_again:  # a probe that changed nothing: back off
            self._distance = min(2 * self._distance, self.probe_every)
            self._next_probe = self.calls + self._distance


def _score(values: deque[float]) -> float:
    """The mean without the largest value (the value itself when there is one)."""
    if len(values) == 1:
        return values[0]
    return (sum(values) - max(values)) / (len(values) - 1)


class DecodePlan:
    """The native decode path for one model and one set of KV cache tensors."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kernels: native.NativeKernels,
    ) -> None:
        a = model.args
        self._fn = kernels.decoder_decode
        self.cache_key = cache_key(kv_caches)
        # The runner's list of cache tensors, replaced (never changed in place) when the
        # cache is: the same list means the same key, without reading 2 x layers pointers.
        self.kv_caches = kv_caches
        # Every tensor the C structs point into is also held here, so a parameter replaced
        # on the model later cannot leave the plan pointing at freed memory.
        self._tensors: list[torch.Tensor] = []

        def ptr(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            self._tensors.append(t)
            return t.data_ptr()

        model_layers = _decoder_layers(model)
        first = model_layers[0].self_attn.qkv_proj
        # Weight-only quantization (ops/quant.py): every linear in one format, or none.
        mode = first.mode if isinstance(first, QuantLinear) else None

        def weights(lin: nn.Module) -> tuple[int | None, int | None]:
            lin = _native(lin)
            if isinstance(lin, QuantLinear):
                return ptr(lin._q), ptr(lin._s)
            return ptr(lin._w), None

        def bias(lin: nn.Module) -> int | None:
            return ptr(_native(lin)._b)

        layers = (_Layer * a.num_layers)()
        for i, (layer, (kc, vc)) in enumerate(zip(model_layers, kv_caches)):
            attn, mlp = layer.self_attn, layer.mlp
            (qkv, qkv_s), (o, o_s) = weights(attn.qkv_proj), weights(attn.o_proj)
            (gu, gu_s), (down, down_s) = weights(mlp.gate_up_proj), weights(mlp.down_proj)
            layers[i] = _Layer(
                ptr(layer.input_layernorm.weight),
                ptr(layer.post_attention_layernorm.weight),
                qkv,
                bias(attn.qkv_proj),
                o,
                bias(attn.o_proj),
                gu,
                bias(mlp.gate_up_proj),
                down,
                bias(mlp.down_proj),
                ptr(kc),
                ptr(vc),
                attn.window or 0,
                qkv_s,
                o_s,
                gu_s,
                down_s,
            )
        rot = model.rotary
        head = model.lm_head
        # The head runs in the plan when it is a native linear without bias, in the
        # layers' format (else in Python).
        head_kind = QuantLinear if mode is not None else NativeLinear
        self.has_lm_head = (
            isinstance(head, head_kind)
            and _native(head)._b is None
            and getattr(head, "mode", None) == mode
            and getattr(head, "is_native", True)
            and model.norm.weight.dtype == torch.bfloat16
        )
        head_w, head_s = weights(head) if self.has_lm_head else (None, None)
        # With the head in the plan, a step is one call from token ids (``logits``,
        # ``greedy``) when the embedding table is a plain bfloat16 matrix the kernel can
        # read rows of: a torch embedding lookup took 20-225 us a step on the core thread.
        embed = model.embed_tokens.weight
        self.reads_token_ids = (
            self.has_lm_head and embed.dtype == torch.bfloat16 and embed.is_contiguous()
        )
        self._layers = layers  # referenced by the struct: keep alive
        self._decoder = _Decoder(
            a.num_layers,
            a.hidden_size,
            a.intermediate_size,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            kv_caches[0][0].shape[1],
            model_layers[0].input_layernorm.eps,
            model_layers[0].self_attn.scale,
            ptr(rot.cos),
            ptr(rot.sin),
            layers,
            ptr(model.norm.weight),
            head_w,
            a.vocab_size,
            0 if mode is None else (8 if cast(QuantLinear, first).group_size is None else 4),
            (cast(QuantLinear, first).group_size or 0) if mode is not None else 0,
            head_s,
            ptr(embed) if self.reads_token_ids else None,
        )
        self.hidden = a.hidden_size
        self.vocab = a.vocab_size
        self.threads = ThreadChooser()
        empty = torch.empty(0)
        self._buffers: tuple[torch.Tensor, ...] = (empty, empty, empty, empty)
        self._scratch_rows = 0

    def run(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual)`` after every layer, from embeddings ``x [B, hidden]`` (overwritten)."""
        residual = torch.empty_like(x)
        self._call(x, residual, None, positions, meta)
        return x, residual

    def logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """float32 logits ``[B, vocab]`` from token ids ``input_ids [B]`` int64 (needs
        ``reads_token_ids``).

        The result is this plan's scratch buffer: valid until its next call (the runner
        samples from it at once; see ``_scratch``)."""
        assert self.reads_token_ids
        x, residual, logits, _ = self._scratch(input_ids.shape[0])
        self._call(x, residual, logits, positions, meta, input_ids)
        return logits

    def greedy(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> list[int]:
        """Each row's greedy next token (the logits' first maximum, as the sampler's argmax)
        from its token id ``input_ids [B]`` int64: embedding, layers, head and argmax in one
        call (needs ``reads_token_ids``)."""
        assert self.reads_token_ids
        x, residual, logits, tokens = self._scratch(input_ids.shape[0])
        self._call(x, residual, logits, positions, meta, input_ids, tokens)
        return tokens.tolist()

    def _scratch(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scratch tensors for ``b`` rows (embeddings, residual, logits, tokens), kept from
        one step to the next. Between kernels that stream tens of MiB through the caches,
        torch's allocation path runs cold (docs/benchmarks.md, "Per-step overhead"): four
        fresh tensors a step took about 0.2 ms of a W2 step through an ``Engine`` (not
        page faults: the core thread's count did not change); kept ones cost nothing."""
        if self._scratch_rows < b:  # one set, sized for the largest step so far
            x = torch.empty(b, self.hidden, dtype=torch.bfloat16)
            self._buffers = (
                x,
                torch.empty_like(x),
                torch.empty(b, self.vocab, dtype=torch.float32),
                torch.empty(b, dtype=torch.int64),
            )
            self._scratch_rows = b
        x, residual, logits, tokens = self._buffers
        return x[:b], residual[:b], logits[:b], tokens[:b]

    def _call(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        logits: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        token_ids: torch.Tensor | None = None,
        argmax: torch.Tensor | None = None,
    ) -> None:
        assert meta.token_block_tables is not None and meta.token_seq_lens is not None
        assert x.dtype == torch.bfloat16 and x.is_contiguous() and x.shape[1] == self.hidden
        b = x.shape[0]
        threads = torch.get_num_threads()
        small = b <= 2  # the kernel's weight-splitting path (see the module docstring)
        if small:
            threads = self.threads.choose(threads)
        if token_ids is not None:
            assert token_ids.dtype == torch.int64 and token_ids.is_contiguous()
        start = time.perf_counter()
        status = self._fn(
            ctypes.byref(self._decoder),
            x.data_ptr(),
            residual.data_ptr(),
            None if logits is None else logits.data_ptr(),
            positions.data_ptr(),
            meta.slot_mapping.data_ptr(),
            meta.token_block_tables.data_ptr(),
            meta.token_seq_lens.data_ptr(),
            b,
            meta.token_block_tables.shape[1],
            threads,
            None if token_ids is None else token_ids.data_ptr(),
            None if argmax is None else argmax.data_ptr(),
        )
        if status != 0:
            raise IndexError(f"token id outside the vocabulary of {self.vocab}")
        if small:
            self.threads.record(threads, time.perf_counter() - start)


def _decoder_layers(model: LlamaForCausalLM) -> Sequence[DecoderLayer]:
    """``model.layers``, typed: a model the plan runs has pre-norm ``DecoderLayer`` blocks
    (``build_decode_plan`` returns None for post-norm ones)."""
    return cast("Sequence[DecoderLayer]", model.layers)


def _native(lin: nn.Module) -> NativeLinear | QuantLinear:
    """A linear layer ``build_decode_plan`` checked to run natively, typed."""
    return cast("NativeLinear | QuantLinear", lin)


def cache_key(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, ...]:
    return tuple(t.data_ptr() for pair in kv_caches for t in pair)


def build_decode_plan(
    model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> DecodePlan | None:
    """A plan if every part of ``model`` runs natively (else None: use the module path)."""
    # Loaded already if the model runs natively at all (pack_linears built them for its
    # bfloat16 weights); a float32 model must not trigger a build here.
    kernels = native.loaded()
    a = model.args
    if kernels is None or a.qk_norm or a.hidden_act != "silu" or not kv_caches:
        return None
    # The kernel rotates whole heads in every layer, with pre-norm blocks.
    if a.post_norm or model.rotary.rotary_dim != a.head_dim or not all(a.layer_rope or (True,)):
        return None
    if not native.NativeKernels.cached_attention_supports(a.num_heads, a.num_kv_heads, a.head_dim):
        return None
    if model.rotary.cos.dtype != torch.float32:
        return None
    first = _decoder_layers(model)[0].self_attn.qkv_proj
    mode = first.mode if isinstance(first, QuantLinear) else None
    for layer, (kc, vc) in zip(_decoder_layers(model), kv_caches):
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if mode is None and not all(isinstance(m, NativeLinear) for m in linears):
            return None
        if mode is not None and not all(
            isinstance(m, QuantLinear) and m.is_native and m.mode == mode for m in linears
        ):
            return None
        if any(w.dtype != torch.bfloat16 or not w.is_contiguous() for w in norms):
            return None
        if not (
            kc.dtype == vc.dtype == torch.bfloat16 and kc.is_contiguous() and vc.is_contiguous()
        ):
            return None
    return DecodePlan(model, kv_caches, kernels)
