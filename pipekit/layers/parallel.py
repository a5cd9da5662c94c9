"""Tensor-parallel plumbing: the current tp group, conjugate collectives, sharded parameters.

This file is the one place where collectives meet model math. Every function
takes its process group as an argument; `None` (or a group of one rank) makes
each of them the identity, so the same layer code runs unsplit on one process.

The four collectives come in conjugate pairs (Megatron's "regions"):

    copy_to_tp      forward: identity             backward: all-reduce (sum)
    reduce_from_tp  forward: all-reduce (sum)     backward: identity
    gather_from_tp  forward: all-gather + cat     backward: keep own slice
    scatter_to_tp   forward: keep own slice       backward: all-gather + cat

Sequence parallelism (Megatron's, `with sequence_parallel(True): ...` at construction,
with a tp group of more than one rank): the activations outside the tp regions (norms,
residual adds) are split along the sequence (dim 1 of (B, T, D)) over the tp ranks, and
the region boundaries become

    gather_sequence          forward: all-gather along T    backward: reduce-scatter along T
    reduce_scatter_sequence  forward: reduce-scatter along T  backward: all-gather along T

(`enter_tp` / `leave_tp` pick the pair a layer uses). The column-parallel linears a
sequence-parallel tp region starts with do not use `gather_sequence`: `sequence_parallel_linears`
fuses the all-gather with the linears fed by it (q, k, v; gate and up) and saves for backward
only this rank's slice (B, T/tp, D) and the weights, not the gathered (B, T, D) input; backward
all-gathers the slice again for the weight gradients and reduce-scatters the summed input
gradient (Megatron's sequence-parallel linear). A parameter replicated over tp
that works on the split activations (a norm's weight, a row-parallel bias) then gets
only its rank's part of the gradient; such parameters carry `sequence_parallel = True`
and the optimizer sums their gradients over tp (`tp_partial`).

On `meta` tensors none of them communicates: they only produce the right
shape (the engine runs the model on meta to find activation shapes).

Parameters: a tp shard is a slice of the full tensor, which is always drawn
whole from the default generator (so tp=1 and tp=N start from the same model
and consume the same random stream). A sharded parameter carries the attribute
`tp_shard_dim`; a replicated one has none.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..comm import lane

_TP_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("pipekit_tp_group", default=None)


# ---- the current tp group ----------------------------------------------------
def _scoped(var: contextvars.ContextVar[Any], group) -> Iterator[Any]:
    """Set `var` to `group` for the block of the context manager that yields from this."""
    token = var.set(group)
    try:
        yield group
    finally:
        var.reset(token)


@contextlib.contextmanager
def tensor_parallel(group) -> Iterator[Any]:
    """Make `group` the current tp group for layers constructed inside the block."""
    yield from _scoped(_TP_GROUP, group)


def current_tp_group():
    """The group set by the innermost `tensor_parallel(...)`, or None outside any."""
    return _TP_GROUP.get()


_EP_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("pipekit_ep_group", default=None)


@contextlib.contextmanager
def expert_parallel(group) -> Iterator[Any]:
    """Make `group` the expert-parallel group for MoE layers constructed inside the block."""
    yield from _scoped(_EP_GROUP, group)


def current_ep_group():
    """The group set by the innermost `expert_parallel(...)`, or None (no expert parallelism)."""
    return _EP_GROUP.get()


_ETP_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("pipekit_etp_group", default=None)


@contextlib.contextmanager
def expert_tensor_parallel(group) -> Iterator[Any]:
    """Make `group` the group MoE layers constructed inside the block split each expert's
    hidden dimension over (expert tensor parallelism; None: experts whole on every tp rank)."""
    yield from _scoped(_ETP_GROUP, group)


_CP: contextvars.ContextVar[Any] = contextvars.ContextVar("pipekit_context_parallel", default=None)


@contextlib.contextmanager
def context_parallel(group, mode: str = "ring") -> Iterator[Any]:
    """Make attention layers constructed inside the block split each sequence over the cp group
    `group` (None or one rank: no context parallelism), crossing it by `mode` ("ring" or
    "ulysses"; `pipekit.layers.context`)."""
    yield from _scoped(_CP, (group, mode) if group is not None and group_size(group) > 1 else None)


def current_context_parallel() -> tuple[Any, str] | None:
    """(cp group, mode) set by the innermost `context_parallel(...)`, or None (no cp)."""
    return _CP.get()


_SP: contextvars.ContextVar[bool] = contextvars.ContextVar("pipekit_sequence_parallel", default=False)


@contextlib.contextmanager
def sequence_parallel(on: bool = True) -> Iterator[Any]:
    """Make layers constructed inside the block split the activations outside their tp regions
    along the sequence over the tp group (a no-op for a tp group of one rank)."""
    yield from _scoped(_SP, bool(on))


def current_sequence_parallel() -> bool:
    """Whether the innermost `sequence_parallel(...)` turned sequence parallelism on."""
    return _SP.get()


def sequence_parallel_active(group) -> bool:
    """Whether a layer built now on tp group `group` runs sequence-parallel: switched on and
    more than one tp rank."""
    return _SP.get() and group_size(group) > 1


def mark_sequence_parallel(*params: torch.Tensor | None) -> None:
    """Mark `params` (None skipped) as replicated over tp but fed by this rank's sequence
    slice only: the optimizer sums their gradients over the tp group."""
    for p in params:
        if p is None:
            continue
        p.sequence_parallel = True  # type: ignore[attr-defined]  # pipekit's own mark on a Parameter


def is_sequence_parallel(param: torch.Tensor) -> bool:
    """Whether `param` is fed by this rank's sequence slice only (`mark_sequence_parallel`)."""
    return bool(getattr(param, "sequence_parallel", False))


def mark_tp_partial(*params: torch.Tensor | None) -> None:
    """Mark `params` (None skipped) as whole on every tp rank while each rank's backward gives it
    only its own part of the gradient (a LoRA factor beside a split one): the optimizer sums
    their gradients over the tp group, with or without sequence parallelism."""
    for p in params:
        if p is not None:
            p.tp_partial = True  # type: ignore[attr-defined]  # pipekit's own mark on a Parameter


def tp_partial(param: torch.Tensor) -> bool:
    """Whether `param`'s gradient must be summed over the tp group: a sequence-parallel one
    (`mark_sequence_parallel`) or a partial one (`mark_tp_partial`)."""
    return is_sequence_parallel(param) or bool(getattr(param, "tp_partial", False))


def current_etp_group():
    """The group set by the innermost `expert_tensor_parallel(...)`, or None (experts not split)."""
    return _ETP_GROUP.get()


class FakeGroup:
    """A process group of `size` ranks seen from `rank`, with no way to communicate: enough to
    build tensor- or expert-parallel layers (construction never communicates) in one process,
    and to run them on the meta device (the collectives only shape their results there): the
    memory planner counts a tp rank's activations so, and tests build shards with it."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def group_size(group) -> int:
    """Number of ranks in `group`; 1 for None.

    Any object with `size()` and `rank()` methods works (a ProcessGroup, or a
    stand-in for building and meta-running layers without processes).
    """
    return 1 if group is None else group.size()


def group_rank(group) -> int:
    """This rank's index in `group`; 0 for None."""
    return 0 if group is None else group.rank()


# ---- communication helpers (no-ops on meta and on one rank) ------------------
def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce a copy of `x` (never the caller's tensor: it may be shared; on meta the copy
    alone, so that what the result shares storage with is as in a real run)."""
    if group_size(group) == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    if x.is_meta:
        return out
    dist.all_reduce(out, op=op, group=lane(group))
    return out


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    size = group_size(group)
    if size == 1:
        return x
    if x.is_meta:
        return torch.cat([x] * size, dim=dim)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=lane(group))
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum `x` over `group` and keep this rank's equal part along `dim` (on meta: the part's
    shape, no communication). On gloo an all-reduce and a slice (gloo's reduce-scatter is
    emulated and measured slower than its all-reduce); elsewhere `reduce_scatter_single`."""
    size = group_size(group)
    if size == 1:
        return x
    n = divide(x.shape[dim], size, f"size of dim {dim}")
    if x.is_meta:  # a tensor of its own, as the real collective's (not a view of x's storage)
        return x.narrow(dim, 0, n).clone(memory_format=torch.contiguous_format)
    g = lane(group)
    if dist.get_backend(g) == "gloo":
        return _own_slice(_all_reduce(x, group), group, dim)
    parts = x.movedim(dim, 0).contiguous()  # (size * n, ...): rank r's part is rows [r*n, (r+1)*n)
    out = torch.empty((n, *parts.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, parts, group=g)
    return out.movedim(0, dim).contiguous()


def _own_slice(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's equal part of `x` along `dim` (no communication)."""
    size = group_size(group)
    if size == 1:
        return x
    n = divide(x.shape[dim], size, f"size of dim {dim}")
    return x.narrow(dim, group_rank(group) * n, n).contiguous()


def divide(value: int, size: int, what: str) -> int:
    """`value // size`, or a ValueError naming both when `size` does not divide `value`."""
    if value % size:
        raise ValueError(
            f"{what}={value} is not divisible by the tensor-parallel size {size}; "
            f"choose a multiple of {size}"
        )
    return value // size


# ---- the conjugate autograd Functions -----------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.group, ctx.dim), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _own_slice(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


SEQUENCE_DIM = 1  # activations are (B, T, ...): sequence parallelism splits dim 1


class _SequenceParallelLinears(torch.autograd.Function):
    """y_i = linear(all_gather(x), w_i, b_i) for each (w_i, b_i), saving x (the slice), not the
    gathered input: backward all-gathers x again. `params` is w_0, b_0, w_1, b_1, ... (a b_i may
    be None)."""

    @staticmethod
    def forward(ctx, x, group, dim, *params):
        whole = _all_gather(x, group, dim)  # (B, T, D)
        weights, biases = params[0::2], params[1::2]
        ctx.group, ctx.dim = group, dim
        ctx.has_bias = tuple(b is not None for b in biases)
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(whole, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad  # x, group, dim, w_0, b_0, w_1, b_1, ...
        grad_x = None
        if need[0]:  # sum over the linears of dy_i W_i, (B, T, D), then this rank's slice of the sum over tp
            for g, w in zip(grads, weights):
                part = g.matmul(w)
                grad_x = part if grad_x is None else grad_x + part
            grad_x = _reduce_scatter(grad_x, ctx.group, ctx.dim)
        grad_params: list[torch.Tensor | None] = []
        whole = None
        if any(need[3::2]):  # the all-gather again, once for all the linears: (B*T, D)
            whole = _all_gather(x, ctx.group, ctx.dim)
            whole = whole.reshape(-1, whole.shape[-1])
        for i, g in enumerate(grads):
            g2 = g.reshape(-1, g.shape[-1])  # (B*T, out_i/tp)
            grad_params.append(g2.t().matmul(whole) if whole is not None and need[3 + 2 * i] else None)
            grad_params.append(g2.sum(0) if ctx.has_bias[i] and need[4 + 2 * i] else None)
        return (grad_x, None, None, *grad_params)


def sequence_parallel_linears(x: torch.Tensor, group, weights: tuple[torch.Tensor, ...],
                              biases: tuple[torch.Tensor | None, ...], dim: int = SEQUENCE_DIM
                              ) -> tuple[torch.Tensor, ...]:
    """The column-parallel linears fed by one sequence-split input, entering a tp region together:
    `x` (B, T/tp, D) is all-gathered along `dim` and each (weights[i], biases[i]) applied to it,
    giving (B, T, out_i/tp) each. Saved for backward: `x` (this rank's slice) and the weights;
    backward all-gathers `x` again (for the weight gradients) and reduce-scatters the sum of the
    linears' input gradients along `dim`. The same values as `gather_sequence` then `F.linear`
    each, which keeps the gathered (B, T, D) input alive until backward. One rank (or None): the
    linears on `x`. On meta: shapes only."""
    if len(weights) != len(biases) or not weights:
        raise ValueError(f"sequence_parallel_linears needs one bias (or None) per weight and at least one "
                         f"weight, got {len(weights)} weights and {len(biases)} biases")
    if group_size(group) == 1:
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
    params = [t for pair in zip(weights, biases) for t in pair]
    return _SequenceParallelLinears.apply(x, group, dim, *params)


def gather_sequence(x: torch.Tensor, group, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Enter a tp region from sequence-split activations: all-gather along the sequence
    forward; reduce-scatter of the gradient along it backward."""
    return x if group_size(group) == 1 else _GatherSequence.apply(x, group, dim)


def reduce_scatter_sequence(x: torch.Tensor, group, dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Leave a tp region into sequence-split activations by summing partial results:
    reduce-scatter along the sequence forward; all-gather of the gradient backward."""
    return x if group_size(group) == 1 else _ReduceScatterSequence.apply(x, group, dim)


def enter_tp(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The entry of a tp region: `gather_sequence` when sequence-parallel, else `copy_to_tp`."""
    return gather_sequence(x, group) if sequence_parallel else copy_to_tp(x, group)


def leave_tp(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The exit of a tp region: `reduce_scatter_sequence` when sequence-parallel, else `reduce_from_tp`."""
    return reduce_scatter_sequence(x, group) if sequence_parallel else reduce_from_tp(x, group)


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a tp region: identity forward; all-reduce (sum) of the gradient in backward."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Leave a tp region by summing partial results: all-reduce forward; identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """All-gather shards and concatenate along `dim` forward; backward keeps this rank's slice."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group, dim)


def scatter_to_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice along `dim` forward; backward all-gathers the gradient."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group, dim)


# ---- parameters --------------------------------------------------------------
def shard_dim(param: torch.Tensor) -> int | None:
    """The dim `param` is split along over the tp group, or None when replicated."""
    return getattr(param, "tp_shard_dim", None)


def _mark_tp_shard(param: torch.Tensor, dim: int) -> None:
    """Mark `param` as split along `dim` over the tp group (what `shard_dim` reads)."""
    param.tp_shard_dim = dim  # type: ignore[attr-defined]  # pipekit's own mark on a Parameter


def tp_slice(full: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's slice of the full tensor `full` along `dim` (a view; no communication)."""
    size = group_size(group)
    n = divide(full.shape[dim], size, f"size of dim {dim}")
    return full.narrow(dim, group_rank(group) * n, n)


def sharded_parameter(full: torch.Tensor, dim: int, group) -> nn.Parameter:
    """A parameter holding this rank's slice of `full` along `dim`, marked `tp_shard_dim`."""
    param = nn.Parameter(tp_slice(full, dim, group).clone(memory_format=torch.contiguous_format))
    _mark_tp_shard(param, dim)
    return param


_SKIP_INIT: contextvars.ContextVar[bool] = contextvars.ContextVar("pipekit_skip_init", default=False)


@contextlib.contextmanager
def skip_init() -> Iterator[Any]:
    """Build layers whose random weights are about to be overwritten (a run starting from
    pretrained weights): inside, `normal_full` and the experts' draws allocate without
    drawing, so no page of a whole tensor is written before this rank's shard is cut from
    it, and the memory the draws would have taken is never touched. Every weight built so
    must then be set (`pipekit.interchange.load_pretrained` checks it)."""
    yield from _scoped(_SKIP_INIT, True)


def skipping_init() -> bool:
    """Whether layers are being built inside `skip_init()`."""
    return _SKIP_INIT.get()


def normal_full(shape: tuple[int, ...], std: float) -> torch.Tensor:
    """The whole tensor drawn from N(0, std) with the default generator on the
    current default device (on meta: allocated nowhere, draws nothing; the
    in-place draw is skipped there because a meta `normal_` imports torch._dynamo,
    seconds of start-up per process; inside `skip_init()`: allocated, not drawn)."""
    full = torch.empty(shape)
    return full if full.is_meta or _SKIP_INIT.get() else full.normal_(0.0, std)


class _SharedRef:
    """Holds a process group so that `copy.deepcopy` of a layer shares the
    group (process groups cannot be copied) instead of failing on it."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __deepcopy__(self, memo):
        return self


class TensorParallelModule(nn.Module):
    """Base of the layers that hold a tp group.

    Captures `group` (None: the current tp group) at construction, and whether it runs
    sequence-parallel (`sequence_parallel`, see `sequence_parallel_active`). A deep copy
    shares the group and keeps each parameter's `tp_shard_dim` mark, which
    torch's own `Parameter.__deepcopy__` would drop.
    """

    def __init__(self, group=None):
        super().__init__()
        self._tp_group = _SharedRef(current_tp_group() if group is None else group)
        self.sequence_parallel = sequence_parallel_active(self.group)  # captured at construction

    @property
    def group(self):
        return self._tp_group.value

    @property
    def tp_size(self) -> int:
        return group_size(self.group)

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        for name, param in self._parameters.items():
            dim = None if param is None else shard_dim(param)
            copied = new._parameters[name]
            if dim is not None and copied is not None:
                _mark_tp_shard(copied, dim)
            if param is not None and copied is not None and is_sequence_parallel(param):
                copied.sequence_parallel = True  # kept like tp_shard_dim
            if param is not None and copied is not None and getattr(param, "tp_partial", False):
                copied.tp_partial = True
        return new
