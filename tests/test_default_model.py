"""The shipped default model: loadable by transformers, small, and it writes English.

The checks here are what a user of the default model would notice: that the
directory is an ordinary Hugging Face model, that it stays within the size
budget of the package, that greedy text is made of real words rather than
byte soup, and that the training script still produces such a directory.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

import nbengine

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODEL_DIR = Path(nbengine.__file__).resolve().parent / "default_model"
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_default_model.py"
EOT = "<|endoftext|>"
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "TRAINING.json",
)


@pytest.fixture(scope="module")
def hf_model() -> object:
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def hf_tokenizer() -> object:
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def reference_words() -> set[str]:
    """Lower-case words of Python's reference documentation (part of the training corpus)."""
    from pydoc_data.topics import topics

    text = " ".join(topics.values())
    return {w.lower() for w in re.findall(r"[A-Za-z]+", text)}


def _greedy(model: object, tokenizer: object, prompt: str, new_tokens: int = 30) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_directory_has_the_hf_files_and_fits_the_size_budget() -> None:
    for name in REQUIRED_FILES:
        assert (MODEL_DIR / name).is_file(), name
    total = sum(f.stat().st_size for f in MODEL_DIR.iterdir() if f.is_file())
    assert total <= 30 * 1024 * 1024, f"default model directory is {total / 2**20:.1f} MiB"


def test_config_describes_a_llama_with_endoftext_as_bos_and_eos(hf_tokenizer: object) -> None:
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["torch_dtype"] in ("bfloat16", "float32")
    eot = hf_tokenizer.convert_tokens_to_ids(EOT)
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == eot
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert gen["bos_token_id"] == gen["eos_token_id"] == eot
    tcfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tcfg["bos_token"] == tcfg["eos_token"] == EOT
    assert tcfg["model_max_length"] == cfg["max_position_embeddings"]


def test_transformers_loads_model_and_tokenizer(hf_model: object, hf_tokenizer: object) -> None:
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    assert hf_model.config.vocab_size == len(hf_tokenizer)
    assert hf_tokenizer.bos_token == hf_tokenizer.eos_token == EOT
    ids = hf_tokenizer("The for statement").input_ids
    assert ids[0] == hf_tokenizer.bos_token_id  # every prompt starts like a training document
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), hf_model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_tokenizer_json_round_trips_any_text_with_the_tokenizers_library() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    text = "def f(x):\n    return x ** 2  # größer — 数据 🙂\t\r\n"
    enc = tok.encode(text)
    assert enc.ids[0] == tok.token_to_id(EOT)
    assert tok.decode(enc.ids, skip_special_tokens=True) == text
    assert 4096 <= tok.get_vocab_size() <= 8192


@pytest.mark.parametrize("prompt", ["The for statement", "A list is", "The import system"])
def test_greedy_continuation_is_mostly_english_words(
    hf_model: object, hf_tokenizer: object, reference_words: set[str], prompt: str
) -> None:
    text = _greedy(hf_model, hf_tokenizer, prompt)
    words = [w.strip(".,;:()[]{}'\"`*!?-") for w in text.split()]
    words = [w for w in words if w]
    assert len(words) >= 8, f"too few words in {text!r}"
    known = [w for w in words if w.isalpha() and w.lower() in reference_words]
    assert len(known) >= 0.6 * len(words), f"mostly non-words in {text!r}"
    # Not a degenerate loop of one word ("the the the ...").
    top_count = Counter(w.lower() for w in words).most_common(1)[0][1]
    assert top_count <= 0.5 * len(words), f"one word dominates {text!r}"


def test_training_report_beats_the_unigram_baseline() -> None:
    report = json.loads((MODEL_DIR / "TRAINING.json").read_text())
    val = report["validation"]
    # A model that only learned word frequencies would sit at the unigram loss.
    assert val["loss_saved_dtype"] < val["unigram_loss"] - 1.0
    assert report["model"]["parameters"] == sum(
        p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR).parameters()
    )


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_default_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_learning_rate_schedule_warms_up_then_decays_to_the_floor() -> None:
    script = _load_script()
    lrs = [script.lr_at(s, 100, 10, 1e-3, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4)
    assert lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert script.lr_at(100, 100, 10, 1e-3, 0.1) == pytest.approx(1e-4)


@pytest.mark.slow
def test_training_script_writes_a_loadable_model_directory(tmp_path: Path) -> None:
    script = _load_script()
    out = tmp_path / "run"
    args = script.parse_args(
        [
            "--out",
            str(out),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--steps",
            "4",
            "--warmup",
            "2",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--heads",
            "1",
            "--kv-heads",
            "1",
            "--intermediate",
            "64",
            "--batch-size",
            "2",
            "--context",
            "32",
            "--vocab-size",
            "4096",
            "--eval-every",
            "2",
            "--threads",
            "1",
        ]
    )
    threads = torch.get_num_threads()
    try:
        report = script.train(args)
    finally:
        torch.set_num_threads(threads)  # the script pins its own thread count
    for name in REQUIRED_FILES:
        assert (out / name).is_file(), name
    assert report["training"]["steps"] == 4
    assert report["corpus"]["documents"] > 1000
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tok) == report["tokenizer"]["vocab_size"]
