"""The llama.cpp peer of ``nbengine bench``: llama-cpp-python's low-level bindings.

Optional (``pip install -e '.[bench]'``, which compiles llama.cpp for this CPU; not a
default engine). The GGUF files it runs are converted and cached by bench/gguf.py;
this module holds the other two pieces:

- **The check**: before a precision is timed, a child process loads its GGUF under a
  given configuration and decodes the first ``CHECK_TOKENS`` greedy tokens of a few
  seeded prompts, compared with transformers in float32. A child, because a bad
  configuration can kill the process (llama.cpp's extra-buffer path did, with signal 11,
  at q8_0 on this machine): the driver then turns that path off and says so.
- ``LlamaCppDriver``: every workload through one loop in the style of llama-server's
  continuous batching: ``n_seq_max`` sequences in one context, each ``llama_decode`` call
  one token for every generating sequence plus prompt chunks, up to ``n_batch`` tokens;
  greedy (argmax of the logits), exact output counts (no end-of-sequence check).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nbengine.bench.engines import RunResult
from nbengine.bench.gguf import gguf_dir, gguf_file, gguf_type, installed_version
from nbengine.bench.workloads import Workload

__all__ = ["CHECK_TOKENS", "LlamaCppDriver", "check_gguf"]

logger = logging.getLogger(__name__)

CHECK_TOKENS = 8  # greedy tokens compared with transformers float32 per check prompt
CHECK_PROMPT_LENS = (8, 16, 32, 64)


# ----------------------------------------------------------------------------- the check


def check_prompts(vocab: int) -> list[list[int]]:
    """The seeded prompts of the agreement check (token ids in ``3..vocab-1``)."""
    rng = random.Random("llamacpp-check")
    return [[rng.randint(3, vocab - 1) for _ in range(n)] for n in CHECK_PROMPT_LENS]


def _reference(model_dir: Path, prompts: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """transformers float32: the greedy ``CHECK_TOKENS`` tokens of each prompt, and the
    logits of each prompt's first output position (``[len(prompts), vocab]``); cached."""
    path = gguf_dir(model_dir) / "reference-float32.pt"
    if path.is_file():
        data = torch.load(path, weights_only=True)
        if data.get("prompts") == prompts:
            return [list(t) for t in data["tokens"]], data["logits"]
    from nbengine.bench.engines import load_hf_model

    model = load_hf_model(model_dir, "float32")
    tokens: list[list[int]] = []
    first: list[torch.Tensor] = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(CHECK_TOKENS):
                logits = model(input_ids=ids).logits[0, -1]
                if ids.shape[1] == len(p):
                    first.append(logits.clone())
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
            tokens.append(ids[0, len(p) :].tolist())
    data = {"prompts": prompts, "tokens": tokens, "logits": torch.stack(first)}
    torch.save(data, path)
    return tokens, data["logits"]


# A wrong conversion (a transposed or misnamed tensor, a wrong rope) leaves llama.cpp's
# logits uncorrelated with the reference's (about 0); on the bench model (random weights)
# bf16 measured 0.9994-0.9998, q8_0 0.995-0.998 and q4_0 0.71-0.81 (4-bit rounding of
# random weights compounds over 30 layers). The check passes above this, per prompt.
MIN_LOGIT_CORRELATION = 0.5


def _agreement(
    got: list[list[int]], want: list[list[int]], got_logits: torch.Tensor, ref: torch.Tensor
) -> dict[str, Any]:
    leading = []
    for g, w in zip(got, want):
        n = 0
        while n < min(len(g), len(w)) and g[n] == w[n]:
            n += 1
        leading.append(n)
    corr = [float(torch.corrcoef(torch.stack([a, b]))[0, 1]) for a, b in zip(got_logits, ref)]
    # Where llama.cpp's first greedy token ranks in the reference's logits (0: the same).
    ranks = [int((b > b[a.argmax()]).sum()) for a, b in zip(got_logits, ref)]
    return {
        "reference": "transformers float32",
        "tokens_per_prompt": CHECK_TOKENS,
        "prompt_lens": list(CHECK_PROMPT_LENS),
        "leading_tokens_agreeing": leading,
        "first_logits_correlation": [round(c, 5) for c in corr],
        "first_token_rank_in_reference": ranks,
        "pass": all(c >= MIN_LOGIT_CORRELATION for c in corr),
    }


def check_gguf(
    model_dir: Path, gguf: Path, extra_bufts: bool, threads: int, out: Path
) -> dict[str, Any]:
    """In this process: load ``gguf`` with ``extra_bufts``, decode the check prompts greedily,
    compare with transformers float32 (``_agreement``: greedy tokens, and the correlation
    of the first output position's logits), and write the result as JSON to ``out``."""
    cfg = json.loads((model_dir / "config.json").read_text())
    prompts = check_prompts(int(cfg["vocab_size"]))
    want, ref = _reference(model_dir, prompts)
    runner = _LlamaModel(gguf, extra_bufts, threads)
    try:
        seqs, _steps = runner.generate(
            prompts, [CHECK_TOKENS] * len(prompts), 512, 64, True, keep_first_logits=True
        )
    finally:
        runner.close()
    got = [s.tokens for s in seqs]
    got_logits = torch.stack([torch.from_numpy(s.first_logits) for s in seqs])
    result = {"llamacpp_tokens": got, **_agreement(got, want, got_logits, ref.float())}
    out.write_text(json.dumps(result))
    return result


def _run_check(
    model_dir: Path, gguf: Path, extra_bufts: bool, threads: int
) -> tuple[dict[str, Any] | None, str | None]:
    """``check_gguf`` in a child process: (its result, None) or (None, why it failed)."""
    with tempfile.TemporaryDirectory(prefix="nbengine-llamacpp-") as tmp:
        out = Path(tmp) / "check.json"
        cmd = [sys.executable, "-m", "nbengine.bench.llamacpp", "check", str(model_dir)]
        cmd += [str(gguf), str(out), "--threads", str(threads)]
        cmd += ["--extra-bufts" if extra_bufts else "--no-extra-bufts"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        except subprocess.TimeoutExpired:
            return None, "the check took longer than 900 s"
        if out.is_file():
            return json.loads(out.read_text()), None
        how = (
            f"killed by signal {-done.returncode}"
            if done.returncode < 0
            else f"exit status {done.returncode}"
        )
        return None, f"{how}: {done.stderr.strip()[-800:]}"


def qualify(model_dir: Path, gtype: str, threads: int) -> dict[str, Any]:
    """The best working configuration of ``gtype`` here, checked, cached per GGUF file,
    llama-cpp-python version and CPU: llama.cpp's extra buffer types (weights repacked
    for the CPU's dot products, or AMX) if they run and pass the check, else without;
    what was turned off and why is recorded under ``turned_off``."""
    from nbengine.bench.machine import cpu_model

    gguf = gguf_file(model_dir, gtype)
    st = gguf.stat()
    key = {
        "check": "tokens+logits",  # what the check compares; older results are redone
        "gguf": gguf.name,
        "size": st.st_size,
        "mtime": st.st_mtime,
        "llama_cpp_python": installed_version(),
        "cpu": cpu_model(),
    }
    path = gguf.with_name(f"check-{gtype}.json")
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return dict(cached)
    turned_off: list[str] = []
    for extra in (True, False):
        result, failure = _run_check(model_dir, gguf, extra, threads)
        if result is None:
            what = "extra buffer types (use_extra_bufts: repacked weights, AMX)"
            turned_off.append(f"{what}: the check process failed: {failure}")
            if extra:
                continue
            raise RuntimeError(f"llama.cpp cannot run {gguf.name} here: {failure}")
        if not result["pass"] and extra:
            turned_off.append(
                "extra buffer types: logits disagreed with transformers "
                f"(correlation {result['first_logits_correlation']})"
            )
            continue
        entry = {"key": key, "use_extra_bufts": extra, "turned_off": turned_off, "check": result}
        path.write_text(json.dumps(entry, indent=2))
        return entry
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------ the loop


@dataclass(slots=True)
class _Seq:
    """One request in the batched loop."""

    index: int
    prompt: list[int]
    n_out: int
    seq_id: int = -1
    n_fed: int = 0  # prompt tokens decoded so far
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    first_logits: Any = None  # a copy of the first output position's logits, if kept


class _LlamaModel:
    """A loaded GGUF model and the batched greedy loop over it (``generate``)."""

    def __init__(self, gguf: Path, extra_bufts: bool, threads: int) -> None:
        import llama_cpp as L

        # llama-cpp-python prints llama.cpp's log unless its logger is above INFO.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        L.llama_backend_init()
        params = L.llama_model_default_params()
        params.use_extra_bufts = extra_bufts
        params.n_gpu_layers = 0
        model = L.llama_model_load_from_file(str(gguf).encode(), params)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.model = model
        self.vocab_size = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(model)))
        self.threads = threads
        self.extra_bufts = extra_bufts

    def close(self) -> None:
        """Free the model."""
        import llama_cpp as L

        if self.model:
            L.llama_model_free(self.model)
            self.model = None

    def generate(
        self,
        prompts: list[list[int]],
        output_lens: list[int],
        n_batch: int,
        n_seq_max: int,
        kv_unified: bool,
        t0: list[float] | None = None,
        keep_first_logits: bool = False,
    ) -> tuple[list[_Seq], int]:
        """Greedy decoding of every prompt to exactly its output length; the sequences (with
        their tokens and the ``perf_counter`` time each token was sampled) and the number of
        ``llama_decode`` calls. The context is created first, then ``t0[0]`` (if given) is
        set to the time the loop starts."""
        import llama_cpp as L
        import numpy as np

        n_seq = max(1, min(n_seq_max, len(prompts)))
        longest = max(len(p) + n for p, n in zip(prompts, output_lens))
        if kv_unified:  # one cell pool for all sequences: at most every request's tokens
            need = sum(len(p) + n for p, n in zip(prompts, output_lens))
            n_ctx = min(need, n_seq * longest)
        else:  # each sequence its own stream of n_ctx / n_seq cells
            n_ctx = n_seq * (-(-longest // 256) * 256)
        cp = L.llama_context_default_params()
        cp.n_ctx = -(-n_ctx // 256) * 256
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.kv_unified = kv_unified
        cp.no_perf = True
        ctx = L.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        batch = L.llama_batch_init(n_batch, 0, 1)
        try:
            token = np.ctypeslib.as_array(batch.token, shape=(n_batch,))
            pos = np.ctypeslib.as_array(batch.pos, shape=(n_batch,))
            n_seq_id = np.ctypeslib.as_array(batch.n_seq_id, shape=(n_batch,))
            want_logits = np.ctypeslib.as_array(batch.logits, shape=(n_batch,))
            n_seq_id[:] = 1
            seq_ids = [batch.seq_id[i] for i in range(n_batch)]
            mem = L.llama_get_memory(ctx)
            seqs = [_Seq(i, list(p), n) for i, (p, n) in enumerate(zip(prompts, output_lens))]
            pending = deque(s for s in seqs if s.n_out > 0)
            free = list(range(n_seq - 1, -1, -1))
            running: list[_Seq] = []
            steps = 0
            if t0 is not None:
                t0[0] = time.perf_counter()
            while pending or running:
                while pending and free:
                    s = pending.popleft()
                    s.seq_id = free.pop()
                    running.append(s)
                n = 0
                outs: list[_Seq] = []

                def add(tok: int, p: int, sid: int, logits: bool) -> None:
                    nonlocal n
                    token[n], pos[n], want_logits[n] = tok, p, logits
                    seq_ids[n][0] = sid
                    n += 1

                # As llama-server: one token for every generating sequence, then prompt
                # chunks in admission order while the batch has room.
                for s in running:
                    if s.n_fed == len(s.prompt):
                        add(s.tokens[-1], s.n_fed + len(s.tokens) - 1, s.seq_id, True)
                        outs.append(s)
                for s in running:
                    if s.n_fed < len(s.prompt) and n < n_batch:
                        take = min(n_batch - n, len(s.prompt) - s.n_fed)
                        for j in range(s.n_fed, s.n_fed + take):
                            add(s.prompt[j], j, s.seq_id, j == len(s.prompt) - 1)
                        s.n_fed += take
                        if s.n_fed == len(s.prompt):
                            outs.append(s)
                batch.n_tokens = n
                rc = L.llama_decode(ctx, batch)
                if rc != 0:
                    raise RuntimeError(f"llama_decode returned {rc} at step {steps}")
                now = time.perf_counter()
                steps += 1
                logits = np.ctypeslib.as_array(
                    L.llama_get_logits(ctx), shape=(len(outs), self.vocab_size)
                )
                for row, (s, t) in enumerate(zip(outs, logits.argmax(axis=1).tolist())):
                    if keep_first_logits and not s.tokens:
                        s.first_logits = logits[row].copy()
                    s.tokens.append(int(t))
                    s.times.append(now)
                    if len(s.tokens) == s.n_out:
                        L.llama_memory_seq_rm(mem, s.seq_id, -1, -1)
                        free.append(s.seq_id)
                        running.remove(s)
            return seqs, steps
        finally:
            L.llama_batch_free(batch)
            L.llama_free(ctx)


# ---------------------------------------------------------------------------- the driver


class LlamaCppDriver:
    """llama.cpp (llama-cpp-python's low-level bindings) on every workload, in batched
    greedy steps of up to ``n_batch`` tokens over up to ``n_seq_max`` sequences."""

    name = "llamacpp"

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        quantization: str | None = None,
        n_batch: int = 512,
        n_seq_max: int = 64,
        kv_unified: bool = True,
    ) -> None:
        import llama_cpp as L

        self.gtype = gguf_type(dtype, quantization)
        self.threads = torch.get_num_threads()
        self.qualified = qualify(Path(model_dir), self.gtype, self.threads)
        if not self.qualified["check"]["pass"]:
            raise RuntimeError(
                f"llama.cpp's {self.gtype} logits disagree with transformers float32: "
                f"{self.qualified['check']}"
            )
        self.gguf = gguf_file(Path(model_dir), self.gtype)
        self.model = _LlamaModel(self.gguf, self.qualified["use_extra_bufts"], self.threads)
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.kv_unified = kv_unified
        self.info = {
            "gguf_type": self.gtype,
            "gguf_bytes": self.gguf.stat().st_size,
            "llama_cpp_python": installed_version(),
            "n_threads": self.threads,
            "n_batch": n_batch,
            "n_seq_max": n_seq_max,
            "kv_unified": kv_unified,
            "use_extra_bufts": self.qualified["use_extra_bufts"],
            "turned_off": self.qualified["turned_off"],
            "check": {k: v for k, v in self.qualified["check"].items() if k != "llamacpp_tokens"},
            "system_info": L.llama_print_system_info().decode(errors="replace").strip(),
        }

    def run(self, wl: Workload) -> RunResult:
        """``wl`` greedy, every request from t0, exact output counts."""
        res = RunResult(self.name, wl.name)
        res.extra.update(self.info)
        t0 = [0.0]
        seqs, steps = self.model.generate(
            wl.prompts, wl.output_lens, self.n_batch, self.n_seq_max, self.kv_unified, t0
        )
        res.wall_s = time.perf_counter() - t0[0]
        res.extra["num_steps"] = steps
        for s in seqs:
            res.prompt_tokens += len(s.prompt)
            res.output_tokens += len(s.tokens)
            if len(s.tokens) != s.n_out:
                res.extra["length_mismatches"] = res.extra.get("length_mismatches", 0) + 1
            if s.times:
                res.ttft_s.append(s.times[0] - t0[0])
                res.itl_s.extend(b - a for a, b in zip(s.times, s.times[1:]))
        return res


def main(argv: list[str] | None = None) -> int:
    """``python -m nbengine.bench.llamacpp check MODEL_DIR GGUF OUT.json``: the check."""
    ap = argparse.ArgumentParser(description="llama.cpp's greedy tokens against transformers")
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check")
    c.add_argument("model_dir")
    c.add_argument("gguf")
    c.add_argument("out")
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--extra-bufts", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    check_gguf(
        Path(args.model_dir), Path(args.gguf), args.extra_bufts, args.threads, Path(args.out)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
