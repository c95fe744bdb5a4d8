"""Gated MLP activations for a fused ``gate_up`` projection: SwiGLU (``silu(gate) * up``)
and GeGLU (``gelu_tanh(gate) * up``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nbengine.ops import native


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Reference: split the last dimension in halves ``[gate | up]``, ``silu(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Fast path: one native pass for contiguous bfloat16 input, else the reference."""
    if gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous() and gate_up.is_cpu:
        k = native.kernels()
        if k is not None:
            two_i = gate_up.shape[-1]
            out = k.silu_mul(gate_up.view(-1, two_i))
            return out.view(*gate_up.shape[:-1], two_i // 2)
    return silu_and_mul_ref(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation (Gemma): ``gelu_tanh(gate) * up`` for ``[gate | up]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
