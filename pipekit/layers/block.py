"""The pre-norm transformer block, composed from its parts."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .norm import LayerNorm, RMSNorm
from .parallel import current_tp_group, mark_sequence_parallel, sequence_parallel_active


class TransformerBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)); (B, T, dim) -> (B, T, dim), full on every tp rank
    (sequence-parallel, built inside `sequence_parallel(True)`: (B, T/tp, dim), this rank's slice,
    which attention and the MLP gather at their entry and reduce-scatter at their exit).

    The parts are factories, built in this order (the order of the parameter draws):
    `norm(dim)` twice (`norm1`, `norm2`), `attn(dim, group=, init_std=, out_init_std=)`
    and `mlp(dim, group=, init_std=, out_init_std=)` (dense, or an MoE layer), each a
    module (B, T, dim) -> (B, T, dim). A family binds everything else (heads, widths,
    biases, eps, rotary): GPT-2's and Llama's parts are `pipekit.models.gpt2.gpt2_block_parts`
    and `pipekit.models.llama.llama_block_parts`. The block gives attention and the MLP
    its tp group and their init: std 0.02, and for the output projections (`attn.o`,
    `mlp.proj` / `mlp.down`) 0.02/sqrt(2*n_layers_for_init) with `n_layers_for_init`
    (GPT-2's scaled init), else 0.02.
    The second residual add is fused into `norm2` when it is pipekit's RMSNorm or
    LayerNorm (`norm2(a, residual=x)`: one pass over memory for the add and the norm on
    the Triton side; the same two operations, bitwise, on the reference side); any other
    norm module gets the plain add.
    Communication: that of the parts; for the dense ones, two all-reduces forward
    (attn.o, the MLP's output layer) and the backward all-reduces of their inputs.

    Packed documents: the input may be `(x, positions)`, each token's position in its
    document (B, T) int64; attention gets them (`attn(h, positions=positions)`) and the
    block gives `(out, positions)`, so they travel on to the next block (and across
    stage boundaries, forward only). A plain tensor in: a plain tensor out, as always.
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
        if sequence_parallel_active(group):  # any norm module sees this rank's sequence slice only
            mark_sequence_parallel(*self.norm1.parameters(), *self.norm2.parameters())
        self._fused_add = isinstance(self.norm2, (RMSNorm, LayerNorm))  # a norm that takes residual=

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> Any:
        if isinstance(x, tuple):  # packed documents: (hidden, positions)
            hidden, positions = x
            return self._forward(hidden, positions), positions
        return self._forward(x)

    def _forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        a = self.attn(self.norm1(x)) if positions is None else self.attn(self.norm1(x), positions=positions)
        if self._fused_add:  # x + a and its norm in one pass (bitwise the two steps on the reference side)
            h, x = self.norm2(a, residual=x)
        else:
            x = x + a
            h = self.norm2(x)
        return x + self.mlp(h)
