"""What this machine can do, and the physical lower bound of a workload on it.

``measure_bandwidth`` copies a tensor far larger than the last-level cache (read +
write counted); ``measure_read_bandwidth`` only reads one (a sum), as a decode step
reads its weights; ``measure_matmul_flops`` times a square matmul in the bench dtype.
``ModelShape`` gives the bytes and FLOPs of one forward step of a Llama-family model,
and ``workload_bound`` sums, over the ideal schedule of a workload, per-step
``max(bytes moved / bandwidth, FLOPs / FLOP/s)``.

The ideal schedule: every request is admitted at once; all prompts are prefilled in
chunks of ``chunk_tokens`` (each chunk reads the weights once); then every decode step
runs all requests still generating as one batch, reading the weights once plus each
request's KV cache.
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass
from typing import Any

import torch


def process_memory() -> dict[str, int]:
    """This process's resident memory now and its peak so far (bytes: ``rss_bytes``,
    ``peak_rss_bytes``, from /proc/self/status' VmRSS and VmHWM); {} off Linux."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "VmRSS":
                    out["rss_bytes"] = int(rest.split()[0]) * 1024
                elif key == "VmHWM":
                    out["peak_rss_bytes"] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def process_start_time() -> float | None:
    """When this process started, in ``time.time()`` seconds (Linux /proc); None elsewhere."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of stat, starttime: clock ticks after boot
        with open("/proc/stat", encoding="ascii") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _times(fn: Any, reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones, sorted."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)


def _best_time(fn: Any, reps: int, warmup: int = 1) -> float:
    return _times(fn, reps, warmup)[0]


def _median_time(fn: Any, reps: int) -> float:
    return _times(fn, reps)[reps // 2]


def measure_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Bytes/s of a large tensor copy (bytes read + bytes written), best of ``reps``."""
    n = mib * (1 << 20)
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), reps)
    return 2 * n / t


def measure_read_bandwidth(mib: int = 512, reps: int = 5) -> float:
    """Bytes/s of summing a large float32 tensor (bytes read only), best of ``reps``.

    The bound stays the copy's (``measure_bandwidth``); this reading says how far a
    weight stream can go past it on this machine: a decode step only reads.
    """
    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    t = _best_time(lambda: x.sum(), reps)
    return x.numel() * 4 / t


def measure_matmul_flops(dtype: torch.dtype, n: int = 1536, reps: int = 5) -> float:
    """FLOP/s of an ``n x n @ n x n`` matmul in ``dtype``, best of ``reps``."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    t = _best_time(lambda: torch.mm(a, b), reps)
    return 2 * n**3 / t


def probe(dtype: torch.dtype) -> dict[str, float]:
    """A short reading of the machine's speed, taken by each bench worker just before and
    just after its measured run (well under a second).

    The median (not the best) of repeated small copies and matmuls, so a host that is
    slower for the whole reading shows as slower: when an engine's repeats disagree, the
    probes of the same processes say whether the machine moved too (docs/benchmarks.md).
    """
    n = 64 * (1 << 20)
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    a = torch.randn(768, 768).to(dtype)
    b = torch.randn(768, 768).to(dtype)

    return {
        "bandwidth_gb_s": 2 * n / _median_time(lambda: dst.copy_(src), 9) / 1e9,
        "matmul_gflop_s": 2 * 768**3 / _median_time(lambda: torch.mm(a, b), 41) / 1e9,
    }


def load_average() -> tuple[float, float, float] | None:
    """The 1/5/15-minute load averages (what ``uptime`` prints), None if unknown."""
    try:
        return os.getloadavg()
    except OSError:
        return None


def physical_cores() -> int:
    """Physical CPU cores (distinct core ids in /proc/cpuinfo), else ``os.cpu_count()``."""
    cores: set[tuple[str, str]] = set()
    phys = core = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("physical id"):
                    phys = line.split(":", 1)[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":", 1)[1].strip()
                    cores.add((phys, core))
    except OSError:
        pass
    return len(cores) or os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo), else the platform's machine type.

    Worth recording with every figure: a virtual machine of the same name may run on a
    different host CPU from one boot to the next (docs/benchmarks.md).
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def last_level_cache_mib(cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of CPU 0's largest data or unified cache in MiB (Linux sysfs), else None.

    Worth recording with every figure: weights that fit in it are read faster than the
    copy probe's bandwidth, so a model of that size can run above its bandwidth bound,
    and the same VM has come up on hosts with 300 and 480 MiB (docs/benchmarks.md).
    """
    sizes: list[int] = []
    try:
        entries = sorted(os.listdir(cache_dir))
    except OSError:
        return None
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(os.path.join(cache_dir, entry, "type"), encoding="utf-8") as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(cache_dir, entry, "size"), encoding="utf-8") as f:
                size = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        scale = units.get(size[-1:].upper(), 1)
        digits = size[:-1] if size[-1:].upper() in units else size
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) >> 20 if sizes else None


def cpu_flags() -> list[str]:
    """The matmul-relevant CPU flags of this machine (from /proc/cpuinfo)."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "fma")
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


@dataclass(slots=True)
class ModelShape:
    """Sizes of a Llama-family decoder, for counting bytes and FLOPs."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    elem_bytes: int
    # Bytes per matmul weight when they differ from elem_bytes (quantized weights).
    weight_elem_bytes: float | None = None

    @classmethod
    def from_config(cls, cfg: dict[str, Any], elem_bytes: int) -> ModelShape:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            hidden=hidden,
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)),
            elem_bytes=elem_bytes,
        )

    @property
    def layer_params(self) -> int:
        """Matmul parameters of the decoder layers (q, k, v, o, gate, up, down)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        per = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        return self.layers * per

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        """Bytes a step must read: layer matmuls + lm_head (the embedding rows are negligible)."""
        per = self.elem_bytes if self.weight_elem_bytes is None else self.weight_elem_bytes
        return int((self.layer_params + self.lm_head_params) * per)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.elem_bytes

    def token_flops(self, context: int, logits: bool) -> float:
        """FLOPs of one token at ``context`` positions: matmuls + attention (+ lm_head)."""
        attn = 4 * self.layers * self.heads * self.head_dim * context
        return 2 * self.layer_params + attn + (2 * self.lm_head_params if logits else 0)


@dataclass(slots=True)
class Bound:
    """The physical lower bound of a workload on this machine."""

    seconds: float
    prefill_seconds: float
    decode_seconds: float
    decode_step_seconds_first: float  # the first (largest-batch) decode step
    bytes_bound_steps: int  # decode steps where bandwidth, not FLOPs, is the limit
    decode_steps: int


def workload_bound(
    shape: ModelShape,
    prompt_lens: list[int],
    output_lens: list[int],
    bandwidth: float,
    flops: float,
    cached_prefix: list[int] | None = None,
    chunk_tokens: int = 512,
) -> Bound:
    """Lower bound (seconds) of prefilling every prompt and decoding every output.

    ``cached_prefix[i]`` tokens of prompt ``i`` need no compute (prefix-cache hits).
    The first output token comes from the prefill; outputs of length ``n`` need
    ``n - 1`` decode steps.
    """
    cached = cached_prefix or [0] * len(prompt_lens)
    pf_flops = 0.0
    pf_tokens = 0
    for p, c in zip(prompt_lens, cached):
        new = p - c
        pf_tokens += new
        # Average context of the new tokens ~ c + new / 2.
        pf_flops += new * shape.token_flops(c + new // 2, logits=False)
        pf_flops += 2 * shape.lm_head_params  # the one sampled row
    pf_chunks = max(1, math.ceil(pf_tokens / chunk_tokens))
    prefill = max(pf_chunks * shape.weight_bytes / bandwidth, pf_flops / flops)

    decode = 0.0
    first = 0.0
    bytes_bound = 0
    steps = max(output_lens) - 1 if output_lens else 0
    for i in range(1, steps + 1):
        active = [(p, o) for p, o in zip(prompt_lens, output_lens) if o > i]
        if not active:
            break
        ctx = [p + i for p, _ in active]
        nbytes = shape.weight_bytes + sum(c * shape.kv_bytes_per_token for c in ctx)
        nflops = sum(shape.token_flops(c, logits=True) for c in ctx)
        t_b, t_f = nbytes / bandwidth, nflops / flops
        if t_b >= t_f:
            bytes_bound += 1
        step = max(t_b, t_f)
        if i == 1:
            first = step
        decode += step
    return Bound(prefill + decode, prefill, decode, first, bytes_bound, steps)
