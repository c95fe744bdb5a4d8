"""One host-to-device copy per step: the step's inputs packed into one host buffer.

The runner's device path (model/runner.py, docs/architecture.md "Devices") gathers
everything a step needs on the device (input ids, positions, the slot mapping, block
tables, sampled rows, sampling parameters, the host's random draws, structured-output
bitmasks) into a ``StepStager``: int64 and float64 segments from Python lists and raw
tensors of any dtype (their bytes). ``pack`` writes them into one byte buffer (page-locked
on a CUDA device, reused from step to step), which the runner copies to the device in one
``non_blocking`` copy; ``StagedInputs`` then hands out typed views of the device copy.

Reusing the host buffer is safe: before it is written again, ``to_device`` waits for
the previous copy out of it (a CUDA event recorded after that copy; it has almost always
finished, since a step that samples ends with a blocking copy of its results).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nbengine.model.device import is_cuda, pinned_empty

_ALIGN = 8  # every segment starts at a multiple of 8 bytes (int64 and float64 views)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class StagedInputs:
    """Typed views of the packed step inputs (on the device once copied)."""

    def __init__(
        self, buffer: torch.Tensor, layout: Sequence[tuple[int, int, torch.dtype, tuple[int, ...]]]
    ) -> None:
        self.buffer = buffer
        self._layout = layout

    def __getitem__(self, handle: int) -> torch.Tensor:
        """The segment ``handle`` (as returned by ``StepStager.ints`` and the others)."""
        start, nbytes, dtype, shape = self._layout[handle]
        return self.buffer[start : start + nbytes].view(dtype).view(shape)


class StepStager:
    """Collects one step's inputs on the host; see the module docstring."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._host: torch.Tensor | None = None  # reused across steps, grown as needed
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host (CUDA)
        self.reset()

    def reset(self) -> None:
        """Start a new step (the segments of the previous one are dropped)."""
        self._ints: list[int] = []
        self._floats: list[float] = []
        self._raw: list[torch.Tensor] = []
        # Per handle: ("i" | "f" | "r", index into its list or start, length).
        self._segments: list[tuple[str, int, int]] = []

    def ints(self, values: Sequence[int]) -> int:
        """Stage ``values`` as an int64 vector; returns its handle."""
        self._segments.append(("i", len(self._ints), len(values)))
        self._ints.extend(values)
        return len(self._segments) - 1

    def floats(self, values: Sequence[float]) -> int:
        """Stage ``values`` as a float64 vector; returns its handle."""
        self._segments.append(("f", len(self._floats), len(values)))
        self._floats.extend(values)
        return len(self._segments) - 1

    def tensor(self, value: torch.Tensor) -> int:
        """Stage a host tensor (any dtype and shape, copied by bytes); returns its handle."""
        assert value.device.type == "cpu", "stage host tensors only"
        self._segments.append(("r", len(self._raw), 0))
        self._raw.append(value.contiguous())
        return len(self._segments) - 1

    def pack(self) -> tuple[torch.Tensor, list[tuple[int, int, torch.dtype, tuple[int, ...]]]]:
        """The host byte buffer holding every segment, and each segment's layout
        ``(byte offset, bytes, dtype, shape)`` by handle."""
        n_int, n_float = len(self._ints), len(self._floats)
        float_at = 8 * n_int
        raw_at = float_at + 8 * n_float
        raw_offsets: list[int] = []
        end = raw_at
        for t in self._raw:
            raw_offsets.append(end)
            end = _aligned(end + t.numel() * t.element_size())
        total = max(end, _ALIGN)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the buffer
            self._copied = None
        if self._host is None or self._host.numel() < total:
            grown = 2 * self._host.numel() if self._host is not None else 0
            self._host = pinned_empty(max(total, grown), self.device)
        buf = self._host[:total]
        if n_int:
            buf[:float_at].view(torch.int64).copy_(torch.tensor(self._ints, dtype=torch.int64))
        if n_float:
            buf[float_at:raw_at].view(torch.float64).copy_(
                torch.tensor(self._floats, dtype=torch.float64)
            )
        for t, at in zip(self._raw, raw_offsets):
            nbytes = t.numel() * t.element_size()
            buf[at : at + nbytes].copy_(t.reshape(-1).view(torch.uint8))
        layout: list[tuple[int, int, torch.dtype, tuple[int, ...]]] = []
        for kind, index, length in self._segments:
            if kind == "i":
                layout.append((8 * index, 8 * length, torch.int64, (length,)))
            elif kind == "f":
                layout.append((float_at + 8 * index, 8 * length, torch.float64, (length,)))
            else:
                t = self._raw[index]
                nbytes = t.numel() * t.element_size()
                layout.append((raw_offsets[index], nbytes, t.dtype, tuple(t.shape)))
        return buf, layout

    def to_device(self) -> StagedInputs:
        """Pack the segments and copy them to the device in one ``non_blocking`` copy (on
        the CPU the views alias the host buffer: no copy)."""
        buf, layout = self.pack()
        staged = buf.to(self.device, non_blocking=True)
        if is_cuda(self.device):
            # On the stream the copy was queued on: the device's own (cuda:N from any thread).
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(staged.device))
        return StagedInputs(staged, layout)
