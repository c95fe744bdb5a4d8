"""The runner's device path (docs/architecture.md, "Devices"), run on the CPU.

On a CUDA device every step takes this path: one staged host-to-device copy of the
step's inputs, the forward pass and the sampler on the device, one device-to-host copy
of the results. ``NBENGINE_DEVICE_PATH=1`` (or ``ModelRunner(..., device_path=True)``)
runs the same code on the CPU, so CI covers it without a GPU: greedy parity with
transformers for every architecture's tiny model, the engine's scheduling scenarios and
sampling parameters against the default CPU path, and the count of copies and syncs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_tiny import GEMMA2_WINDOW_SOFTCAP, make_hf_model
from nbe_driver import Driver
from torch.overrides import TorchFunctionMode

import nbengine as nb
from nbengine.config import EngineConfig
from nbengine.model.runner import ModelRunner
from nbengine.model.step_inputs import StepStager
from nbengine.sampling_params import SamplingParams, StructuredOutputsParams
from nbengine.testing import ARCHS, make_tiny_model

from support.scenarios import abort_and_readd_race

transformers = pytest.importorskip("transformers")
from parity_setup import ParitySetup  # noqa: E402  (imports transformers)

TEXTS = [
    "Once upon a time, in a small village at the edge of a great forest, there lived a girl",
    "The quick brown fox",
    "Hi",
]
N_NEW = 12
GREEDY = SamplingParams(temperature=0.0)
# Architectures only transformers' own classes write (tests/model/hf_tiny.py), with the
# features that change the attention path: windows, soft-capping, partial rotary.
HF_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": (
        "gemma2",
        GEMMA2_WINDOW_SOFTCAP,
    ),
    "gemma3": ("gemma3", {"sliding_window": 8, "query_pre_attn_scalar": 24}),
    "phi3": ("phi3", {"partial_rotary_factor": 0.75, "sliding_window": 8}),
    "smollm3": ("smollm3", {"no_rope_layers": [1, 0, 1, 0]}),
    "olmo2": ("olmo2", {}),
    "qwen3-windowed": (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
    ),
}


@pytest.fixture
def device_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Runners built during the test take the device path (on the CPU)."""
    monkeypatch.setenv("NBENGINE_DEVICE_PATH", "1")
    yield


@pytest.mark.parametrize("case", [*ARCHS, *HF_CASES])
def test_device_path_greedy_matches_transformers(
    case: str, tmp_path: Path, device_path: None
) -> None:
    if case in HF_CASES:
        arch, cfg = HF_CASES[case]
        path = make_hf_model(tmp_path / case, arch, seed=1, **cfg)
    else:
        path = make_tiny_model(tmp_path / case, arch=case, seed=1)
    s = ParitySetup(path, TEXTS, N_NEW, hf_attn="eager", stop_at_eos=False)
    assert s.runner.device_path
    # Chunks of 5 tokens: prefills over a cached prefix, then batched decodes.
    d = Driver(s.runner, chunk_size=5, stop_at_eos=False)
    got = d.generate(s.prompts, GREEDY, N_NEW)
    assert got == [s.hf_greedy(i) for i in range(len(TEXTS))]
    assert any(c.start_pos > 0 and c.num_tokens > 1 for b in d.steps for c in b.chunks)


# --- the engine: scheduling, sampling parameters, structured outputs -----------------

ENGINE_KW: dict[str, Any] = dict(
    dtype="float32",
    block_size=4,
    num_kv_blocks=40,  # small: long requests preempt each other
    max_num_seqs=6,
    max_num_batched_tokens=24,  # chunked prefill
    seed=7,
)


def _requests() -> list[tuple[str, SamplingParams]]:
    shared = "Once upon a time, in a small village at the edge of a great forest, "
    return [
        (shared + "there lived", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)),
        (shared + "a fox", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)),
        (
            shared + "the river",
            SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=25, ignore_eos=True),
        ),
        (
            "The quick brown fox",
            SamplingParams(temperature=1.0, top_p=0.8, seed=4, max_tokens=25, ignore_eos=True),
        ),
        (
            "Hello there",
            SamplingParams(temperature=0.7, min_p=0.05, seed=5, max_tokens=20, ignore_eos=True),
        ),
        (
            "Hi",
            SamplingParams(
                temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2, ignore_eos=True
            ),
        ),
        (
            "Hi again",
            SamplingParams(
                temperature=0.8, seed=6, max_tokens=8, logprobs=2, repetition_penalty=1.3
            ),
        ),
        (
            "Pick one:",
            SamplingParams(
                temperature=1.0,
                seed=8,
                max_tokens=10,
                structured_outputs=StructuredOutputsParams(regex="(cat|dog|bird)!"),
            ),
        ),
    ]


def _run(engine: nb.Engine) -> list[Any]:
    handles = [engine.generate(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(_requests())]
    return [h.result(timeout=120) for h in handles]


def _tokens(outs: list[Any]) -> list[tuple[tuple[int, ...], str | None]]:
    return [(tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


def _logprob_values(outs: list[Any]) -> list[tuple[int, int, float]]:
    """(request, token id, logprob) of every sampled and prompt position, in order."""
    vals: list[tuple[int, int, float]] = []
    for i, o in enumerate(outs):
        for d in [*(o.outputs[0].logprobs or []), *(o.prompt_logprobs or [])]:
            for t, lp in (d or {}).items():
                vals.append((i, t, lp.logprob))
    return vals


def test_engine_on_the_device_path_matches_the_cpu_path(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with nb.Engine(str(tiny_model), **ENGINE_KW) as cpu:
        assert not cpu._core.runner.device_path  # type: ignore[attr-defined]
        want = _run(cpu)
    monkeypatch.setenv("NBENGINE_DEVICE_PATH", "1")
    with nb.Engine(str(tiny_model), **ENGINE_KW) as dev:
        assert dev._core.runner.device_path  # type: ignore[attr-defined]
        got = _run(dev)
        kv = dev._core.scheduler.kv  # type: ignore[attr-defined]
        assert kv.prefix_cache_hits > 0, "the shared prefix hits the prefix cache"
        assert kv.num_free_blocks == kv.num_blocks, "every block is back in the pool"
    assert _tokens(got) == _tokens(want)
    g, w = _logprob_values(got), _logprob_values(want)
    assert [v[:2] for v in g] == [v[:2] for v in w]
    assert [v[2] for v in g] == pytest.approx([v[2] for v in w], abs=1e-4)
    assert re.fullmatch("(cat|dog|bird)!", got[-1].outputs[0].text)
    assert got[5].outputs[0].logprobs and got[5].prompt_logprobs


def test_preemption_on_the_device_path(tiny_model: Path, device_path: None) -> None:
    kw = {**ENGINE_KW, "num_kv_blocks": 24}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [f"Story {i}: once upon a time" for i in range(4)]
    with nb.Engine(str(tiny_model), **kw) as eng:
        outs = [h.result(timeout=120) for h in [eng.generate(p, params) for p in prompts]]
        assert eng._core.scheduler.total_preemptions > 0  # type: ignore[attr-defined]
        # Alone, each request runs without preemption: the same tokens.
        alone = [eng.generate(p, params).result(timeout=120) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)


def test_abort_and_readd_race_on_the_device_path(tiny_model: Path, device_path: None) -> None:
    with nb.Engine(str(tiny_model), num_kv_blocks=256, block_size=16, max_num_seqs=8) as eng:
        assert eng._core.runner.device_path  # type: ignore[attr-defined]
        abort_and_readd_race(eng, "abort-a", rounds=5)


# --- one copy each way per step, no other sync ------------------------------------------

# Calls that read a device tensor on the host (a sync on CUDA), or copy host data over.
_SYNCS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
    torch.nonzero,
}
_HOST_DATA = {torch.tensor, torch.as_tensor}


class _SyncRecorder(TorchFunctionMode):
    """Records host reads of tensors and tensors made from host data."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _SYNCS:
            self.calls.append(getattr(func, "__name__", str(func)))
        elif func in _HOST_DATA and isinstance(args[0] if args else None, (list, tuple)):
            self.calls.append(f"{func.__name__}(list)")
        elif func is torch.Tensor.to and any(
            isinstance(a, (str, torch.device)) for a in (*args[1:], *kwargs.values())
        ):
            self.calls.append("to(device)")
        return func(*args, **kwargs)


def test_one_copy_each_way_and_no_sync_per_step(tiny_model: Path, device_path: None) -> None:
    with nb.Engine(str(tiny_model), device="cpu", **ENGINE_KW) as eng:
        runner = eng._core.runner  # type: ignore[attr-defined]
        assert runner.device_path
        # Per step: [copies to the device, copies to the host, whether anything was sampled]
        steps: list[list[int]] = []
        syncs: list[str] = []
        to_device, to_host, device_step = runner._to_device, runner._to_host, runner._device_step

        def counted_to_device(stager: Any) -> Any:
            steps.append([1, 0, 0])
            return to_device(stager)

        def counted_to_host(result: torch.Tensor) -> torch.Tensor:
            steps[-1][1] += 1
            return to_host(result)

        def watched_step(*args: Any) -> Any:
            with _SyncRecorder() as rec:
                out = device_step(*args)
            syncs.extend(rec.calls)
            steps[-1][2] = int(out is not None)
            return out

        runner._to_device = counted_to_device
        runner._to_host = counted_to_host
        runner._device_step = watched_step
        # Greedy, top-k / top-p / min-p sampling, logprobs, prompt logprobs and a
        # structured output in the same steps (no penalties: see ops/staged_sampling.py).
        reqs = [r for r in _requests() if r[1].repetition_penalty == 1.0]
        handles = [eng.generate(p, sp) for p, sp in reqs]
        outs = [h.result(timeout=120) for h in handles]
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs)
    assert len(steps) > 10 and sum(s[2] for s in steps) > 10
    for to_dev, to_hst, sampled in steps:
        assert to_dev == 1, "one host-to-device copy per step"
        assert to_hst == sampled, "one device-to-host copy per step that samples, else none"
    assert syncs == [], "nothing else in a step reads a device tensor on the host"


def test_sync_recorder_sees_host_reads() -> None:
    # The recorder above must be able to fail: it sees .tolist(), bool() and .item().
    with _SyncRecorder() as rec:
        t = torch.arange(3)
        t.tolist()
        bool(t[0])
        t.sum().item()
        torch.tensor([1, 2])
    assert rec.calls == ["tolist", "__bool__", "item", "tensor(list)"]


def test_staged_inputs_come_back_as_they_went_in() -> None:
    stager = StepStager("cpu")
    for scale in (1, 50):  # the second step needs a larger buffer than the first
        stager.reset()
        ints = list(range(-3, 4 * scale))
        mask = torch.arange(15 * scale, dtype=torch.int32).view(3, 5 * scale) - 7
        flags = torch.tensor([True, False, True])
        h_i, h_f = stager.ints(ints), stager.floats([0.25, 1e-300, -2.5])
        h_m, h_b, h_e = stager.tensor(mask), stager.tensor(flags), stager.ints([])
        views = stager.to_device()
        assert views[h_i].tolist() == ints and views[h_i].dtype == torch.int64
        assert views[h_f].tolist() == [0.25, 1e-300, -2.5]
        assert torch.equal(views[h_m], mask) and torch.equal(views[h_b], flags)
        assert views[h_e].shape == (0,)


# --- configuration --------------------------------------------------------------------


def test_device_runner_direct_flag(tiny_model: Path) -> None:
    cfg = EngineConfig.from_kwargs(tiny_model, dtype="float32", num_kv_blocks=16)
    r = ModelRunner(cfg, device_path=True)
    assert r.device_path and r.device == "cpu"
    assert r.kv_caches[0][0].device.type == "cpu"
    assert json.dumps(r.device)  # a plain string
