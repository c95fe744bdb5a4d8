"""RMSNorm, as Llama/Qwen/Mistral compute it (normalise in float32, scale in the input dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nbengine.ops import native


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference: ``weight * (x / sqrt(mean(x^2) + eps))``, normalised in float32."""
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def _native_for(x: torch.Tensor, weight: torch.Tensor) -> native.NativeKernels | None:
    if (
        x.dtype != torch.bfloat16
        or weight.dtype != torch.bfloat16
        or not x.is_contiguous()
        or x.device.type != "cpu"
    ):
        return None
    return native.kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fast path: the native kernel for bfloat16, else one fused ``F.rms_norm`` in float32."""
    k = _native_for(x, weight)
    if k is not None:
        return k.rms_norm(x.view(-1, x.shape[-1]), weight, eps)[0].view(x.shape)
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, eps).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (in the model's dtype), then ``(rms_norm(residual), residual)``.

    One pass in the native kernel; the torch path computes exactly the same two steps.
    """
    k = _native_for(x, weight)
    if k is not None and residual.is_contiguous() and residual.dtype == torch.bfloat16:
        if x.dim() == 2:  # the model's usual [tokens, hidden]: no views
            return k.rms_norm(x, weight, eps, add=residual)
        h = x.shape[-1]
        out, res = k.rms_norm(x.view(-1, h), weight, eps, add=residual.view(-1, h))
        return out.view(x.shape), res.view(x.shape)
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the residual add fused with the norm."""
        return add_rms_norm(x, residual, self.weight, self.eps)
