"""Auxiliary losses and per-step metrics of layers inside a pipeline (model-agnostic).

A layer's extra loss (an MoE block's load-balancing loss or router z-loss)
never travels between stages as a value. The layer returns
`attach(output, aux_loss)`: the identity on `output`, whose backward also
sends the gradient `backward_scale()` into `aux_loss`, so the aux term is
trained exactly as if it had been added to the microbatch's loss. The engine
sets that scale around each backward pass to the weight it gives the
microbatch's main loss (1/M, or the microbatch's share of valid tokens) times
the fp16 loss scale; outside an engine it is 1.0, as for a plain
`loss.backward()`.

Values go to `metrics`, a per-process tracker: `metrics.record(name, value)`
accumulates a detached tensor per name during forward passes (not during the
recomputation of activation checkpointing, which runs inside backward, nor
during a pre-pass), and `metrics.pop()` returns and clears the step's sums.

Under torch.compile a layer records through `record_metrics(key, values)` with a
`metric_key(names)` it made once: a custom op that the compiled graph calls each time it
runs, holding no name (the key is a tensor: an index into a table of names), so tracing
neither breaks at the recording's checks nor guards on a name (a recompile per layer);
the checks (in backward? in a pre-pass?) are made when it runs, as in eager.

Layers that need the step as a whole (`StepStatistic`): a loss built on a
statistic of the whole step's batch (the MoE global-batch balancing loss,
whose expert loads are summed over the step's microbatches and dp ranks
before any of the step's backward passes), or an update once per step (the
aux-free bias). The engine finds them in its module (`step_layers`); when one
`needs_prepass` it first runs the step's forward passes once more, without
autograd, inside `prepass(layers, dp_group)`, then the step itself, then
`end_step(layers, dp_group)` after the optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

_scale: float = 1.0


def backward_scale() -> float:
    """The factor the engine gives the current backward pass's loss (1.0 outside an engine)."""
    return _scale


@contextlib.contextmanager
def scaled_backward(scale: float):
    """Run a backward pass whose main loss was multiplied by `scale`."""
    global _scale
    old, _scale = _scale, float(scale)
    try:
        yield
    finally:
        _scale = old


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad, _scale_like(list(shape), dtype, device)


@torch.library.custom_op("pipekit::backward_scale_like", mutates_args=())
def _scale_like(shape: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`backward_scale()` as a tensor of `shape`, read when the op runs: a custom op, so a
    compiled backward calls it each time instead of keeping the value traced once (the scale of
    the step that compiled it)."""
    return torch.full(shape, backward_scale(), dtype=dtype, device=device)


@_scale_like.register_fake
def _(shape: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def attach(x: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """`x`, unchanged; backward through it also backpropagates `aux_loss` (a scalar) with
    gradient `backward_scale()`. Without grad (eval, no_grad) it is just `x`."""
    if not (torch.is_grad_enabled() and aux_loss.requires_grad):
        return x
    return _Attach.apply(x, aux_loss)


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass (e.g. a checkpointed recomputation)."""
    return torch._C._current_graph_task_id() != -1


# ---- layers that need the whole step --------------------------------------------------
class StepStatistic:
    """A mixin for a layer (an nn.Module) with work around a training step beyond its forward.

    `needs_prepass`: its forward needs a statistic of the whole step's batch, gathered by a
    pre-pass: `begin_prepass()` resets it, the layer gathers it in the forward passes run
    while `in_prepass()`, and `end_prepass(group)` completes it over `group`, the data-parallel
    group of the layer's stage (every rank of it calls this at the same point: it may
    communicate there). `end_step(group)` runs once after each optimizer step, likewise."""

    needs_prepass: bool = False

    def begin_prepass(self) -> None:
        """Reset what the pre-pass gathers."""

    def end_prepass(self, group) -> None:
        """Complete what the pre-pass gathered over `group` (None: one rank)."""

    def end_step(self, group) -> None:
        """After the optimizer step: anything done once per step, over `group`."""


_prepassing = False


def in_prepass() -> bool:
    """True during a pre-pass: forward passes that only gather the step's statistics."""
    return _prepassing


def step_layers(module: torch.nn.Module) -> list[StepStatistic]:
    """The `StepStatistic` layers of `module`, in module order (the order their collectives run in)."""
    return [m for m in module.modules() if isinstance(m, StepStatistic)]


@contextlib.contextmanager
def prepass(layers: list[StepStatistic], group):
    """Run the pre-pass's forwards inside: resets `layers` first, completes them over `group` after
    (not when the forwards raised). Metrics are not recorded meanwhile."""
    global _prepassing
    for layer in layers:
        layer.begin_prepass()
    _prepassing = True
    try:
        yield
    finally:
        _prepassing = False
    for layer in layers:
        layer.end_prepass(group)


def end_step(layers: list[StepStatistic], group) -> None:
    """`end_step(group)` on each of `layers`, in order: after the optimizer step."""
    for layer in layers:
        layer.end_step(group)


class MetricsTracker:
    """Sums of named, detached tensors over a step's forward passes."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}

    def record(self, name: str, value: torch.Tensor) -> None:
        if in_backward() or _prepassing:
            return  # a recomputed forward (already recorded), or a pre-pass (recorded by the step's own)
        value = value.detach().float()
        if name in self._sums and self._sums[name].shape != value.shape:
            # another model under the same layer name (the sums of one never popped, e.g. forward
            # passes outside an engine): its sums are not this one's to add to
            del self._sums[name], self._counts[name]
        if name in self._sums:
            self._sums[name] = self._sums[name] + value
            self._counts[name] += 1
        else:
            self._sums[name], self._counts[name] = value.clone(), 1

    def pop(self) -> dict[str, tuple[torch.Tensor, int]]:
        """{name: (sum, number of records)} since the last pop, and clear."""
        out = {k: (v, self._counts[k]) for k, v in self._sums.items()}
        self._sums.clear()
        self._counts.clear()
        return out


metrics = MetricsTracker()


_KEY_NAMES: list[tuple[str, ...]] = []  # metric_key(names) holds i: the names of key i


def metric_key(names: Sequence[str]) -> torch.Tensor:
    """The handle `record_metrics` takes for these metric names: a 0-d int64 CPU tensor holding
    their index in a per-process table, and the names as a Python attribute (a copy of the layer
    keeps both; `.to()` leaves a plain attribute where it is)."""
    _KEY_NAMES.append(tuple(names))
    key = torch.tensor(len(_KEY_NAMES) - 1)
    setattr(key, "metric_names", _KEY_NAMES[-1])  # noqa: B010 - a Python attribute of a tensor
    return key


def record_metrics(key: torch.Tensor, values: list[torch.Tensor]) -> None:
    """`metrics.record(name, value)` for each of the key's names (`metric_key`) and `values`, in
    order. A custom op: under torch.compile it is one opaque call in the graph, run each time the
    graph runs (no graph break), and no name is traced (each would be a guard: a recompile per
    layer). Declared to mutate `key` (it does not), so no compiler pass drops it as dead code."""
    _record_metrics(key, [v.detach() for v in values])


@torch.library.custom_op("pipekit::record_metrics", mutates_args=("key",))
def _record_metrics(key: torch.Tensor, values: list[torch.Tensor]) -> None:
    names = getattr(key, "metric_names", None)
    if names is None:  # a copy of the key, made by a compiled graph (inductor passes the key itself)
        names = _KEY_NAMES[int(key)]
    for name, value in zip(names, values, strict=True):
        metrics.record(name, value)


@_record_metrics.register_fake
def _(key: torch.Tensor, values: list[torch.Tensor]) -> None:
    return None
