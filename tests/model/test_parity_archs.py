"""Greedy float32 parity with transformers for the newer architectures, sliding windows and
RoPE scalings, on tiny random checkpoints written by transformers itself (hf_tiny.py).

Windows are 8 tokens and blocks 4, so the long prompt (and every generation) crosses the
window and block boundaries; chunked prefill runs chunks over a cached prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_tiny import GEMMA2_WINDOW_SOFTCAP, make_hf_model
from nbe_driver import Driver

from nbengine.config import EngineConfig
from nbengine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")
from parity_setup import ParitySetup  # noqa: E402  (imports transformers)

LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(6)],
    "long_factor": [1.0 + 0.7 * i for i in range(6)],
}

CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # name: (arch, config fields, runner options)
    "mistral-window": ("mistral", {"sliding_window": 8}, {}),
    "qwen2-mixed-window-yarn": (
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 2,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
        {},
    ),
    "llama-dynamic-rope": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, {}),
    "gemma2": (
        "gemma2",
        GEMMA2_WINDOW_SOFTCAP,
        {},
    ),
    "gemma3": (
        "gemma3",
        {
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            "tie_word_embeddings": False,
            "layer_types": [
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
            },
        },
        {},
    ),
    # Phi-4-mini-like: partial rotary (3/4 of each head), longrope; short factors apply
    # while max_model_len stays within original_max_position_embeddings.
    "phi3-longrope-short": (
        "phi3",
        {
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 64,
            "rope_scaling": LONGROPE,
        },
        {"max_model_len": 64},
    ),
    "phi3-window": ("phi3", {"sliding_window": 8}, {}),
    "qwen3-every-layer-windowed": (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
        {},
    ),
    # The layers without rope are the windowed ones (transformers' default layer_types).
    "smollm3-window": (
        "smollm3",
        {"no_rope_layers": [1, 0, 1, 0], "use_sliding_window": True, "sliding_window": 8},
        {},
    ),
    "olmo2": ("olmo2", {}, {}),
}
TEXTS = [
    "Once upon a time, in a small village at the edge of a great forest, there lived a girl",
    "The quick brown fox",
    "Hi",
]
N_NEW = 20
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=list(CASES))
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ParitySetup:
    arch, cfg, runner = CASES[request.param]
    path = make_hf_model(tmp_path_factory.mktemp(request.param), arch, seed=1, **cfg)
    return ParitySetup(path, TEXTS, N_NEW, hf_attn="eager", stop_at_eos=False, **runner)


def test_prompts_cross_the_window() -> None:
    assert len(TEXTS[0]) > 40  # the long prompt alone spans several 8-token windows


def test_layer_windows_are_the_ones_transformers_uses(setup: ParitySetup) -> None:
    cfg = setup.hf.config
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * n
    expected = tuple(window if window and t == "sliding_attention" else None for t in types)
    assert setup.runner.model.layer_windows == expected


def test_greedy_matches_transformers(setup: ParitySetup) -> None:
    assert len(setup.prompts[0]) > 8
    got = Driver(setup.runner, stop_at_eos=False).generate(setup.prompts, GREEDY, N_NEW)
    refs = [setup.hf_greedy(i) for i in range(3)]
    assert got == refs
    assert len(set(refs[0])) > 3, "tiny model should not repeat one token"


def test_chunked_prefill_matches_transformers(setup: ParitySetup) -> None:
    d = Driver(setup.runner, chunk_size=3, stop_at_eos=False)
    got = d.generate(setup.prompts, GREEDY, N_NEW)
    assert got == [setup.hf_greedy(i) for i in range(3)]
    assert any(c.start_pos > 8 and c.num_tokens > 1 for b in d.steps for c in b.chunks)


def _engine_greedy(
    path: Path, prompts: dict[str, list[int]], **kwargs: Any
) -> tuple[dict[str, list[int]], int, int]:
    """Greedy tokens per request, the most KV blocks held at once, and prefix-hit tokens."""
    from nbengine.core.engine_core import EngineCore
    from nbengine.core.messages import EngineCoreRequest
    from nbengine.model.runner import ModelRunner

    core = EngineCore(
        EngineConfig.from_kwargs(path, dtype="float32", block_size=4, num_kv_blocks=64, **kwargs),
        ModelRunner,
    )
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    got: dict[str, list[int]] = {rid: [] for rid in prompts}
    most = 0
    for i, (rid, prompt) in enumerate(prompts.items()):
        core.add_request(EngineCoreRequest(rid, prompt, params, float(i)))
        while core.has_unfinished_requests():  # one after the other: the later ones hit
            for out in core.step().outputs:
                got[out.request_id] += out.new_token_ids
            most = max(most, core.scheduler.kv.num_used_blocks)
    kv = core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
    hits = kv.prefix_cache_hits
    core.shutdown()
    return got, most, hits


WINDOWED = [name for name, (_, cfg, _) in CASES.items() if cfg.get("sliding_window")]


@pytest.mark.parametrize("case", WINDOWED)
def test_engine_frees_blocks_behind_the_window_and_matches_transformers(
    case: str, tmp_path: Path
) -> None:
    arch, cfg, _ = CASES[case]
    path = make_hf_model(tmp_path / case, arch, seed=2, **cfg)
    s = ParitySetup(path, TEXTS, N_NEW, hf_attn="eager", stop_at_eos=False)
    long = s.prompts[0] * 2  # about 40 tokens: ten blocks, five windows
    prompts = {"a": long, "b": long[:30] + s.prompts[1], "c": long + s.prompts[2]}
    got, most, hits = _engine_greedy(path, prompts, max_num_batched_tokens=8)
    for rid, prompt in prompts.items():
        with torch.no_grad():
            ref = s.hf.generate(
                torch.tensor([prompt]), max_new_tokens=N_NEW, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert got[rid] == ref, rid
    assert hits > 0, "later prompts hit the prefix cache"
    full = -(-(len(prompts["c"]) + N_NEW - 1) // 4)  # the last sampled token is never computed
    if all(w is not None for w in s.runner.model.layer_windows):
        # Every layer is windowed: a request holds its window and the chunk being computed.
        assert most <= (8 + 8) // 4 + 2 < full
    else:
        assert most == full, "a global layer needs every block: none is freed"


def test_phi3_longrope_long_factors_match_transformers_past_the_original_length(
    tmp_path: Path,
) -> None:
    # max_model_len (256) exceeds original_max_position_embeddings (8): the long factors
    # apply everywhere, as in transformers for a prompt already past 8 tokens.
    path = make_hf_model(
        tmp_path / "phi3",
        "phi3",
        seed=3,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=8,
        rope_scaling=LONGROPE,
    )
    s = ParitySetup(path, TEXTS, N_NEW, hf_attn="eager", stop_at_eos=False)
    from nbengine.ops.rotary import rope_parameters

    spec = {**LONGROPE, "original_max_position_embeddings": 8}
    short, _ = rope_parameters(12, 10000.0, spec, max_positions=8, model_max_positions=256)
    long, _ = rope_parameters(12, 10000.0, spec, max_positions=256, model_max_positions=256)
    assert torch.equal(s.runner.model.rotary.inv_freq, long) and not torch.equal(long, short)
    got = Driver(s.runner, chunk_size=5, stop_at_eos=False).generate(s.prompts[:2], GREEDY, N_NEW)
    assert got == [s.hf_greedy(0), s.hf_greedy(1)]
    assert all(len(p) > 8 for p in s.prompts[:2])


def test_gemma3_legacy_config_fields_match_transformers(tmp_path: Path) -> None:
    # Configs written before layer_types / per-type rope_parameters: sliding_window_pattern,
    # rope_theta + rope_scaling for global layers, rope_local_base_freq for sliding ones.
    import json

    path = make_hf_model(
        tmp_path / "g3",
        "gemma3",
        seed=4,
        sliding_window=8,
        query_pre_attn_scalar=24,
        tie_word_embeddings=False,
    )
    cfg = json.loads((path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        cfg.pop(key, None)
    cfg.update(
        rope_theta=1000.0,
        rope_local_base_freq=10.0,
        sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    (path / "config.json").write_text(json.dumps(cfg))
    s = ParitySetup(path, TEXTS, N_NEW, hf_attn="eager", stop_at_eos=False)
    assert s.runner.model.layer_windows == (8, None, 8, None)
    got = Driver(s.runner, chunk_size=5, stop_at_eos=False).generate(s.prompts, GREEDY, N_NEW)
    assert got == [s.hf_greedy(i) for i in range(3)]
