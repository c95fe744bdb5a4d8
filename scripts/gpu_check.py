"""The GPU check of issue 20: nbengine on a CUDA device, in one run, one JSON summary.

Usage::

    python scripts/gpu_check.py                      # on a machine with a GPU (< 8 min)
    python scripts/gpu_check.py --device cpu --quick # small, anywhere (tests run this)

Parts (each reported under its own key; ``"ok"`` is true only when all pass):

- ``parity``: greedy float32 tokens of every architecture's tiny model
  (``nbengine.testing.ARCHS``), nbengine on the device against transformers on the
  same device, three prompts of different lengths, in one batch;
- ``race``: the abort/reuse reproducer, ``rounds`` times on one engine: start
  "abort-a", wait for its first token, abort it, re-add "abort-a" with max_tokens=3;
  it must produce exactly 3 tokens and the aborted one must end with "abort";
- ``throughput``: a random model of SmolLM2-135M's shape in bfloat16 (float32 on the
  CPU), 256 seeded requests with prompts of 100-1024 and outputs of 100-1024 tokens,
  ``ignore_eos`` (nano-vllm's benchmark shape); output tokens/s of nbengine and of
  transformers' continuous batching on the same device (``nbengine bench``'s drivers).

``--quick`` shrinks every part (tiny models, a few rounds, 8 short requests) so that it
runs in seconds on a CPU. Figures belong in docs/benchmarks.md only when measured here
on a GPU, with the date and the GPU's name.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import nbengine as nb
from nbengine.bench.engines import HFContinuousDriver, NbengineDriver
from nbengine.bench.workloads import SMOLLM2_135M, Workload, bench_model_dir
from nbengine.testing import ARCHS, TINY_LLAMA, make_tiny_model

TEXTS = [
    "Once upon a time, in a small village at the edge of a great forest, there lived a girl",
    "The quick brown fox",
    "Hi",
]


def check_parity(device: str, root: Path, n_new: int) -> dict[str, Any]:
    """Greedy tokens of nbengine and transformers (float32) on ``device``, per architecture."""
    import transformers

    out: dict[str, Any] = {}
    for arch in ARCHS:
        path = make_tiny_model(root / f"parity-{arch}", arch=arch, seed=1)
        with nb.Engine(
            str(path), device=device, dtype="float32", num_kv_blocks=256, block_size=16, seed=0
        ) as engine:
            prompts = [engine.tokenizer.encode(t) for t in TEXTS]
            params = nb.SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
            handles = [engine.generate(p, params) for p in prompts]
            got = [list(h.result(timeout=300).outputs[0].token_ids) for h in handles]
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation="eager"
        )
        hf = hf.to(device).eval()
        hf.generation_config.eos_token_id = None
        refs = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p], device=device)
                gen = hf.generate(ids, max_new_tokens=n_new, do_sample=False, pad_token_id=0)
                refs.append(gen[0, len(p) :].tolist())
        same = [g == r for g, r in zip(got, refs)]
        out[arch] = {"ok": all(same), "prompts_matching": sum(same), "prompts": len(same)}
        if not all(same):
            i = same.index(False)
            out[arch]["first_mismatch"] = {"nbengine": got[i], "transformers": refs[i]}
        del hf
    return out


def check_race(device: str, model: Path, rounds: int) -> dict[str, Any]:
    """The abort/reuse reproducer ``rounds`` times (see the module docstring)."""
    failures: list[str] = []
    long = nb.SamplingParams(
        max_tokens=100_000, ignore_eos=True, output_kind=nb.RequestOutputKind.DELTA
    )
    short = nb.SamplingParams(max_tokens=3, ignore_eos=True, output_kind=nb.RequestOutputKind.DELTA)
    with nb.Engine(
        str(model), device=device, num_kv_blocks=256, block_size=16, max_num_seqs=8
    ) as engine:
        for i in range(rounds):
            h = engine.generate("Once upon a time", long, request_id="abort-a")
            stream = iter(h)  # kept: a dropped stream iterator cancels its request
            first = next(stream)
            final = engine.abort("abort-a")
            h2 = engine.generate("Once upon a time", short, request_id="abort-a")
            n = sum(len(o.outputs[0].token_ids) for o in h2)
            reason = final.outputs[0].finish_reason if final is not None else None
            if not first.outputs[0].token_ids or n != 3 or reason != "abort":
                failures.append(f"round {i}: {n} tokens after re-add, aborted one: {reason}")
    return {"ok": not failures, "rounds": rounds, "failures": failures}


def throughput_workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> Workload:
    """``n`` requests, prompt and output lengths uniform in ``[lo, hi]``, seeded ids."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outputs = [rng.randint(lo, hi) for _ in range(n)]
    return Workload("gpu-throughput", prompts, outputs)


def check_throughput(device: str, root: Path, quick: bool) -> dict[str, Any]:
    """Output tokens/s of nbengine and transformers' continuous batching (same workload)."""
    if quick:
        model = make_tiny_model(root / "tp", arch="llama", seed=0, **TINY_LLAMA)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        wl = throughput_workload(8, 8, 32, vocab)
    else:
        model = bench_model_dir(root / "bench")
        wl = throughput_workload(256, 100, 1024, SMOLLM2_135M["vocab_size"])
    dtype = "bfloat16" if device != "cpu" else "float32"
    max_seqs = len(wl.prompts)
    batch_tokens = 8192 if not quick else 256
    kw: dict[str, Any] = dict(
        device=device,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=batch_tokens,
        max_model_len=max(len(p) for p in wl.prompts) + max(wl.output_lens),
        seed=0,
    )
    if device == "cpu":
        kw["kv_cache_memory_gb"] = 0.25
    ours = NbengineDriver(model, dtype, kw).run(wl)
    hf = HFContinuousDriver(model, dtype, max_batch_tokens=batch_tokens, max_requests=max_seqs)
    hf.model.to(device)
    theirs = hf.run(wl)
    result: dict[str, Any] = {
        "model": "tiny llama" if quick else "SmolLM2-135M shape (random weights)",
        "dtype": dtype,
        "requests": len(wl.prompts),
        "prompt_tokens": wl.num_prompt_tokens,
        "expected_output_tokens": wl.num_output_tokens,
    }
    for name, r in (("nbengine", ours), ("hf_cb", theirs)):
        result[name] = {
            "output_tokens": r.output_tokens,
            "wall_s": round(r.wall_s, 3),
            "output_tok_s": round(r.output_tokens / r.wall_s, 1) if r.wall_s else None,
        }
    result["ok"] = ours.output_tokens == wl.num_output_tokens
    if ours.wall_s and theirs.wall_s and theirs.output_tokens:
        result["nbengine_over_hf_cb"] = round(
            (ours.output_tokens / ours.wall_s) / (theirs.output_tokens / theirs.wall_s), 3
        )
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the check; print one JSON object; exit status 0 when every part passed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds on a CPU)")
    ap.add_argument("--skip", action="append", default=[], choices=["parity", "race", "throughput"])
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    summary: dict[str, Any] = {
        "device": args.device,
        "quick": args.quick,
        "torch": torch.__version__,
    }
    if args.device != "cpu":
        summary["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    with tempfile.TemporaryDirectory(prefix="nbengine-gpu-check-") as tmp:
        root = Path(tmp)
        parts: dict[str, Any] = {}
        if "parity" not in args.skip:
            parts["parity"] = check_parity(args.device, root, n_new=8 if args.quick else 20)
        if "race" not in args.skip:
            model = make_tiny_model(root / "race", arch="llama", seed=0, **TINY_LLAMA)
            parts["race"] = check_race(args.device, model, rounds=3 if args.quick else 40)
        if "throughput" not in args.skip:
            parts["throughput"] = check_throughput(args.device, root, args.quick)
    summary.update(parts)
    parity_ok = all(v["ok"] for v in parts.get("parity", {}).values())
    summary["ok"] = parity_ok and all(parts[k]["ok"] for k in ("race", "throughput") if k in parts)
    summary["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
