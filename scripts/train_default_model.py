#!/usr/bin/env python
"""Train nbengine's shipped default model: a small Llama causal LM.

The corpus is text every Python installation carries: the reference
documentation topics (``pydoc_data.topics.topics``) and the docstrings of the
standard library.  The tokenizer is a byte-level BPE trained on the same text
with the ``tokenizers`` library; ``<|endoftext|>`` is bos, eos and the document
separator.  The model is ``transformers``' ``LlamaForCausalLM``, so the output
directory is an ordinary Hugging Face model directory.

Usage::

    nice -n 10 python scripts/train_default_model.py --time-budget-min 45 \\
        --out /work/train_out/run1
    python scripts/train_default_model.py --install-from /work/train_out/run1

The number of optimizer steps is chosen from a short throughput measurement
and the time budget, revised as the shared machine speeds up or slows down, and
recorded in TRAINING.json; pass ``--replay-plan TRAINING.json`` (with the same seed)
to repeat a run exactly.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import pkgutil
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EOT = "<|endoftext|>"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_INSTALL_DIR = REPO_ROOT / "nbengine" / "default_model"
DOCS_PATH = REPO_ROOT / "docs" / "default-model.md"
SHIPPED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "TRAINING.json",
)
MAX_DIR_BYTES = 30 * 1024 * 1024
SAMPLE_PROMPTS = ("The for statement", "A list is", "The import system")

# Top-level stdlib modules that are not imported: GUI toolkits, modules that act
# on import (this, antigravity), test suites, installers, platform-only modules
# and the documentation topics (read separately).
SKIP_MODULES = frozenset(
    {
        "idlelib",
        "tkinter",
        "turtle",
        "turtledemo",
        "antigravity",
        "this",
        "test",
        "lib2to3",
        "ensurepip",
        "venv",
        "__main__",
        "__phello__",
        "pydoc_data",
        "distutils",
        "msilib",
        "winreg",
        "winsound",
        "msvcrt",
        "nt",
        "readline",
        "site",
        "sitecustomize",
        "usercustomize",
        "xxlimited",
        "xxsubtype",
        "xxlimited_35",
        "webbrowser",
        "_tkinter",
        "_msi",
        "_winapi",
        "_overlapped",
        "_scproxy",
    }
)

log = logging.getLogger("train_default_model")


# --------------------------------------------------------------------------- corpus


def _docs_of_module(mod: Any) -> list[str]:
    """Docstrings of a module and of the classes/functions (and methods) it defines."""
    docs: list[str] = []

    def add(obj: Any) -> None:
        try:
            doc = inspect.getdoc(obj)
        except Exception:
            return
        if isinstance(doc, str):
            docs.append(doc)

    add(mod)
    try:
        members = sorted(vars(mod).items())
    except Exception:
        return docs
    for name, obj in members:
        if name.startswith("_"):
            continue
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != mod.__name__:
            continue  # defined elsewhere; collected with its own module
        add(obj)
        if inspect.isclass(obj):
            for mname, mobj in sorted(vars(obj).items()):
                if mname.startswith("_") and mname != "__init__":
                    continue
                if isinstance(mobj, (staticmethod, classmethod)):
                    mobj = mobj.__func__
                if inspect.isroutine(mobj) or isinstance(mobj, property):
                    add(mobj)
    return docs


def _stdlib_module_names() -> list[str]:
    """Public stdlib modules and submodules, sorted, minus SKIP_MODULES."""
    names: set[str] = set()
    for top in sorted(sys.stdlib_module_names):
        # Private top-level modules (_pydecimal, _pyio, _collections_abc...) carry
        # real docstrings; test helpers do not.
        if top in SKIP_MODULES or top.startswith(("__", "_test", "_xx")):
            continue
        names.add(top)
        spec = None
        try:
            spec = importlib.util.find_spec(top)
        except Exception:
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        for info in pkgutil.walk_packages(
            list(spec.submodule_search_locations), prefix=top + ".", onerror=lambda _n: None
        ):
            parts = info.name.split(".")
            if any(p.startswith("_") or p in SKIP_MODULES or p in {"tests", "test"} for p in parts):
                continue
            names.add(info.name)
    return sorted(names)


def collect_corpus_in_this_process() -> list[str]:
    """Return the deduplicated documents, in a deterministic order.

    Imports stdlib modules, so it is meant to run in a throwaway subprocess
    (see :func:`collect_corpus`).
    """
    from pydoc_data.topics import topics

    docs: list[str] = [topics[k].strip() for k in sorted(topics)]
    walked = _stdlib_module_names()
    for name in walked:
        try:
            mod = importlib.import_module(name)
        except BaseException:
            continue
        docs.extend(_docs_of_module(mod))
    seen: set[str] = set()
    out: list[str] = []
    for d in docs:
        d = d.replace(EOT, "").strip()
        # Very short docstrings ("Return self+value.") carry little text.
        if len(d) < 40 or d in seen:
            continue
        seen.add(d)
        out.append(d)
    return out


def collect_corpus(cache: Path) -> list[str]:
    """Collect the corpus in a subprocess (import side effects stay there)."""
    if not cache.exists():
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        subprocess.run(
            [
                sys.executable,
                "-I",
                os.fspath(Path(__file__).resolve()),
                "--collect-corpus",
                os.fspath(tmp),
            ],
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=900,
            cwd=os.fspath(cache.parent),
        )
        tmp.replace(cache)
    return json.loads(cache.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------ tokenizer


def train_tokenizer(docs: list[str], vocab_size: int) -> Any:
    """Byte-level BPE; ``<|endoftext|>`` is id 0 and is prepended to every encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    eot_id = tok.token_to_id(EOT)
    assert eot_id == 0, eot_id
    # Every encoding starts with bos, as documents do in training.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot_id)]
    )
    return tok


# ---------------------------------------------------------------------------- model


@dataclass(slots=True)
class ModelShape:
    """Llama hyper-parameters of the default model."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    context: int


def build_model(shape: ModelShape, vocab_size: int, eot_id: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=shape.context,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=None,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def pack(token_docs: list[list[int]], eot_id: int, context: int) -> Any:
    """Concatenate ``<eot> doc <eot> doc ...`` and cut into rows of context+1 tokens."""
    import torch

    flat: list[int] = []
    for ids in token_docs:
        flat.append(eot_id)
        flat.extend(ids)
    n_rows = len(flat) // (context + 1)
    t = torch.tensor(flat[: n_rows * (context + 1)], dtype=torch.long)
    return t.view(n_rows, context + 1)


def evaluate(model: Any, rows: Any, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over all targets in ``rows``."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, rows.shape[0], batch_size):
            b = rows[i : i + batch_size]
            logits = model(input_ids=b[:, :-1]).logits.float()
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1), reduction="sum"
            )
            total += loss.item()
            count += b[:, 1:].numel()
    model.train()
    return total / count


def unigram_cross_entropy(train_rows: Any, val_rows: Any, vocab_size: int) -> float:
    """Validation cross-entropy (nats) of an add-one smoothed unigram model of the
    training tokens."""
    import torch

    counts = torch.bincount(train_rows.reshape(-1), minlength=vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    return float(-logp[val_rows[:, 1:].reshape(-1)].mean())


def lr_at(step: int, total: int, warmup: int, peak: float, floor_frac: float) -> float:
    """Linear warmup then cosine decay from ``peak`` to ``peak * floor_frac``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def greedy(model: Any, tok: Any, prompt: str, new_tokens: int, eot_id: int) -> str:
    import torch

    ids = tok.encode(prompt).ids
    model.eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eot_id,
            pad_token_id=eot_id,
        )
    model.train()
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


# ------------------------------------------------------------------------- training


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()

    docs = collect_corpus(
        Path(args.cache_dir) / f"corpus-py{sys.version_info.major}{sys.version_info.minor}.json"
    )
    order = list(range(len(docs)))
    random.Random(args.seed).shuffle(order)
    n_val = max(1, round(len(docs) * args.val_frac))
    val_docs = [docs[i] for i in order[:n_val]]
    train_docs = [docs[i] for i in order[n_val:]]
    log.info(
        "corpus: %d documents (%d train, %d val), %d characters",
        len(docs),
        len(train_docs),
        len(val_docs),
        sum(map(len, docs)),
    )

    tok = train_tokenizer(train_docs, args.vocab_size)
    vocab_size = tok.get_vocab_size()
    eot_id = tok.token_to_id(EOT)
    enc = lambda ds: [e.ids for e in tok.encode_batch(ds, add_special_tokens=False)]  # noqa: E731
    train_rows = pack(enc(train_docs), eot_id, args.context)
    val_rows = pack(enc(val_docs), eot_id, args.context)
    n_train_tokens = train_rows.numel()
    n_val_tokens = val_rows.numel()
    log.info(
        "tokenizer: vocab %d; train %d tokens (%d rows), val %d tokens (%d rows)",
        vocab_size,
        n_train_tokens,
        train_rows.shape[0],
        n_val_tokens,
        val_rows.shape[0],
    )

    shape = ModelShape(
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.context
    )
    model = build_model(shape, vocab_size, eot_id)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %s, %d parameters", asdict(shape), n_params)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(train_rows.shape[0], generator=gen)
    cursor = 0
    epoch = 0

    def next_batch() -> Any:
        nonlocal perm, cursor, epoch
        if cursor + args.batch_size > perm.numel():
            perm = torch.randperm(train_rows.shape[0], generator=gen)
            cursor = 0
            epoch += 1
        idx = perm[cursor : cursor + args.batch_size]
        cursor += args.batch_size
        return train_rows[idx]

    def step_fn(step: int, total: int) -> float:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, args.warmup, args.lr, 0.1)
        b = next_batch()
        loss = _lm_loss(model, b)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    setup_s = time.monotonic() - t_start
    budget_s = args.time_budget_min * 60.0
    # The learning-rate schedule is a cosine over `total` steps, and `total` is
    # a plan: a list of (from_step, total) entries.  With a time budget the plan
    # starts from the median step time of the warmup steps (whose learning rate
    # depends only on the step index) and is revised every `log_every` steps
    # from the recent step times, by at most 10% at a time, because the machine
    # is shared and its speed changes.  The plan is recorded in TRAINING.json;
    # `--replay-plan TRAINING.json` (or `--steps N`) repeats a run exactly.
    probe_steps = max(3, min(args.warmup, args.probe_steps))
    adaptive = args.steps is None and args.replay_plan is None
    tok_per_s = float("nan")
    if args.replay_plan is not None:
        plan = [
            (int(a), int(b))
            for a, b in json.loads(Path(args.replay_plan).read_text())["training"]["plan"]
        ]
        start_step = 0
    elif args.steps is not None:
        plan = [(0, args.steps)]
        start_step = 0
    else:
        times: list[float] = []
        for s in range(probe_steps):
            t0 = time.monotonic()
            step_fn(s, args.warmup + 1)  # warmup learning rates only depend on the step
            if s >= 2:  # the first steps pay one-time allocation costs
                times.append(time.monotonic() - t0)
            if (s + 1) % args.log_every == 0:
                log.info(
                    "probe step %d/%d, median %.2fs/step",
                    s + 1,
                    probe_steps,
                    sorted(times)[len(times) // 2],
                )
        per_step_s = sorted(times)[len(times) // 2]
        tok_per_s = args.batch_size * args.context / per_step_s
        remaining = budget_s - (time.monotonic() - t_start) - args.reserve_s
        plan = [(probe_steps, probe_steps + max(1, int(remaining * 0.95 / per_step_s)))]
        log.info(
            "probe: median %.2fs/step, %.0f tokens/s -> %d total steps",
            per_step_s,
            tok_per_s,
            plan[0][1],
        )
        start_step = probe_steps

    def total_at(step: int) -> int:
        # Steps before the first entry are probe steps: warmup, where the
        # learning rate does not depend on the total.
        return ([plan[0][1]] + [t for a, t in plan if a <= step])[-1]

    hard_stop = budget_s * 1.15
    history: list[dict[str, float]] = []
    recent: list[float] = []
    ema = None
    step = start_step
    stopped_early = False
    best: tuple[float, int, dict[str, Any]] = (float("inf"), -1, {})
    while step < total_at(step):
        total = total_at(step)
        t0 = time.monotonic()
        loss = step_fn(step, total)
        recent = (recent + [time.monotonic() - t0])[-args.replan_window :]
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        step += 1
        if step % args.log_every == 0 or step == total:
            el = time.monotonic() - t_start
            log.info(
                "step %d/%d loss %.4f (ema %.4f) lr %.2e epoch %d elapsed %.0fs",
                step,
                total,
                loss,
                ema,
                opt.param_groups[0]["lr"],
                epoch,
                el,
            )
            if adaptive and step < 0.9 * total:
                per = sum(recent) / len(recent)
                remaining = budget_s - el - args.reserve_s
                new = step + max(1, int(remaining * 0.95 / per))
                new = max(step + 1, min(max(new, int(total * 0.9)), int(total * 1.1)))
                if new != total:
                    plan.append((step, new))
                    log.info("re-plan at step %d: %.2fs/step -> %d total steps", step, per, new)
        if step % args.eval_every == 0 and step < total_at(step):
            vl = evaluate(model, val_rows, args.batch_size)
            history.append({"step": step, "val_loss": vl})
            log.info("eval step %d val_loss %.4f ppl %.2f", step, vl, math.exp(vl))
            if vl < best[0]:
                best = (vl, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
        if adaptive and time.monotonic() - t_start > hard_stop:
            log.warning(
                "hard stop at step %d (%.0fs > %.0fs)", step, time.monotonic() - t_start, hard_stop
            )
            stopped_early = True
            break
    total_steps = total_at(step)
    train_s = time.monotonic() - t_start
    val_loss = evaluate(model, val_rows, args.batch_size)
    history.append({"step": step, "val_loss": val_loss})
    kept_step = step
    if best[0] < val_loss:
        # The corpus is small and is seen for several epochs: if the model
        # started to overfit, ship the checkpoint with the best validation loss.
        log.info("restoring step %d (val %.4f < final %.4f)", best[1], best[0], val_loss)
        model.load_state_dict(best[2])
        val_loss, kept_step = best[0], best[1]
    uni = unigram_cross_entropy(train_rows, val_rows, vocab_size)
    log.info(
        "final val_loss %.4f ppl %.2f; unigram %.4f ppl %.2f",
        val_loss,
        math.exp(val_loss),
        uni,
        math.exp(uni),
    )

    # ---- write the HF directory
    dtype = torch.bfloat16 if args.save_dtype == "bfloat16" else torch.float32
    model.eval()
    model.to(dtype)
    model.generation_config.bos_token_id = eot_id
    model.generation_config.eos_token_id = eot_id
    model.generation_config.pad_token_id = eot_id
    model.save_pretrained(out, safe_serialization=True)
    _fix_config_json(out / "config.json", args.save_dtype)
    tok.save(os.fspath(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": EOT,
                "eos_token": EOT,
                "unk_token": EOT,
                "model_max_length": args.context,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
        + "\n"
    )
    # The model in the saved dtype, evaluated again: these are the shipped numbers.
    model.float()
    if dtype != torch.float32:
        val_loss_saved = evaluate(model.to(dtype).float(), val_rows, args.batch_size)
    else:
        val_loss_saved = val_loss
    samples = {p: greedy(model, tok, p, 30, eot_id) for p in SAMPLE_PROMPTS}
    for p, s in samples.items():
        log.info("greedy %r -> %r", p, s)
    report = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "corpus": {
            "sources": ["pydoc_data.topics.topics", "standard library docstrings (inspect.getdoc)"],
            "documents": len(docs),
            "train_documents": len(train_docs),
            "val_documents": len(val_docs),
            "characters": sum(map(len, docs)),
            "train_tokens": n_train_tokens,
            "val_tokens": n_val_tokens,
        },
        "tokenizer": {"type": "byte-level BPE", "vocab_size": vocab_size, "special_tokens": [EOT]},
        "model": {
            "architecture": "LlamaForCausalLM",
            **asdict(shape),
            "vocab_size": vocab_size,
            "tie_word_embeddings": True,
            "parameters": n_params,
            "saved_dtype": args.save_dtype,
        },
        "training": {
            "seed": args.seed,
            "steps": step,
            "planned_steps": total_steps,
            "plan": plan,
            "stopped_early": stopped_early,
            "kept_step": kept_step,
            "batch_size": args.batch_size,
            "tokens_seen": step * args.batch_size * args.context,
            "epochs": step * args.batch_size / train_rows.shape[0],
            "lr": args.lr,
            "warmup": args.warmup,
            "weight_decay": args.weight_decay,
            "threads": args.threads,
            "probe_tokens_per_s": tok_per_s,
            "time_budget_min": args.time_budget_min,
            "setup_s": round(setup_s, 1),
            "wall_s": round(train_s, 1),
        },
        "validation": {
            "loss": val_loss,
            "perplexity": math.exp(val_loss),
            "loss_saved_dtype": val_loss_saved,
            "perplexity_saved_dtype": math.exp(val_loss_saved),
            "unigram_loss": uni,
            "unigram_perplexity": math.exp(uni),
            "history": history,
        },
        "greedy_samples": samples,
    }
    (out / "TRAINING.json").write_text(json.dumps(report, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir() if f.name in SHIPPED_FILES)
    log.info("wrote %s (%.1f MB)", out, size / 1e6)
    if size > MAX_DIR_BYTES:
        log.error("directory is %.1f MB, over the 30 MB limit", size / 1e6)
    return report


def _lm_loss(model: Any, rows: Any) -> Any:
    import torch.nn.functional as F

    logits = model(input_ids=rows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), rows[:, 1:].reshape(-1))


def _fix_config_json(path: Path, dtype: str) -> None:
    """Record the saved dtype under both the old (torch_dtype) and new (dtype) keys."""
    cfg = json.loads(path.read_text())
    cfg["torch_dtype"] = dtype
    cfg["dtype"] = dtype
    cfg["architectures"] = ["LlamaForCausalLM"]
    # Loaders written against transformers 4.x read rope_theta at the top level.
    cfg["rope_theta"] = float(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# -------------------------------------------------------------------------- install


def install(src: Path, dest: Path = DEFAULT_INSTALL_DIR, docs: Path = DOCS_PATH) -> None:
    """Copy the shipped files into the package and refresh the figures in the docs."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in SHIPPED_FILES:
        shutil.copy2(src / name, dest / name)
    report = json.loads((src / "TRAINING.json").read_text())
    if docs.exists():
        text = _replace_block(docs.read_text(), "figures", figures_markdown(report))
        samples = "".join(
            f"`{p}` ->\n\n```text\n{s}\n```\n\n" for p, s in report["greedy_samples"].items()
        )
        docs.write_text(_replace_block(text, "samples", samples))


def _replace_block(text: str, name: str, body: str) -> str:
    """Replace what lies between ``<!-- name:start -->`` and ``<!-- name:end -->``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        return text
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return head + start + "\n" + body + end + tail


def figures_markdown(r: dict[str, Any]) -> str:
    c, m, t, v = r["corpus"], r["model"], r["training"], r["validation"]
    rows = [
        ("Corpus", f"{c['documents']:,} documents, {c['characters']:,} characters"),
        ("Tokens (train / val)", f"{c['train_tokens']:,} / {c['val_tokens']:,}"),
        ("Tokenizer", f"byte-level BPE, vocab {r['tokenizer']['vocab_size']:,}"),
        (
            "Model",
            f"Llama, {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
            f"{m['num_attention_heads']} heads ({m['num_key_value_heads']} KV), "
            f"MLP {m['intermediate_size']}, context {m['context']}",
        ),
        ("Parameters", f"{m['parameters']:,} (tied embeddings), stored as {m['saved_dtype']}"),
        (
            "Training",
            f"{t['steps']:,} steps x {t['batch_size']} x {m['context']} tokens = "
            f"{t['tokens_seen']:,} tokens ({t['epochs']:.2f} epochs), "
            f"{t['wall_s'] / 60:.1f} min on {t['threads']} CPU threads",
        ),
        (
            "Validation loss / perplexity",
            f"{v['loss_saved_dtype']:.3f} nats / {v['perplexity_saved_dtype']:.1f}",
        ),
        (
            "Unigram baseline loss / perplexity",
            f"{v['unigram_loss']:.3f} nats / {v['unigram_perplexity']:.1f}",
        ),
    ]
    lines = ["| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="/work/train_out/run")
    p.add_argument("--cache-dir", default="/work/train_out/cache")
    p.add_argument("--time-budget-min", type=float, default=45.0)
    p.add_argument(
        "--steps", type=int, default=None, help="fixed number of steps (skips the throughput probe)"
    )
    p.add_argument(
        "--replay-plan", metavar="TRAINING.json", help="repeat the step plan of an earlier run"
    )
    p.add_argument("--replan-window", type=int, default=60, help="steps averaged when re-planning")
    p.add_argument(
        "--probe-steps", type=int, default=100, help="timed warmup steps (at most --warmup)"
    )
    p.add_argument(
        "--reserve-s", type=float, default=120.0, help="seconds kept for evaluation and saving"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=6144)
    p.add_argument("--val-frac", type=float, default=0.02)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--save-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--collect-corpus", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument(
        "--install-from", metavar="DIR", help="copy a finished run into nbengine/default_model"
    )
    args = p.parse_args(argv)
    if args.heads % args.kv_heads or args.hidden % args.heads:
        p.error("--heads must divide --hidden and be a multiple of --kv-heads")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.collect_corpus:
        docs = collect_corpus_in_this_process()
        Path(args.collect_corpus).write_text(json.dumps(docs), encoding="utf-8")
        return
    if args.install_from:
        install(Path(args.install_from))
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(message)s",
        handlers=[
            logging.StreamHandler(),
            logging.FileHandler(Path(args.out) / "train.log", mode="w"),
        ],
    )
    train(args)


if __name__ == "__main__":
    main()
