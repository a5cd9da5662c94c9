"""Normalisation layers; replicated on every tp rank (they see full activations)."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import layer_norm, rms_norm


class RMSNorm(nn.Module):
    """Llama's RMSNorm: weight * (x / sqrt(mean(x^2) + eps)).

    As in Hugging Face's LlamaRMSNorm the normalisation runs in float32 and is
    cast back to the input dtype before the weight multiplies it; float64
    inputs stay in float64 (HF would compute them in float32). The math is
    `pipekit.kernels.rms_norm`: its Triton program on CUDA, its reference (this exact
    computation) elsewhere and in float64.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with an optional bias (GPT-2 has one, weight 1, bias 0).

    The math is `pipekit.kernels.layer_norm` (F.layer_norm off CUDA and in float64)."""

    bias: nn.Parameter | None

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.register_parameter("bias", nn.Parameter(torch.zeros(dim)) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"
