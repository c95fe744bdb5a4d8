"""RMSNorm, as Llama/Qwen/Mistral compute it (normalise in float32, scale in the input dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference: ``weight * (x / sqrt(mean(x^2) + eps))``, normalised in float32."""
    xf = x.to(torch.float32)
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fast path: one fused ``F.rms_norm`` call in float32 (a no-op cast for float32 models)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, eps).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
