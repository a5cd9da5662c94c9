"""The pre-norm transformer block, composed from its parts."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from .parallel import current_tp_group


class TransformerBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)); (B, T, dim) -> (B, T, dim), full on every tp rank.

    The parts are factories, built in this order (the order of the parameter draws):
    `norm(dim)` twice (`norm1`, `norm2`), `attn(dim, group=, init_std=, out_init_std=)`
    and `mlp(dim, group=, init_std=, out_init_std=)` (dense, or an MoE layer), each a
    module (B, T, dim) -> (B, T, dim). A family binds everything else (heads, widths,
    biases, eps, rotary): GPT-2's and Llama's parts are `pipekit.models.gpt2.gpt2_block_parts`
    and `pipekit.models.llama.llama_block_parts`. The block gives attention and the MLP
    its tp group and their init: std 0.02, and for the output projections (`attn.o`,
    `mlp.proj` / `mlp.down`) 0.02/sqrt(2*n_layers_for_init) with `n_layers_for_init`
    (GPT-2's scaled init), else 0.02.
    Communication: that of the parts; for the dense ones, two all-reduces forward
    (attn.o, the MLP's output layer) and the backward all-reduces of their inputs.
    """

    def __init__(self, dim: int, *, norm: Callable[[int], nn.Module], attn: Callable[..., nn.Module],
                 mlp: Callable[..., nn.Module], n_layers_for_init: int | None = None, group=None):
        super().__init__()
        group = current_tp_group() if group is None else group
        std = 0.02
        init = dict(group=group, init_std=std,
                    out_init_std=std / math.sqrt(2 * n_layers_for_init) if n_layers_for_init else std)
        self.norm1 = norm(dim)
        self.attn = attn(dim, **init)
        self.norm2 = norm(dim)
        self.mlp = mlp(dim, **init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))
