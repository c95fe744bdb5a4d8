"""The device an engine runs on: its memory, a one-line description, pinned host memory.

Every ``torch.cuda`` call of the engine outside ``config.resolve_device`` and the
loader's dtype choice lives here, each behind a check that the device is a CUDA one, so
a CPU engine never initialises CUDA (docs/architecture.md, "Devices").
"""

from __future__ import annotations

import os

import torch

__all__ = ["cuda_memory", "describe_device", "format_bytes", "is_cuda", "pinned_empty"]


def format_bytes(n: float) -> str:
    """``n`` bytes as a short human string (binary units: KiB, MiB, GiB, TiB)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def is_cuda(device: str | torch.device) -> bool:
    """True for a CUDA device ("cuda", "cuda:N")."""
    return torch.device(device).type == "cuda"


def cuda_memory(device: str, release_cache: bool = True) -> tuple[int, int]:
    """``(free, total)`` bytes of the CUDA device ``device`` (``torch.cuda.mem_get_info``).

    With ``release_cache``, memory this process's caching allocator holds but no tensor
    uses (an engine shut down earlier) is released first, so it counts as free.
    """
    assert is_cuda(device), "cuda_memory needs a CUDA device"
    if release_cache:
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)


def describe_device(device: str) -> str:
    """One line for the dashboard: the device, its name and its memory.

    CUDA: ``"cuda:0 · NVIDIA H200 · 20.1 GiB used of 139.8 GiB"`` (every process's use);
    CPU: ``"cpu · 2 cores · 15.6 GiB memory"``.
    """
    if not is_cuda(device):
        parts = ["cpu", f"{os.cpu_count() or 1} cores"]
        total = _host_memory()
        if total is not None:
            parts.append(f"{format_bytes(total)} memory")
        return " · ".join(parts)
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    free, total = cuda_memory(f"cuda:{index}", release_cache=False)
    return f"cuda:{index} · {name} · {format_bytes(total - free)} used of {format_bytes(total)}"


def _host_memory() -> int | None:
    """The machine's total memory (``MemTotal``), or None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def pinned_empty(nbytes: int, device: str) -> torch.Tensor:
    """A host byte buffer for copies to ``device``: page-locked for a CUDA device (so the
    copy can run asynchronously), ordinary memory for the CPU."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=is_cuda(device))
