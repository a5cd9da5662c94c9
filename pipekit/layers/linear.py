"""Column- and row-parallel linear layers (Megatron's pair).

A ColumnParallelLinear splits the output features over the tp ranks, a
RowParallelLinear the input features; placed back to back (attention's q/k/v
then o, an MLP's fc then proj) they need one all-reduce forward (in the row
layer) and one backward (in the column layer), and the activation between
them stays split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .lora import LoRA
from .parallel import (
    TensorParallelModule,
    divide,
    enter_tp,
    gather_from_tp,
    leave_tp,
    mark_sequence_parallel,
    normal_full,
    scatter_to_tp,
    sequence_parallel_linears,
    sharded_parameter,
)


class ColumnParallelLinear(TensorParallelModule):
    """y = x W^T + b with W's rows (output features) split over the tp group.

    weight: (out_features/tp, in_features), bias: (out_features/tp,), both
    sharded along dim 0. Input: (..., in_features), full on every rank.
    Output: (..., out_features/tp), or (..., out_features) with `gather_output`.

    Communication: forward none, or an all-gather of the output with
    `gather_output`; backward an all-reduce of the input gradient (`copy_to_tp`),
    preceded by the slicing of the output gradient when gathered. Sequence-parallel
    (`sequence_parallel`, set at construction): the input is (B, T/tp, in) and is
    all-gathered along T first, its gradient reduce-scattered; the layer saves for
    backward only that (B, T/tp, in) slice, not the gathered input, and all-gathers it
    again in backward for the weight gradient (`sequence_parallel_linears`).
    Several layers fed by one input share these collectives: `column_parallel_linears`.
    """

    bias: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, init_std: float = 0.02, group=None):
        super().__init__(group)
        divide(out_features, self.tp_size, "out_features")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.weight = sharded_parameter(normal_full((out_features, in_features), init_std), 0, self.group)
        bias_param = sharded_parameter(torch.zeros(out_features), 0, self.group) if bias else None
        self.register_parameter("bias", bias_param)
        self.lora: LoRA | None = None  # a `pipekit.layers.lora.LoRA` once `add_adapters` gives it one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linears(x, self)[0]

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input made ready for `forward_copied`: `copy_to_tp`, or when sequence-parallel
        the all-gather along the sequence (`enter_tp`; the gathered input is then what the
        linear saves for backward: `column_parallel_linears` saves only the slice)."""
        return enter_tp(x, self.group, self.sequence_parallel)

    def forward_copied(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on an input the caller already passed through `enter`: several
        projections of one input (q, k, v; gate, up) then share one backward all-reduce
        (one all-gather forward and one reduce-scatter backward when sequence-parallel)."""
        if self.lora is None:
            return self._output(F.linear(x, self.weight, self.bias))  # (..., out/tp)
        y = F.linear(x, self.weight)
        y = y + self.lora.delta(x, y, self.weight)  # inside the region: its input gradient is summed as W's
        return self._output(y if self.bias is None else y + self.bias)

    def _output(self, y: torch.Tensor) -> torch.Tensor:
        return gather_from_tp(y, self.group, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))


def column_parallel_linears(x: torch.Tensor, *layers: ColumnParallelLinear) -> tuple[torch.Tensor, ...]:
    """Each of `layers` (built on one tp group, all sequence-parallel or none) on the one input
    `x`, their outputs in order, sharing the entry collectives: without sequence parallelism one
    `copy_to_tp` (one backward all-reduce of the summed input gradient); with it one forward
    all-gather along T and, in backward, one all-gather of the saved (B, T/tp, in) slice and one
    reduce-scatter of the summed input gradient (`sequence_parallel_linears`: the gathered
    (B, T, in) input is not kept for backward)."""
    if not layers:
        raise ValueError("column_parallel_linears needs at least one ColumnParallelLinear")
    first = layers[0]
    for layer in layers[1:]:
        if layer.group is not first.group or layer.sequence_parallel != first.sequence_parallel:
            raise ValueError(
                f"column_parallel_linears shares one entry among its layers, so they need one tp group and one "
                f"sequence_parallel setting; got {layer!r} after {first!r}"
            )
    if not first.sequence_parallel or any(layer.lora is not None for layer in layers):
        x = first.enter(x)  # with adapters, sequence-parallel: the plain all-gather (the whole input saved)
        return tuple(layer.forward_copied(x) for layer in layers)
    ys = sequence_parallel_linears(x, first.group, tuple(layer.weight for layer in layers),
                                   tuple(layer.bias for layer in layers))
    return tuple(layer._output(y) for layer, y in zip(layers, ys))


class RowParallelLinear(TensorParallelModule):
    """y = x W^T + b with W's columns (input features) split over the tp group.

    weight: (out_features, in_features/tp), sharded along dim 1; bias:
    (out_features,), replicated and added once, after the reduction.
    Input: (..., in_features/tp) when `input_is_parallel`, else (..., in_features)
    full on every rank and sliced here. Output: (..., out_features), full.

    Communication: forward an all-reduce of the partial products
    (`reduce_from_tp`); backward none, or an all-gather of the input gradient
    when the input was not already parallel (`scatter_to_tp`). Sequence-parallel: the
    partial products are reduce-scattered along the sequence instead (`leave_tp`), the
    output is (B, T/tp, out), and the bias, fed by this rank's slice only, is marked
    `sequence_parallel` (its gradient is summed over tp by the optimizer).
    """

    bias: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 input_is_parallel: bool = True, init_std: float = 0.02, group=None):
        super().__init__(group)
        divide(in_features, self.tp_size, "in_features")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.weight = sharded_parameter(normal_full((out_features, in_features), init_std), 1, self.group)
        self.register_parameter("bias", nn.Parameter(torch.zeros(out_features)) if bias else None)
        if self.sequence_parallel:
            mark_sequence_parallel(self.bias)  # added after the reduce-scatter, to this rank's slice
        self.lora: LoRA | None = None  # a `pipekit.layers.lora.LoRA` once `add_adapters` gives it one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group, dim=-1)  # (..., in/tp)
        y = F.linear(x, self.weight)  # this rank's partial products
        if self.lora is not None:
            y = y + self.lora.delta(x, y, self.weight)  # partial too: summed with them
        y = leave_tp(y, self.group, self.sequence_parallel)  # (..., out)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp={self.tp_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}"
                + (", sequence_parallel=True" if self.sequence_parallel else ""))
