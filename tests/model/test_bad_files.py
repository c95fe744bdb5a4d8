"""Hostile files in a model directory: each is a ModelLoadError naming the file, never a
hang or a crash (docs/errors.md, "Loading a model").

A model directory is untrusted input (a Hub repo anyone can publish): a safetensors header
nested 200,000 levels deep, a shape holding strings or null, offsets that do not match
the shape, a FIFO where a file should be, JSON config files nested beyond reason.
FIFO cases run ``nb.Engine`` on a thread with a generous hang-guard, so that a
regression fails the test instead of blocking the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import nbengine as nb
from nbengine.model.chat_template import ChatTemplate, ChatTemplateError
from nbengine.model.errors import ModelLoadError
from nbengine.model.files import json_depth_problem
from nbengine.model.weights import read_safetensors_header

ENGINE_KW: dict[str, Any] = {"num_kv_blocks": 16}
HANG_GUARD_S = 120.0  # far beyond a normal failed load: only a hang reaches it
DEEP = 200_000


def _copy(tiny_model: Path, tmp_path: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(tiny_model, d)
    return d


def _safetensors(path: Path, header: object, data: bytes = b"") -> None:
    """A safetensors file: 8-byte little-endian header length, JSON header, data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _deep(n: int) -> bytes:
    return b'{"a":' + b"[" * n + b"]" * n + b"}"


def _one_f32(**info: object) -> dict[str, object]:
    """A header of one F32 tensor ``x`` of 2 elements, with ``info`` changed."""
    return {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **info}}


# (header, data, a fragment of the message naming the problem)
BAD_HEADERS: list[tuple[str, object, bytes, str]] = [
    ("nested-200k", _deep(DEEP), b"", "deeper than"),
    ("shape-string", _one_f32(shape=["a"]), b"\0" * 8, "shape must be a list of"),
    ("shape-null", _one_f32(shape=[None]), b"\0" * 8, "shape must be a list of"),
    ("shape-negative", _one_f32(shape=[-2]), b"\0" * 8, "shape must be a list of"),
    ("shape-bool", _one_f32(shape=[True, 2]), b"\0" * 8, "shape must be a list of"),
    ("shape-not-list", _one_f32(shape=2), b"\0" * 8, "shape must be a list of"),
    ("dtype-unknown", _one_f32(dtype="F33"), b"\0" * 8, "dtype 'F33' is not a safetensors"),
    ("offsets-null", _one_f32(data_offsets=None), b"\0" * 8, "data_offsets must be"),
    ("offsets-strings", _one_f32(data_offsets=["0", "8"]), b"\0" * 8, "data_offsets must be"),
    ("offsets-reversed", _one_f32(data_offsets=[8, 0]), b"\0" * 8, "data_offsets must be"),
    ("offsets-past-end", _one_f32(), b"\0" * 4, "past the end"),
    ("offsets-huge", _one_f32(data_offsets=[0, 10**30]), b"\0" * 8, "needs 8"),
    ("size-mismatch", _one_f32(shape=[3]), b"\0" * 8, "needs 12"),
    ("huge-shape", _one_f32(shape=[2**62, 2**62]), b"\0" * 8, "needs"),
    (
        "overlap",
        {
            "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        b"\0" * 12,
        "overlap",
    ),
    ("gap", _one_f32(data_offsets=[4, 12]), b"\0" * 12, "gap"),
    ("trailing-bytes", _one_f32(), b"\0" * 16, "file holds 16"),
    ("entry-not-object", {"x": 5}, b"", "is not an object"),
    ("header-list", [1, 2], b"", "not a JSON object"),
    ("metadata-int", {"__metadata__": {"format": 1}, **_one_f32()}, b"\0" * 8, "__metadata__"),
    ("not-utf8", b'{"x\xff": 1}', b"", "UTF-8"),
    ("not-json", b"{nope", b"", "invalid safetensors header"),
]


@pytest.mark.parametrize(
    ("header", "data", "fragment"),
    [row[1:] for row in BAD_HEADERS],
    ids=[row[0] for row in BAD_HEADERS],
)
def test_bad_safetensors_header_is_a_model_load_error_naming_the_file(
    tiny_model: Path, tmp_path: Path, header: object, data: bytes, fragment: str
) -> None:
    d = _copy(tiny_model, tmp_path)
    _safetensors(d / "model.safetensors", header, data)
    with pytest.raises(ModelLoadError) as info:
        nb.Engine(str(d), **ENGINE_KW)
    message = str(info.value)
    assert str(d / "model.safetensors") in message and fragment in message, message


def test_header_length_beyond_the_file_and_a_short_file(tiny_model: Path, tmp_path: Path) -> None:
    d = _copy(tiny_model, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(ModelLoadError, match="header length"):
        nb.Engine(str(d), **ENGINE_KW)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(ModelLoadError, match="too short"):
        nb.Engine(str(d), **ENGINE_KW)


def _write_with_raw_tensor(
    path: Path, tensors: dict[str, torch.Tensor], raw: dict[str, Any]
) -> None:
    """A safetensors file of ``tensors`` plus ``raw`` entries (name -> (dtype, shape, bytes))."""
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    entries = [
        (name, str(t.dtype).removeprefix("torch."), list(t.shape), t.contiguous().numpy().tobytes())
        for name, t in tensors.items()
    ] + [(name, dtype, shape, blob) for name, (dtype, shape, blob) in raw.items()]
    names = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    for name, dtype, shape, blob in entries:
        header[name] = {
            "dtype": names.get(dtype, dtype),
            "shape": shape,
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    _safetensors(path, header, b"".join(blobs))


def test_a_tensor_torch_cannot_read_names_the_file_and_the_tensor(
    tiny_model: Path, tmp_path: Path
) -> None:
    d = _copy(tiny_model, tmp_path)
    weights = load_file(str(d / "model.safetensors"))
    norm = weights.pop("model.norm.weight")
    # F6_E2M3: a valid safetensors dtype (6 bits) that torch has no type for.
    blob = b"\0" * (norm.numel() * 6 // 8)
    _write_with_raw_tensor(
        d / "model.safetensors",
        {k: v.float() for k, v in weights.items()},
        {"model.norm.weight": ("F6_E2M3", list(norm.shape), blob)},
    )
    with pytest.raises(ModelLoadError) as info:
        nb.Engine(str(d), **ENGINE_KW)
    message = str(info.value)
    assert str(d / "model.safetensors") in message and "'model.norm.weight'" in message, message


def test_valid_headers_read_as_safetensors_reads_them(tiny_model: Path, tmp_path: Path) -> None:
    """The checks refuse nothing safetensors accepts: the tiny model's header, and a header
    with metadata, an empty tensor and a sub-byte dtype."""
    files = [tiny_model / "model.safetensors"]
    extra = tmp_path / "extra.safetensors"
    _safetensors(
        extra,
        {
            "__metadata__": {"format": "pt"},
            "empty": {"dtype": "BF16", "shape": [0, 4], "data_offsets": [0, 0]},
            "packed": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
            "ints": {"dtype": "I64", "shape": [1], "data_offsets": [2, 10]},
        },
        b"\0" * 10,
    )
    files.append(extra)
    for f in files:
        entries = read_safetensors_header(f)
        with safe_open(str(f), framework="pt") as handle:
            assert set(entries) == set(handle.keys())
            for name in handle.keys():
                assert list(entries[name].shape) == handle.get_slice(name).get_shape(), name


# --------------------------------------------------------------------- JSON files


@pytest.mark.parametrize(
    "name",
    ["config.json", "tokenizer_config.json", "generation_config.json"],
)
def test_json_nested_200k_deep_is_a_model_load_error_naming_the_file(
    tiny_model: Path, tmp_path: Path, name: str
) -> None:
    d = _copy(tiny_model, tmp_path)
    (d / name).write_bytes(_deep(DEEP))
    with pytest.raises(ModelLoadError) as info:
        nb.Engine(str(d), **ENGINE_KW)
    message = str(info.value)
    assert str(d / name) in message and "deeper than" in message, message


def _depth(value: object) -> int:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def test_json_depth_counts_only_brackets_outside_strings() -> None:
    """A valid file is never refused for brackets, quotes or escapes inside its strings."""
    samples: list[object] = [
        {"a": '[[[[\\"[[[', "b": [[1]]},
        ["\\", ["[[[["]],
        ['\\\\"', [["{{"]]],
        {'k"[': [[[{"x": "]]]]"}]]]},
        [[1], [2], [3]],
        "just [[[ a string",
        {"template": "{% for m in messages %}{{ m['content'] }}{% endfor %}" * 50},
    ]
    for value in samples:
        raw = json.dumps(value).encode()
        for limit in range(6):
            refused = json_depth_problem(raw, limit) is not None
            assert refused == (_depth(value) > limit), (raw, limit)


def _sharded(d: Path) -> Path:
    """``d`` as one shard plus an index; returns the shard."""
    shard = d / "model-00001-of-00001.safetensors"
    (d / "model.safetensors").rename(shard)
    with safe_open(str(shard), framework="pt") as f:
        index = {"weight_map": dict.fromkeys(f.keys(), shard.name)}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return shard


def test_a_deep_shard_index_is_a_model_load_error_naming_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    d = _copy(tiny_model, tmp_path)
    _sharded(d)
    (d / "model.safetensors.index.json").write_bytes(_deep(DEEP))
    with pytest.raises(ModelLoadError) as info:
        nb.Engine(str(d), **ENGINE_KW)
    message = str(info.value)
    assert str(d / "model.safetensors.index.json") in message and "deeper than" in message


# --------------------------------------------------------------------- FIFOs


def _engine_outcome(call: Callable[[], nb.Engine], fifos: list[Path]) -> BaseException | None:
    """What ``call()`` raised (None if it returned), within HANG_GUARD_S. A call still
    blocked then is released (each FIFO gets a writer that closes at once, so a reader
    blocked in open() sees end-of-file) and the test fails."""
    outcome: dict[str, BaseException] = {}

    def target() -> None:
        try:
            call().shutdown()
        except BaseException as exc:  # reported to the test thread
            outcome["exc"] = exc

    thread = threading.Thread(target=target, name="fifo-load", daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(HANG_GUARD_S)
        pytest.fail(f"nb.Engine() was still blocked after {HANG_GUARD_S:.0f} s on {fifos}")
    return outcome.get("exc")


FIFO_FILES = [
    "model.safetensors",
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "shard",  # a shard named by model.safetensors.index.json
]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("name", FIFO_FILES)
def test_a_fifo_in_place_of_a_model_file_is_refused_promptly(
    tiny_model: Path, tmp_path: Path, name: str
) -> None:
    d = _copy(tiny_model, tmp_path)
    target = _sharded(d) if name == "shard" else d / name
    target.unlink()
    os.mkfifo(target)
    exc = _engine_outcome(lambda: nb.Engine(str(d), **ENGINE_KW), [target])
    assert isinstance(exc, ModelLoadError), repr(exc)
    assert str(target) in str(exc) and "is not a regular file but a FIFO" in str(exc), str(exc)


def _template_outcome(d: Path, fifos: list[Path]) -> BaseException | None:
    """What ``ChatTemplate.from_dir(d)`` raised, within HANG_GUARD_S (as _engine_outcome)."""

    class _Loaded:
        def __init__(self) -> None:
            ChatTemplate.from_dir(d)

        def shutdown(self) -> None:
            pass

    return _engine_outcome(_Loaded, fifos)  # type: ignore[arg-type]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("name", ["special_tokens_map.json", "chat_template.jinja"])
def test_a_fifo_among_the_chat_template_files_is_refused_promptly(
    tiny_model: Path, tmp_path: Path, name: str
) -> None:
    d = _copy(tiny_model, tmp_path)
    target = d / name
    target.unlink(missing_ok=True)
    os.mkfifo(target)
    exc = _template_outcome(d, [target])
    assert isinstance(exc, ChatTemplateError), repr(exc)
    assert str(target) in str(exc) and "FIFO" in str(exc), str(exc)


def test_a_deep_special_tokens_map_is_a_chat_template_error_naming_it(
    tiny_model: Path, tmp_path: Path
) -> None:
    d = _copy(tiny_model, tmp_path)
    (d / "special_tokens_map.json").write_bytes(b'{"bos_token": ' + _deep(200_000) + b"}")
    with pytest.raises(ChatTemplateError, match="special_tokens_map.json.*deeper than"):
        ChatTemplate.from_dir(d)
