"""Normalisation layers; replicated on every tp rank (they see full activations, or with
sequence parallelism their rank's sequence slice: built then, their parameters are marked
`sequence_parallel`, so the optimizer sums their gradients over the current tp group).

Both take an optional `residual`: `norm(x, residual=r)` returns `(norm(x + r), x + r)`,
the add fused into the norm's pass over memory (`pipekit.kernels.norm`), which
`TransformerBlock` uses for its second residual add."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..kernels import layer_norm, rms_norm
from .parallel import current_tp_group, mark_sequence_parallel, sequence_parallel_active


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
        if sequence_parallel_active(current_tp_group()):
            mark_sequence_parallel(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """The norm of x; with `residual`, `(norm(x + residual), x + residual)` in one pass."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps, residual=residual)

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
        if sequence_parallel_active(current_tp_group()):
            mark_sequence_parallel(self.weight, self.bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """The norm of x; with `residual`, `(norm(x + residual), x + residual)` in one pass."""
        if residual is None:
            return layer_norm(x, self.weight, self.bias, self.eps)
        return layer_norm(x, self.weight, self.bias, self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"
