"""The whole-stack native decode (model/decode_plan.py) == the module path, bit for bit.

Both paths run the same native kernels in the same order, so greedy tokens and their
log-probabilities must be identical, not merely close. Decoding many sequences at once
(with prefills of other requests in between) exercises its batch, threading and
KV-cache handling; qwen2 adds q/k/v biases.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nbengine.config import EngineConfig
from nbengine.core.engine_core import EngineCore
from nbengine.core.messages import EngineCoreRequest
from nbengine.model.decode_plan import ThreadChooser
from nbengine.model.runner import ModelRunner
from nbengine.ops import native
from nbengine.ops.linear import packed_linear_supported
from nbengine.sampling_params import SamplingParams
from nbengine.testing import make_tiny_model

from support.cpu_features import amx_only

# Required: a skip is reported loudly, and fails under NBENGINE_REQUIRE_ALL=1 (tests/conftest.py).
pytestmark = [
    pytest.mark.required,
    pytest.mark.skipif(
        native.kernels() is None, reason=f"native kernels: {native.unavailable_reason()}"
    ),
]


@pytest.fixture(autouse=True)
def _native_linears_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan runs the native kernels; so must the module path it is compared with (no
    oneDNN twins for the larger decode steps, ops/linear.py)."""
    monkeypatch.setenv("NBENGINE_LINEAR", "native")


# A model small enough for tests whose every shape the decode plan's kernels take.
PLAN_SHAPE = dict(
    hidden_size=128,
    intermediate_size=192,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
)


def _run(
    path: Path, plans: bool, threads: int, quantization: str | None = None
) -> tuple[dict[str, list[tuple[int, float]]], bool]:
    torch.set_num_threads(threads)
    core = EngineCore(
        EngineConfig.from_kwargs(
            path,
            dtype="bfloat16",
            max_num_seqs=24,
            max_num_batched_tokens=64,
            block_size=4,
            quantization=quantization,
        ),
        ModelRunner,
    )
    model = core.runner.model
    model.decode_plans_enabled = plans
    rng = random.Random(0)
    for i in range(20):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True, logprobs=1
        )
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, time.time()))
    got: dict[str, list[tuple[int, float]]] = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            lps = out.new_logprobs or []
            for tok, lp in zip(out.new_token_ids, lps):
                got.setdefault(out.request_id, []).append((tok, lp[tok].logprob))
    used = model._plan is not None
    core.shutdown()
    return got, used


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_plan_matches_module_path(tmp_path: Path, arch: str, threads: int) -> None:
    path = make_tiny_model(
        tmp_path / arch,
        arch,
        hidden_size=128,
        intermediate_size=192,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        weight_std=0.05,
    )
    fused, used = _run(path, plans=True, threads=threads)
    modular, used_modular = _run(path, plans=False, threads=threads)
    assert used and not used_modular, "the plan ran only where enabled"
    assert len(fused) == 20 and sum(map(len, fused.values())) > 100
    assert fused == modular


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_quantized_decode_plan_matches_module_path(
    tmp_path: Path, quantization: str, threads: int
) -> None:
    # intermediate 96: down_proj's inputs end in a partial int4 group.
    path = make_tiny_model(
        tmp_path / "m",
        "llama",
        hidden_size=128,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        weight_std=0.05,
    )
    fused, used = _run(path, plans=True, threads=threads, quantization=quantization)
    modular, used_modular = _run(path, plans=False, threads=threads, quantization=quantization)
    assert used and not used_modular, "the plan ran only where enabled"
    assert len(fused) == 20 and sum(map(len, fused.values())) > 100
    assert fused == modular


def test_sliding_window_model_decodes_through_the_plan(tmp_path: Path) -> None:
    # Contexts grow past the 8-token window (and blocks behind it are freed): the plan's
    # attention starts at each window like the module path's, token for token.
    path = make_tiny_model(
        tmp_path / "m",
        "mistral",
        hidden_size=128,
        intermediate_size=192,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        weight_std=0.05,
        sliding_window=8,
    )
    results = []
    for plans in (True, False):
        core = EngineCore(
            EngineConfig.from_kwargs(path, dtype="bfloat16", block_size=4), ModelRunner
        )
        core.runner.model.decode_plans_enabled = plans
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
        for i, prompt in enumerate(([5, 6, 7], [9, 10], [11, 12, 13, 14])):
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params, time.time()))
        got: dict[str, list[tuple[int, float]]] = {}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                for tok, lp in zip(out.new_token_ids, out.new_logprobs or []):
                    got.setdefault(out.request_id, []).append((tok, lp[tok].logprob))
        if plans:
            assert core.runner.model._plan is not None, "decodes ran through the plan"
        results.append(got)
        core.shutdown()
    assert sum(map(len, results[0].values())) == 48 and results[0] == results[1]


def _drive(chooser: ThreadChooser, calls: int, seconds: dict[int, float]) -> list[int]:
    """``calls`` decode steps through ``chooser`` on two threads, a step on ``k`` threads
    taking ``seconds[k]``: the thread counts it picked."""
    picks = []
    for _ in range(calls):
        k = chooser.choose(2)
        picks.append(k)
        chooser.record(k, seconds[k])
    return picks


def test_thread_chooser_keeps_the_faster_and_probes_the_other() -> None:
    times = {2: 0.0025, 1: 0.0038}  # two threads faster, as on an idle machine
    chooser = ThreadChooser(probe_every=4, window=5, min_samples=3, team_probe_every=1000)
    assert chooser.choose(1) == 1  # nothing to choose on one thread
    first = []
    for i in range(4):
        k = chooser.choose(2)
        first.append(k)
        # the very first two-thread step is slow (the pool's start): it must not count
        chooser.record(k, 0.050 if i == 0 else times[k])
    # The team is timed first; one thread's first step, 1.5x the team's, keeps the team.
    assert first == [2, 2, 2, 1], first

    def run(calls: int, two: float) -> list[int]:
        return _drive(chooser, calls, {2: two, 1: times[1]})

    # The team kept at a steady speed: one thread is not re-timed (each probe would cost
    # a step at its speed).
    assert run(200, times[2]) == [2] * 200

    # One slow two-thread step (another thread took a core for a moment) turns nothing
    # and probes nothing.
    chooser.record(2, 0.020)
    assert run(4, times[2]) == [2] * 4

    # Scattered slow two-thread steps (its spinning partner lost its core for a moment to
    # the engine's other threads), three in five but faster than one thread on average,
    # turn nothing either.
    for seconds in (0.0045, 0.0025, 0.0045, 0.0045, 0.0025):
        chooser.record(2, seconds)
    # (Their score passed 1.2x the team's, so one thread is probed once: it is slower.)
    assert run(4, times[2]) == [1, 2, 2, 2]

    # A lasting change (another process holds the second core): the team's steps slow
    # down, one thread is probed at once, and the choice turns.
    picks = run(8, 0.008)
    assert picks.index(1) <= 3 and picks[-4:].count(1) >= 3, picks  # (one may be a probe)

    # One thread kept: the team is probed on a schedule (one thread's steps cannot show
    # that the core is free again), and the first probe that beats the kept choice is
    # repeated at once, so two threads are back after a few steps, not a few probes apart.
    picks = run(8, times[2])
    first_probe = picks.index(2)
    assert first_probe < 4, picks  # probed within probe_every calls
    assert picks[first_probe : first_probe + 5] == [2, 2, 2, 2, 2], picks


@pytest.mark.parametrize(
    ("one", "kept"), [(0.0028, 2), (0.0022, 1)], ids=["one-thread-a-bit-slower", "one-faster"]
)
def test_thread_chooser_times_both_fully_unless_one_thread_is_clearly_slower(
    one: float, kept: int
) -> None:
    chooser = ThreadChooser(window=5, min_samples=3, drift=1.2)
    picks = _drive(chooser, 12, {2: 0.0025, 1: one})
    # 1.12x and 0.88x the team's time: not clear at once, so three steps of each.
    assert picks[:6] == [2, 2, 2, 1, 1, 1], picks
    assert picks[6:].count(kept) >= 5, picks


def test_thread_chooser_probes_one_thread_only_when_the_team_slows_down() -> None:
    chooser = ThreadChooser(window=5, min_samples=3, team_probe_every=100, drift=1.2)

    def run(calls: int, two: float) -> list[int]:
        return _drive(chooser, calls, {2: two, 1: 0.0060})

    picks = run(6 + 250, 0.0025)[6:]  # both timed, then two threads kept
    probes = [i for i, k in enumerate(picks) if k == 1]
    assert len(probes) == 2 and probes[1] - probes[0] in (100, 101), probes  # every 100 calls

    # Steps growing slowly (a longer context): the team is re-confirmed each time its score
    # has grown by a fifth, and each confirmation resets what later steps are held to.
    picks = run(60, 0.0031) + run(60, 0.0039)
    assert picks.count(1) == 2, picks
    assert picks[:5] == [2] * 5  # the first steps at the new speed do not trigger a probe
    assert picks.index(1) < 6 and picks[60:].index(1) < 6, picks


def test_thread_chooser_rejects_settings_it_cannot_work_with() -> None:
    with pytest.raises(ValueError, match="min_samples must be in 2..window"):
        ThreadChooser(min_samples=1)
    with pytest.raises(ValueError, match="drift must be above 1"):
        ThreadChooser(drift=1.0)


def test_thread_chooser_probes_soon_after_a_turn_to_one_thread_and_backs_off() -> None:
    chooser = ThreadChooser(probe_every=64, window=5, min_samples=3, first_probe=8)
    busy = {2: 0.0080, 1: 0.0038}  # another process holds the second core
    quiet = {2: 0.0025, 1: 0.0038}

    def run(calls: int, times: dict[int, float]) -> list[int]:
        return _drive(chooser, calls, times)

    picks = run(6 + 200, busy)[6:]  # both timed, then one thread kept
    probes = [i for i, k in enumerate(picks) if k == 2]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:3] == [16, 32, 64] and set(gaps[3:]) == {64}, probes  # 8, 16, 32, 64, 64...

    # Quiet: the team is back by the next probe (probe_every calls at most). Then a busy
    # spell of a dozen steps turns the choice to one thread again, and probes that fail
    # during it double their distance from first_probe, so once it is over the next one
    # comes about a spell's length later, not probe_every calls, and turns the choice back.
    assert run(80, quiet)[-8:] == [2] * 8
    assert run(12, busy)[-6:].count(1) >= 5  # (one of them may be a probe)
    picks = run(40, quiet)
    assert picks.index(2) <= 16 and picks[-8:] == [2] * 8, picks


# Nine query heads on three KV heads: split between two threads, the attention's share
# of one thread ends inside a KV head's group.
NINE_HEADS = dict(PLAN_SHAPE, hidden_size=288, num_attention_heads=9, num_key_value_heads=3)


@pytest.mark.parametrize("shape", [PLAN_SHAPE, NINE_HEADS], ids=["4-heads", "9-heads"])
def test_single_sequence_split_across_threads_matches(
    tmp_path: Path, shape: dict[str, int]
) -> None:
    # One sequence on two threads takes the kernel's weight- and head-splitting path; the
    # chooser tries both thread counts first, so both paths produce tokens here.
    path = make_tiny_model(tmp_path / "m", "llama", weight_std=0.05, **shape)
    results = []
    for plans in (True, False):
        torch.set_num_threads(2)
        core = EngineCore(
            EngineConfig.from_kwargs(path, dtype="bfloat16", block_size=4), ModelRunner
        )
        core.runner.model.decode_plans_enabled = plans
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
        core.add_request(EngineCoreRequest("one", [5, 6, 7], params, time.time()))
        got = []
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                got += [
                    (t, {k: v.logprob for k, v in lp.items()})
                    for t, lp in zip(out.new_token_ids, out.new_logprobs or [])
                ]
        plan = core.runner.model._plan
        if plans:
            assert plan is not None and set(plan.threads.samples) == {1, 2}
        results.append(got)
        core.shutdown()
    assert len(results[0]) == 12 and results[0] == results[1]


@pytest.mark.skipif(
    not packed_linear_supported(torch.bfloat16), reason="oneDNN bfloat16 prepacking unavailable"
)
def test_with_onednn_twins_large_decode_steps_take_the_module_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the linears carry oneDNN twins (AMX CPUs, ops/linear.py), the plan runs only
    the decode steps small enough for the native kernels; larger ones use the twins."""
    import nbengine.model.memory_plan as memory_plan
    from nbengine.ops.linear import ONEDNN_MIN_ROWS, NativeLinear

    monkeypatch.setenv("NBENGINE_LINEAR", "auto")
    monkeypatch.setattr(memory_plan, "onednn_twin_supported", lambda dtype: True)
    path = make_tiny_model(tmp_path / "m", "llama", **PLAN_SHAPE)
    core = EngineCore(
        EngineConfig.from_kwargs(path, dtype="bfloat16", max_num_seqs=24), ModelRunner
    )
    model = core.runner.model
    assert model.decode_plan_max_rows == ONEDNN_MIN_ROWS - 1
    linears = [m for m in model.modules() if isinstance(m, NativeLinear)]
    assert linears and all(m.has_onednn_twin for m in linears)
    rows_seen, _ = _twenty_then_alone(core)
    assert (20, False) in rows_seen and (1, True) in rows_seen
    assert all(used == (rows < ONEDNN_MIN_ROWS) for rows, used in rows_seen)


@amx_only
@pytest.mark.parametrize("linear", ["auto", "native"])
def test_with_amx_tiles_large_decode_steps_take_the_module_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linear: str
) -> None:
    """Where the native kernels run products of BF16_AMX_ROWS rows or more on AMX tiles
    (no oneDNN twin, the default), the plan runs only the smaller decode steps: a larger
    one rounds otherwise than its rows alone (docs/speculative-decoding.md)."""
    from nbengine.ops.linear import NativeLinear

    monkeypatch.setenv("NBENGINE_LINEAR", linear)
    path = make_tiny_model(tmp_path / "m", "llama", **PLAN_SHAPE)
    core = EngineCore(
        EngineConfig.from_kwargs(path, dtype="bfloat16", max_num_seqs=24), ModelRunner
    )
    model = core.runner.model
    assert model.decode_plan_max_rows == native.BF16_AMX_ROWS - 1
    linears = [m for m in model.modules() if isinstance(m, NativeLinear)]
    assert linears and not any(m.has_onednn_twin for m in linears)
    rows_seen, _ = _twenty_then_alone(core)
    assert (20, False) in rows_seen and (1, True) in rows_seen
    assert all(used == (rows < native.BF16_AMX_ROWS) for rows, used in rows_seen)


def _twenty_then_alone(
    core: EngineCore, between: Callable[[], None] = lambda: None
) -> tuple[list[tuple[int, bool]], int]:
    """Run 20 greedy requests of 6 tokens together, call ``between``, then one request
    alone; shut ``core`` down. Returns, for each decode step's calls into the model's plan
    entry points (``decode_greedy``, then ``decode_logits`` if that declined), the rows
    and whether the decode plan ran them; and the tokens the 20 produced."""
    model = core.runner.model
    rows_seen: list[tuple[int, bool]] = []

    def spy(entry: Callable[..., object]) -> Callable[..., object]:
        def call(input_ids: torch.Tensor, *args: object) -> object:
            out = entry(input_ids, *args)
            rows_seen.append((input_ids.shape[0], out is not None))
            return out

        return call

    model.decode_greedy = spy(model.decode_greedy)
    model.decode_logits = spy(model.decode_logits)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    produced = 0
    try:
        for i in range(20):
            core.add_request(EngineCoreRequest(f"r{i}", [5 + i, 7, 9], params, time.time()))
        while core.has_unfinished_requests():
            produced += sum(len(o.new_token_ids) for o in core.step().outputs)
        between()
        core.add_request(EngineCoreRequest("alone", [5, 7, 9], params, time.time()))
        while core.has_unfinished_requests():
            core.step()
    finally:
        core.shutdown()
    return rows_seen, produced


@pytest.mark.skipif(native.kernels() is None, reason="native kernels unavailable")
def test_quantized_large_steps_dequantize_into_onednn_and_small_ones_take_the_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the dense path (AMX CPUs, ops/quant.py), quantized decode steps of
    DENSE_MIN_ROWS rows or more take the module path, whose products dequantize the
    weights into oneDNN; smaller steps stay on the plan's row kernels."""
    import nbengine.model.runner as runner
    from nbengine.ops import quant

    monkeypatch.setattr(quant, "dense_supported", lambda: True)
    monkeypatch.setattr(runner, "dense_supported", lambda: True)
    # 20 rows count as many here (the real threshold is above this test's batch).
    monkeypatch.setattr(quant, "DENSE_MIN_ROWS", 12)
    dequantized: list[int] = []
    real = native.NativeKernels.dequantize

    def spy(
        self: native.NativeKernels, qweight: torch.Tensor, *args: object, **kw: object
    ) -> torch.Tensor:
        dequantized.append(qweight.shape[0])
        return real(self, qweight, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(native.NativeKernels, "dequantize", spy)
    path = make_tiny_model(tmp_path / "m", "llama", **PLAN_SHAPE)
    core = EngineCore(
        EngineConfig.from_kwargs(path, dtype="bfloat16", quantization="int8", max_num_seqs=24),
        ModelRunner,
    )
    assert core.runner.model.decode_plan_max_rows == 12 - 1
    before_alone: list[int] = []
    rows_seen, produced = _twenty_then_alone(core, lambda: before_alone.append(len(dequantized)))
    assert produced == 20 * 6
    assert before_alone[0] > 0, "the 20-row steps dequantized weights for oneDNN"
    assert len(dequantized) == before_alone[0], "the lone request's steps did not"
    assert (20, False) in rows_seen and (1, True) in rows_seen
    assert all(used == (rows < 12) for rows, used in rows_seen)


def test_plan_is_rebuilt_for_new_cache_tensors(tmp_path: Path) -> None:
    """The plan holds raw pointers into the KV cache: the same list of tensors reuses it,
    a new list (new tensors) gets a plan of its own."""
    from nbengine.model.decode_plan import cache_key

    path = make_tiny_model(tmp_path / "m", "llama", **PLAN_SHAPE)
    core = EngineCore(EngineConfig.from_kwargs(path, dtype="bfloat16", block_size=4), ModelRunner)
    model, caches = core.runner.model, core.runner.kv_caches
    first = model._decode_plan(caches)
    assert first is not None and model._decode_plan(caches) is first
    copies = [(k.clone(), v.clone()) for k, v in caches]
    second = model._decode_plan(copies)
    assert second is not None and second is not first
    assert second.cache_key == cache_key(copies) != first.cache_key
    core.shutdown()


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_steps_are_one_call_with_the_samplers_tokens(
    tmp_path: Path, quantization: str | None, threads: int
) -> None:
    """Greedy requests without logprobs take ``decode_greedy`` (the embedding lookup and
    the argmax inside the plan's call): the same tokens as the module path and its
    sampler, batch after batch; a request with logprobs still gets its logits."""
    path = make_tiny_model(tmp_path / "m", "llama", weight_std=0.05, **PLAN_SHAPE)
    results = []
    for plans in (True, False):
        torch.set_num_threads(threads)
        core = EngineCore(
            EngineConfig.from_kwargs(
                path, dtype="bfloat16", block_size=4, quantization=quantization
            ),
            ModelRunner,
        )
        model = core.runner.model
        model.decode_plans_enabled = plans
        calls: list[bool] = []  # per decode_greedy call: whether the plan ran the step

        def counted(
            *args: object,
            greedy: Callable[..., list[int] | None] = model.decode_greedy,
            calls: list[bool] = calls,
        ) -> list[int] | None:
            tokens = greedy(*args)
            calls.append(tokens is not None)
            return tokens

        model.decode_greedy = counted
        rng = random.Random(1)
        for i in range(8):
            prompt = [rng.randrange(3, 200) for _ in range(rng.randint(1, 12))]
            lp = 1 if i == 7 else None  # the last one asks for logprobs
            params = SamplingParams(
                max_tokens=rng.randint(4, 16), temperature=0, ignore_eos=True, logprobs=lp
            )
            core.add_request(EngineCoreRequest(f"r{i}", prompt, params, time.time()))
        got: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
                assert (out.new_logprobs is not None) == (out.request_id == "r7")
        core.shutdown()
        assert any(calls) == plans, "only the plan runs greedy steps in one call"
        results.append(got)
    assert sum(map(len, results[0].values())) > 60 and results[0] == results[1]


def test_greedy_call_rejects_a_token_outside_the_vocabulary(tmp_path: Path) -> None:
    from nbengine.ops.attention import ChunkSpec, build_attention_metadata

    path = make_tiny_model(tmp_path / "m", "llama", **PLAN_SHAPE)
    core = EngineCore(EngineConfig.from_kwargs(path, dtype="bfloat16", block_size=4), ModelRunner)
    model = core.runner.model
    plan = model._decode_plan(core.runner.kv_caches)
    assert plan is not None and plan.reads_token_ids
    meta = build_attention_metadata([ChunkSpec(0, 1, [0])], 4)
    positions = torch.zeros(1, dtype=torch.int64)
    assert len(plan.greedy(torch.tensor([5]), positions, meta)) == 1
    with pytest.raises(IndexError, match="vocabulary"):
        plan.greedy(torch.tensor([plan.vocab]), positions, meta)
    core.shutdown()
