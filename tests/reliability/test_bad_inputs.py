"""Bad inputs: each raises a clear exception at the call and leaves no state behind.

Every row here has a matching row in docs/errors.md. After each rejected call the
engine still serves requests, the request id used is not reserved (it works at
once), and nothing is held in the core or the KV cache.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import nbengine as nb
from nbengine.model.errors import ModelLoadError

from .sizes import ENGINE_KW
from support.engine_state import assert_quiescent
from support.requests import WAIT_S

SP = nb.SamplingParams

# (field values, exception type, a fragment of the message naming the problem)
BAD_PARAMS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"n": 0}, ValueError, "n must be at least 1"),
    ({"n": 1.5}, TypeError, "n must be an int"),
    ({"temperature": -0.5}, ValueError, "temperature must be non-negative"),
    ({"temperature": float("nan")}, ValueError, "temperature must be finite"),
    ({"temperature": "hot"}, TypeError, "temperature must be a number"),
    ({"top_p": 0.0}, ValueError, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, ValueError, "top_p must be in (0, 1]"),
    ({"top_k": -2}, ValueError, "top_k must be 0 or -1"),
    ({"top_k": 2.0}, TypeError, "top_k must be an int"),
    ({"min_p": 1.5}, ValueError, "min_p must be in [0, 1]"),
    ({"seed": 1.5}, TypeError, "seed must be an int"),
    ({"max_tokens": 0}, ValueError, "max_tokens must be at least 1"),
    ({"max_tokens": "3"}, TypeError, "max_tokens must be an int"),
    ({"min_tokens": -1}, ValueError, "min_tokens must be at least 0"),
    ({"min_tokens": 5, "max_tokens": 2}, ValueError, "min_tokens must be less than or equal"),
    ({"stop": 3}, TypeError, "stop must be a string or a list of strings"),
    ({"stop": [""]}, ValueError, "stop must not contain an empty string"),
    ({"stop": ["ok", 1]}, TypeError, "stop must contain only strings"),
    ({"stop_token_ids": 5}, TypeError, "stop_token_ids must be a list of ints"),
    ({"stop_token_ids": [-1]}, ValueError, "stop_token_ids must be at least 0"),
    ({"ignore_eos": "yes"}, TypeError, "ignore_eos must be True or False"),
    ({"include_stop_str_in_output": 1}, TypeError, "include_stop_str_in_output must be True"),
    ({"skip_special_tokens": None}, TypeError, "skip_special_tokens must be True or False"),
    ({"presence_penalty": 3.0}, ValueError, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3.0}, ValueError, "frequency_penalty must be in [-2, 2]"),
    ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty must be greater than zero"),
    ({"logprobs": -2}, ValueError, "logprobs must be at least -1"),  # -1: whole vocabulary
    ({"prompt_logprobs": -2}, ValueError, "prompt_logprobs must be at least -1"),
    ({"logit_bias": [1]}, TypeError, "logit_bias must be a dict"),
    ({"logit_bias": {-1: 1.0}}, ValueError, "logit_bias must be at least 0"),
    ({"logit_bias": {1: float("inf")}}, ValueError, "logit_bias must be finite"),
    ({"output_kind": 1}, TypeError, "output_kind must be a RequestOutputKind"),
    ({"stream_interval": 0}, ValueError, "stream_interval must be at least 1"),
    # Beyond what the sampler (float32, torch.Generator) can represent: named at the call.
    ({"n": 100_000}, ValueError, "n must be at most 1024"),
    ({"seed": 2**64}, ValueError, "seed must be a 64-bit integer"),
    ({"seed": -(2**63) - 1}, ValueError, "seed must be a 64-bit integer"),
    ({"temperature": 1e39}, ValueError, "temperature must be at most 3.403e+38"),
    ({"top_p": 1e-40}, ValueError, "top_p must be 0 or at least 1.175e-38"),
    ({"repetition_penalty": 1e39}, ValueError, "repetition_penalty must be at most"),
    ({"repetition_penalty": 1e-300}, ValueError, "repetition_penalty must be 0 or at least"),
    ({"logit_bias": {1: 1e39}}, ValueError, "logit_bias of token 1 must be within"),
]


def _works(engine: nb.Engine, request_id: str = "probe") -> None:
    """The engine still serves, and ``request_id`` is free."""
    out = engine.generate(
        "Once upon", SP(max_tokens=3, ignore_eos=True), request_id=request_id
    ).result(timeout=WAIT_S)
    assert out.request_id == request_id
    assert len(out.outputs[0].token_ids) == 3
    assert_quiescent(engine)


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    BAD_PARAMS,
    ids=[",".join(k) + f"={list(k.values())[0]!r}" for k, _, _ in BAD_PARAMS],
)
def test_invalid_sampling_params_raise_naming_the_field(
    kwargs: dict[str, Any], exc: type[Exception], fragment: str
) -> None:
    with pytest.raises(exc) as info:
        SP(**kwargs)
    assert fragment in str(info.value)


def test_request_level_rejections_leave_no_state(engine: nb.Engine) -> None:
    vocab = engine.vocab_size
    max_len = engine.max_model_len
    cases: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
        # (prompt, generate kwargs, exception, message fragment)
        ("hi", {"request_id": 5}, TypeError, "request_id must be a string"),
        ("hi", {"request_id": b"x"}, TypeError, "request_id must be a string"),
        ("", {}, ValueError, "The prompt is empty"),
        ([], {}, ValueError, "The prompt is empty"),
        (None, {}, TypeError, "prompt must be a str or a list of token ids"),
        (b"abc", {}, TypeError, "prompt must be a str or a list of token ids"),
        ([5] * (max_len + 1), {}, ValueError, f"more than max_model_len={max_len}"),
        ("hello " * max_len, {}, ValueError, f"more than max_model_len={max_len}"),
        ([1, -1], {}, ValueError, "outside the model's vocabulary"),
        ([1, vocab], {}, ValueError, f"outside the model's vocabulary (0..{vocab - 1})"),
        ([1, 10**12], {}, ValueError, "outside the model's vocabulary"),
        ([1, 2.0], {}, TypeError, "Prompt token ids must be ints"),
        ([1, True], {}, TypeError, "Prompt token ids must be ints"),
        ("bad \ud800 text", {}, ValueError, "has a lone surrogate '\\ud800' at character 4"),
        (
            "hi",
            {"sampling_params": {"max_tokens": 3}},
            TypeError,
            "sampling_params must be a SamplingParams",
        ),
        ("hi", {"priority": "high"}, TypeError, "priority must be an int"),
        (
            "hi",
            {"sampling_params": SP(logprobs=vocab + 1)},
            ValueError,
            "more log-probabilities than the model's vocabulary",
        ),
        (
            "hi",
            {"sampling_params": SP(prompt_logprobs=vocab + 1)},
            ValueError,
            "more log-probabilities than the model's vocabulary",
        ),
    ]
    for prompt, kw, exc, fragment in cases:
        rid = kw.get("request_id", "bad-input")
        kw = {"request_id": "bad-input", **kw}
        with pytest.raises(exc) as info:
            engine.generate(prompt, **kw)
        assert fragment in str(info.value), (prompt, kw, str(info.value))
        assert engine.is_alive
        assert engine.num_unfinished_requests() == 0
        if isinstance(rid, str):
            _works(engine, rid)  # the id was not reserved
    _works(engine)


def test_out_of_vocab_ids_in_params(engine: nb.Engine) -> None:
    """stop_token_ids beyond the vocabulary never match; logit_bias keys beyond it are
    refused at generate() (as vLLM does): a bias that can never apply is a mistake."""
    vocab = engine.vocab_size
    with pytest.raises(
        ValueError, match=r"logit_bias names token ids outside the model's vocabulary"
    ):
        engine.generate("Once upon", SP(logit_bias={vocab + 7: 5.0}), request_id="lb")
    _works(engine, "lb")
    for params in (
        SP(max_tokens=4, ignore_eos=True, stop_token_ids=[vocab + 7]),
        # Up to the engine's max_logprobs (vLLM's default 20; tests/structured covers -1).
        SP(max_tokens=4, ignore_eos=True, logprobs=20),
    ):
        out = engine.generate("Once upon", params).result(timeout=WAIT_S)
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == 4
    _works(engine)


def test_bad_abort_arguments(engine: nb.Engine) -> None:
    with pytest.raises(TypeError, match="request ids must be a string or an iterable"):
        engine.abort(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="request ids must be strings"):
        engine.abort(["a", 5])  # type: ignore[list-item]
    assert engine.abort("never-seen") is None  # unknown: a no-op
    assert engine.abort(["x", "y"]) == [None, None]
    _works(engine)


def test_id_in_use_is_rejected_without_disturbing_the_live_request(engine: nb.Engine) -> None:
    live = engine.generate("Once upon", SP(max_tokens=100_000, ignore_eos=True), request_id="x")
    with pytest.raises(nb.RequestIdInUseError, match="'x' is already in use"):
        engine.generate("another", SP(max_tokens=2), request_id="x")
    assert not live.done()
    final = live.cancel(timeout=WAIT_S)
    assert final is not None and final.outputs[0].finish_reason == "abort"
    assert final.prompt == "Once upon"
    _works(engine, "x")


def test_generate_after_shutdown_raises(tiny_model: Path) -> None:
    engine = nb.Engine(str(tiny_model), **ENGINE_KW)
    engine.shutdown()
    with pytest.raises(nb.EngineDeadError, match="shut down"):
        engine.generate("hi")
    assert engine.abort("hi") is None  # abort after shutdown is a no-op
    engine.shutdown()  # idempotent


# --------------------------------------------------------------------- engines


def _copy(tiny_model: Path, tmp_path: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    return d


def _corrupt_config(d: Path) -> None:
    (d / "config.json").write_text("{not json")


def _garbage_weights(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"garbage" * 10)


def _truncated_weights(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _no_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


def _no_config(d: Path) -> None:
    (d / "config.json").unlink()


def _no_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").unlink()


def _bad_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").write_text("{}")


def _unknown_arch(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    cfg["model_type"] = "foo"
    (d / "config.json").write_text(json.dumps(cfg))


def _missing_tensor(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    w = load_file(str(d / "model.safetensors"))
    w.pop("model.norm.weight")
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})


def _config_field(name: str, value: Any) -> Any:
    def breaker(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg[name] = value
        (d / "config.json").write_text(json.dumps(cfg))

    breaker.__name__ = f"_{name}={value!r}"
    return breaker


def _sharded_outside(name: str) -> Any:
    """A shard index naming a file outside the model directory (which exists there)."""

    def breaker(d: Path) -> None:
        outside = d.parent / "outside.safetensors"
        shutil.copy(d / "model.safetensors", outside)
        (d / "model.safetensors").rename(d / "shard-1.safetensors")
        from safetensors import safe_open

        with safe_open(str(d / "shard-1.safetensors"), framework="pt") as f:
            keys = list(f.keys())
        target = str(outside) if name == "absolute" else "../outside.safetensors"
        index = {
            "weight_map": {
                k: (target if i == 0 else "shard-1.safetensors") for i, k in enumerate(keys)
            }
        }
        (d / "model.safetensors.index.json").write_text(json.dumps(index))

    breaker.__name__ = f"_index_{name}_path"
    return breaker


BROKEN_DIRS = [
    (
        _config_field("num_attention_heads", 0),
        ModelLoadError,
        "num_attention_heads must be a positive integer, got 0",
    ),
    (
        _config_field("max_position_embeddings", -5),
        ModelLoadError,
        "max_position_embeddings must be a positive integer, got -5",
    ),
    (
        _config_field("rms_norm_eps", None),
        ModelLoadError,
        "rms_norm_eps must be a positive finite number, got None",
    ),
    (_config_field("hidden_size", "64"), ModelLoadError, "hidden_size must be a positive integer"),
    (
        _config_field("num_key_value_heads", 3),
        ModelLoadError,
        "must be a multiple of num_key_value_heads (3)",
    ),
    (_config_field("rope_theta", float("inf")), ModelLoadError, "rope_theta must be a positive"),
    (
        _config_field("tie_word_embeddings", "yes"),
        ModelLoadError,
        "tie_word_embeddings must be true or false",
    ),
    (_config_field("rope_scaling", [1]), ModelLoadError, "rope_scaling must be an object"),
    (_sharded_outside("absolute"), ModelLoadError, "which is outside the model directory"),
    (_sharded_outside("dotdot"), ModelLoadError, "which is outside the model directory"),
    (_corrupt_config, ModelLoadError, "Cannot parse"),
    (_no_config, ModelLoadError, "config.json"),
    (_garbage_weights, ModelLoadError, "Cannot open weight file"),
    (_truncated_weights, ModelLoadError, "Cannot open weight file"),
    (_no_weights, ModelLoadError, "No weights"),
    (_missing_tensor, ModelLoadError, "model.norm.weight"),
    (_no_tokenizer, ModelLoadError, "No tokenizer.json"),
    (_bad_tokenizer, ModelLoadError, "Cannot load"),
    (_unknown_arch, ModelLoadError, "Unsupported architecture ['FooForCausalLM']"),
]


@pytest.mark.parametrize(
    ("breaker", "exc", "fragment"),
    BROKEN_DIRS,
    ids=[b.__name__.strip("_") for b, _, _ in BROKEN_DIRS],
)
def test_broken_model_directory(
    tiny_model: Path, tmp_path: Path, breaker: Any, exc: type[Exception], fragment: str
) -> None:
    d = _copy(tiny_model, tmp_path)
    breaker(d)
    with pytest.raises(exc) as info:
        nb.Engine(str(d), **ENGINE_KW)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)  # ModelLoadError is a ValueError


def test_missing_model_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        nb.Engine(str(tmp_path / "nope"))
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(ModelLoadError, match="is not a directory"):
        nb.Engine(str(f))
    with pytest.raises(TypeError, match="model must be a path"):
        nb.Engine(5)  # type: ignore[arg-type]


BAD_ENGINE_KW: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"foo": 1}, TypeError, "Unknown engine argument 'foo'"),
    ({"dtype": "float8"}, ValueError, "dtype must be one of"),
    ({"block_size": 0}, ValueError, "block_size must be at least 1"),
    ({"block_size": "16"}, TypeError, "block_size must be an int"),
    ({"num_kv_blocks": 0}, ValueError, "num_kv_blocks must be at least 1"),
    ({"num_kv_blocks": 8.5}, TypeError, "num_kv_blocks must be an int"),
    ({"max_num_seqs": 0}, ValueError, "max_num_seqs must be at least 1"),
    ({"max_num_seqs": 2.5}, TypeError, "max_num_seqs must be an int"),
    ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens must be at least 1"),
    ({"policy": "lifo"}, ValueError, "policy must be one of"),
    ({"max_model_len": 0}, ValueError, "max_model_len must be at least 1"),
    ({"max_model_len": 10**6}, ValueError, "larger than the model's maximum context"),
    ({"seed": "x"}, TypeError, "seed must be an int"),
    ({"stream_interval": 0}, ValueError, "stream_interval must be at least 1"),
    ({"kv_cache_memory_gb": 0}, ValueError, "kv_cache_memory_gb must be positive"),
    ({"kv_cache_memory_gb": float("nan")}, ValueError, "kv_cache_memory_gb must be finite"),
    ({"kv_cache_memory_gb": float("inf")}, ValueError, "kv_cache_memory_gb must be finite"),
    ({"kv_cache_memory_gb": 1e300}, ValueError, "kv_cache_memory_gb must be at most"),
    ({"kv_cache_memory_gb": 10**400}, ValueError, "kv_cache_memory_gb must be at most"),
    ({"gpu_memory_utilization": float("nan")}, ValueError, "gpu_memory_utilization must be"),
    ({"enable_prefix_caching": "no"}, TypeError, "enable_prefix_caching must be True or False"),
    ({"enable_chunked_prefill": 1}, TypeError, "enable_chunked_prefill must be True or False"),
]


def test_bad_engine_kwargs_raise_and_start_no_threads(tiny_model: Path) -> None:
    import threading

    before = {t.ident for t in threading.enumerate()}
    for kw, exc, fragment in BAD_ENGINE_KW:
        with pytest.raises(exc) as info:
            nb.Engine(str(tiny_model), **kw)
        assert fragment in str(info.value), (kw, str(info.value))
    assert {t.ident for t in threading.enumerate()} <= before
    # ... and a good engine starts fine afterwards.
    with nb.Engine(str(tiny_model), **ENGINE_KW) as engine:
        _works(engine)


def test_params_are_frozen_and_generate_keeps_its_own_copy(engine: nb.Engine) -> None:
    """Changing params after generate() cannot reach the request: the fields are frozen,
    and the lists and dicts inside are copied (and validated again) at the call."""
    params = SP(max_tokens=4, ignore_eos=True, logit_bias={5: 0.5}, stop=["zzz-never"])
    with pytest.raises(AttributeError):
        params.max_tokens = 1000  # type: ignore[misc]
    h = engine.generate("Once upon", params, request_id="frozen")
    params.logit_bias[-1] = 1.0  # type: ignore[index]   # killed the core when it got through
    out = h.result(timeout=WAIT_S)
    assert len(out.outputs[0].token_ids) == 4 and engine.is_alive
    # The same object, now invalid, is refused at the next call, naming the field.
    with pytest.raises(ValueError, match="logit_bias must be at least 0"):
        engine.generate("Once upon", params, request_id="frozen")
    params.stop.append("")  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="stop must not contain an empty string"):
        params.replace(logit_bias=None)
    longer = params.replace(max_tokens=6, logit_bias=None, stop=None)
    assert longer.max_tokens == 6 and params.max_tokens == 4
    assert (
        len(engine.generate("Once upon", longer).result(timeout=WAIT_S).outputs[0].token_ids) == 6
    )
    _works(engine, "frozen")


def test_a_bad_request_reaching_the_core_fails_alone(engine: nb.Engine) -> None:
    """Even a request that bypasses generate()'s checks cannot kill the core: the core
    validates again and fails that one request as FINISHED_ERROR."""
    from nbengine.core.messages import EngineCoreRequest

    bad = SP(max_tokens=4)
    object.__setattr__(bad, "logit_bias", {-1: 1.0})  # what a mutable params object allowed
    object.__setattr__(bad, "seed", 2**70)
    rejected: list[str] = []
    core = engine._core

    def add_bad(c: Any) -> None:
        c._handle_add(EngineCoreRequest("bad#1", [1, 2, 3], bad, 0.0))
        rejected.extend(
            o.error or "" for o in c.scheduler._pending.outputs if o.request_id == "bad#1"
        )

    engine._run_on_core(add_bad).result(WAIT_S)
    assert rejected and "must be" in rejected[0]
    assert engine.is_alive and core.num_unfinished_requests() == 0
    _works(engine)


def test_extreme_valid_params_sample_sensibly(engine: nb.Engine) -> None:
    """Values at the edge of float32 keep their meaning instead of turning the logits
    into NaN (which sampled the last vocabulary id)."""
    vocab = engine.vocab_size
    # 3e38 / 0.5 overflows float32: both biased tokens become the largest finite logit.
    forced = SP(
        max_tokens=6, temperature=0.5, seed=1, ignore_eos=True, logit_bias={7: 3.0e38, 9: 3.0e38}
    )
    ids = engine.generate("Once upon", forced).result(timeout=WAIT_S).outputs[0].token_ids
    assert set(ids) <= {7, 9}, ids
    # A tiny repetition penalty divides a seen token's positive logit past float32's range.
    prompt = [11, 12, 13, 14]
    rep = SP(
        max_tokens=4, seed=2, repetition_penalty=1.2e-38, logit_bias={12: 10.0}, ignore_eos=True
    )
    ids = engine.generate(prompt, rep).result(timeout=WAIT_S).outputs[0].token_ids
    assert ids == [12] * 4 and vocab - 1 not in ids, ids
    # A tiny top_p keeps the single most likely token: the same as greedy.
    greedy = engine.generate("Once upon", SP(max_tokens=6, temperature=0, ignore_eos=True))
    tiny_p = engine.generate("Once upon", SP(max_tokens=6, top_p=1.2e-38, seed=3, ignore_eos=True))
    assert (
        tiny_p.result(timeout=WAIT_S).outputs[0].token_ids
        == greedy.result(timeout=WAIT_S).outputs[0].token_ids
    )
    _works(engine)
