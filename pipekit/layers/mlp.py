"""Feed-forward blocks: a column-parallel layer in, a row-parallel layer out.

The hidden activation stays split over the tp group; communication is one
all-reduce forward (in the output layer) and one backward (on the input).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.glu import swiglu
from .linear import ColumnParallelLinear, RowParallelLinear, column_parallel_linears
from .parallel import current_tp_group


class GeluMLP(nn.Module):
    """GPT-2's MLP: proj(gelu_tanh(fc(x))), (B, T, dim) -> (B, T, dim).

    `fc` (dim -> hidden) is column-parallel, `proj` (hidden -> dim) row-parallel;
    `out_init_std` (default `init_std`) initialises `proj`.
    """

    def __init__(self, dim: int, hidden: int, bias: bool = True, group=None,
                 init_std: float = 0.02, out_init_std: float | None = None):
        super().__init__()
        group = current_tp_group() if group is None else group
        out_std = init_std if out_init_std is None else out_init_std
        self.fc = ColumnParallelLinear(dim, hidden, bias=bias, init_std=init_std, group=group)
        self.proj = RowParallelLinear(hidden, dim, bias=bias, init_std=out_std, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))  # hidden: (B, T, hidden/tp)


class SwiGLUMLP(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)), (B, T, dim) -> (B, T, dim).

    `gate` and `up` (dim -> hidden) are column-parallel, `down` (hidden -> dim)
    row-parallel; `out_init_std` (default `init_std`) initialises `down`.
    """

    def __init__(self, dim: int, hidden: int, bias: bool = False, group=None,
                 init_std: float = 0.02, out_init_std: float | None = None):
        super().__init__()
        group = current_tp_group() if group is None else group
        out_std = init_std if out_init_std is None else out_init_std
        self.gate = ColumnParallelLinear(dim, hidden, bias=bias, init_std=init_std, group=group)
        self.up = ColumnParallelLinear(dim, hidden, bias=bias, init_std=init_std, group=group)
        self.down = RowParallelLinear(hidden, dim, bias=bias, init_std=out_std, group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one backward all-reduce (sequence-parallel: one all-gather, the slice saved) for gate and up
        gate, up = column_parallel_linears(x, self.gate, self.up)
        return self.down(swiglu(gate, up))  # hidden: (B, T, hidden/tp)
