"""PipelineModule: the layers of this rank's pipeline stage(s), and nothing else.

The schedule is declared once, here: `PipelineModule(specs, schedule="zbv",
microbatches=4)` (a registered name, built for the topology's pp with
`microbatches` and `chunks_per_rank`, default the schedule's own) or
`schedule=<a pipekit.schedules.Schedule>` (it carries its chunks, placement and
microbatches). `module.schedule` is always the built Schedule; its placement
says which pipeline rank hosts each of the `pp * chunks_per_rank` virtual
stages, and `PipelineEngine(module)` runs it. Each rank builds only
the layers of its own stages, each seeded by its global index, and names them
by that index (`layers.7.weight`), so a parameter has the same name in every
layout. Tied layers live under `tied.<key>` on every rank that uses them.

Precision: `precision="bf16"` (or "fp16") builds every layer as in fp32, from
the same seeded draws, then casts its floating-point parameters and buffers,
so the layers' weights, activations and p2p messages are half precision; the
fp32 master weights live in the optimizer (`pipekit.optim.ZeroOptimizer`).
`compile=True` applies `torch.compile` to each layer module in place
(`nn.Module.compile`, which keeps parameter names), one graph per transformer
block as torchtitan does; the pipeline, its meta-device shape run and the
stable names are untouched.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from .layers.parallel import (
    context_parallel,
    expert_parallel,
    expert_tensor_parallel,
    sequence_parallel,
    tensor_parallel,
)
from .partition import partition as partition_specs
from .precision import Precision, precision_policy
from .schedules import SCHEDULES, Schedule, build_schedule
from .schedules.generators import get_generator
from .schedules.placement import check_positive
from .spec import LayerSpec, TiedLayerSpec, build_layer, spec_name
from .topology import Topology


def check_activation(value: Any, where: str) -> None:
    """Raise unless `value` is a tensor or a non-empty tuple of tensors."""
    ok = isinstance(value, torch.Tensor) or (
        isinstance(value, tuple) and len(value) > 0 and all(isinstance(v, torch.Tensor) for v in value)
    )
    if not ok:
        got = type(value).__name__
        if isinstance(value, (tuple, list)):
            got += "(" + ", ".join(type(v).__name__ for v in value) + ")"
        raise TypeError(f"{where} returned {got}; every layer must return a Tensor or a tuple of Tensors")


def _float_entries(value) -> list[torch.Tensor]:
    return [v for v in (value if isinstance(value, tuple) else (value,)) if v.is_floating_point()]


def cuts_gradient(x, out) -> bool:
    """Whether a layer cut the gradient: a float tensor of its input `x` needs a grad, and its
    output `out` has float tensors, none of which has one."""
    if isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor):  # the common case, without lists
        return x.requires_grad and x.is_floating_point() and out.is_floating_point() and not out.requires_grad
    outs = _float_entries(out)
    return bool(outs) and any(t.requires_grad for t in _float_entries(x)) and not any(t.requires_grad for t in outs)


def check_gradient_flows(x, out, where: str, layer: Any) -> None:
    """Raise when a layer cuts the gradient (`cuts_gradient`: a `.detach()`, `.data`,
    `torch.no_grad()` or a new tensor inside), so the layers before it would never train,
    in any layout. A layer that stops the gradient on purpose says so with the attribute
    `stops_gradient = True`."""
    if not cuts_gradient(x, out) or getattr(layer, "stops_gradient", False):
        return
    raise RuntimeError(f"{where} returned a tensor that does not require grad though its input does (a "
                       f".detach(), .data, torch.no_grad() or a new tensor inside it): the layers before it "
                       f"would never train; keep the output attached, or set stops_gradient = True on the "
                       f"layer if cutting the gradient there is intended")


def check_interleaving(name: str, chunks_per_rank: int | None) -> None:
    """Raise unless a registered schedule runs `chunks_per_rank` chunks (None: its own);
    interleaved_1f1b needs at least 2 (with one it is plain 1F1B, which would be a silent
    change of schedule). The rule lives in the registry (`Generator.chunks`)."""
    if name in SCHEDULES:
        get_generator(name).chunks(chunks_per_rank)


def declare_schedule(schedule, pp: int, microbatches: int | None, chunks_per_rank: int | None) -> Schedule:
    """The built Schedule a module runs: a registered name built for `pp` with
    `microbatches` (default 1) and `chunks_per_rank` (default: the schedule's own), or a
    Schedule, which must be for `pp` and agree with the counts given beside it."""
    for what, value in (("microbatches", microbatches), ("chunks_per_rank", chunks_per_rank)):
        if value is not None:
            check_positive(what, value)
    if isinstance(schedule, str):
        return build_schedule(schedule, pp, 1 if microbatches is None else microbatches, chunks_per_rank)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a registered name ({', '.join(SCHEDULES)}) or a "
                        f"pipekit.schedules.Schedule, got {type(schedule).__name__}")
    if schedule.pp != pp:
        raise ValueError(f"schedule {schedule.name!r} is for pp={schedule.pp}, but the topology has pp={pp}")
    for what, value, own in (("microbatches", microbatches, schedule.microbatches),
                             ("chunks_per_rank", chunks_per_rank, schedule.chunks_per_rank)):
        if value is not None and value != own:
            raise ValueError(f"{what}={value}, but schedule {schedule.name!r} runs {own}; leave {what} out "
                             "to take the schedule's")
    check_interleaving(schedule.name, schedule.chunks_per_rank)
    return schedule


def _check_same_seed(seed: int, topology: Topology) -> None:
    """ValueError on every rank when the ranks of a group were given different seeds (a
    per-rank seed gives dp replicas that differ and stages that are not one model's).
    Collective over the world: one all-reduce of two ints at construction."""
    if topology.world_size == 1 or not dist.is_initialized():
        return
    seen = torch.tensor([seed, -seed], dtype=torch.int64, device=topology.device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    high, low = seen[0].item(), -seen[1].item()
    if high != low:
        raise ValueError(f"PipelineModule(seed=...) differs across ranks (from {low} to {high}; this rank: {seed}): "
                         "every rank must pass the same seed, since layers are seeded by their global index")


class PipelineModule(nn.Module):
    """This rank's share of a model given as a list of specs.

    Args:
        specs: LayerSpec / TiedLayerSpec / plain callables, in order.
        topology: the process grid; None means one process (pp=1, dp=1).
        loss_fn: `loss_fn(outputs, labels) -> scalar`, applied after the last
            stage; a LayerSpec is built here, only on the rank holding the
            last stage (inside the tp context, so a vocab-parallel loss gets
            its group), so a loss with parameters is trained and saved once.
            A loss with a `bind_head(layer)` method is given that rank's copy of
            the last layer (a fused linear cross-entropy reads the head's weight).
        partition: "parameters", "uniform", "type:REGEX", or explicit boundaries.
        seed: base seed; layer i is initialised from (seed, i).
        schedule: the pipeline schedule this module is built for, declared once: a
            registered name ("1f1b", the default, "gpipe", "interleaved_1f1b", "zbv", ...;
            see `pipekit.schedules.SCHEDULES`) or a `pipekit.schedules.Schedule`. It fixes
            the placement of the virtual stages, the chunks and the microbatches;
            `PipelineEngine(module)` then runs it. "interleaved_1f1b" needs
            chunks_per_rank >= 2 (its default; with one chunk it would be plain 1F1B, so
            that is an error, not a fallback).
        microbatches: M, microbatches per optimizer step: built into a named schedule
            (None: 1); a Schedule's own must agree (None: take it).
        chunks_per_rank: virtual stages per rank for a named schedule (None: its own,
            2 for interleaved_1f1b, zbv and dualpipe_v, else 1); a Schedule's own must
            agree (None: take it).
        activation_checkpoint_interval: recompute every run of this many layers
            in backward instead of keeping their activations (0: off).
        checkpoint_layers: regex on layer class names; matching layers are
            recomputed in backward one by one.
        precision: a `pipekit.precision.Precision` (a resolved run's policy) or its
            name: "fp32" (the layers' dtype as built), "bf16" or "fp16".
        compile: torch.compile every layer module (in place; names unchanged).
    """

    _meta_cache: dict[int, Any]  # layer index -> the layer built on the meta device (`_meta_layers`), made on demand

    def __init__(
        self,
        specs: list,
        topology: Topology | None = None,
        *,
        loss_fn: Callable | None = None,
        partition: str | list[int] = "parameters",
        seed: int = 0,
        schedule: str | Schedule = "1f1b",
        microbatches: int | None = None,
        chunks_per_rank: int | None = None,
        activation_checkpoint_interval: int = 0,
        checkpoint_layers: str | None = None,
        device: torch.device | str | None = None,
        precision: Precision | str = "fp32",
        compile: bool = False,
    ):
        super().__init__()
        self.specs = list(specs)
        if loss_fn is not None and not callable(loss_fn) and not isinstance(loss_fn, LayerSpec):
            raise TypeError(f"PipelineModule(loss_fn=...) takes a function (output, labels) -> a scalar tensor, such "
                            f"as torch.nn.functional.cross_entropy, a LayerSpec of one, or None; got "
                            f"{type(loss_fn).__name__} {loss_fn!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"PipelineModule(seed=...) must be an int (every layer is seeded by seed and its index), "
                            f"got {type(seed).__name__} {seed!r}")
        if not isinstance(compile, bool):
            raise TypeError(f"PipelineModule(compile=...) must be True or False, got {type(compile).__name__} "
                            f"{compile!r}")
        self.loss_fn = loss_fn
        self.has_loss = loss_fn is not None  # on every rank, also where a loss module is not built
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"PipelineModule(topology=...) takes a pipekit.Topology (e.g. Topology(pp=2, dp=2)) or "
                            f"None for one process, got {type(topology).__name__} {topology!r}")
        self.topology = topology if topology is not None else Topology(pp=1, dp=1)
        self.seed = seed
        _check_same_seed(seed, self.topology)
        if activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be >= 0, got {activation_checkpoint_interval}")
        self.precision = precision if isinstance(precision, Precision) else precision_policy(precision)
        self.compile_layers = compile  # not `self.compile`: that would hide nn.Module.compile
        self.schedule = declare_schedule(schedule, self.topology.pp, microbatches, chunks_per_rank)
        self.placement = self.schedule.placement  # derived: virtual stage -> pipeline rank
        self.num_stages = self.schedule.num_stages
        self.chunks_per_rank = self.schedule.chunks_per_rank
        self.boundaries = partition_specs(self.specs, self.num_stages, partition)
        self.local_stages = [s for s in range(self.num_stages) if self.placement[s] == self.topology.pp_rank]
        self.checkpoint_interval = activation_checkpoint_interval
        self.checkpoint_pattern = re.compile(checkpoint_layers) if checkpoint_layers else None
        self.device = torch.device(device) if device is not None else self.topology.device
        self.layers = nn.ModuleDict()
        self.tied = nn.ModuleDict()
        self._funcs: dict[int, Callable] = {}
        with self._groups():
            for stage in self.local_stages:
                for i in self.stage_layers(stage):
                    self._build(i)
            if isinstance(loss_fn, LayerSpec):  # built where it runs: the rank of the last stage
                last_here = self.num_stages - 1 in self.local_stages
                self.loss_fn = (loss_fn.build(seed=seed, index=len(self.specs), device=self.device)
                                if last_here else None)  # kept fp32: it sees fp32 outputs
        bind_head = getattr(self.loss_fn, "bind_head", None)
        if bind_head is not None and self.num_stages - 1 in self.local_stages:
            bind_head(self.layer(len(self.specs) - 1))
        self.tie_groups = self._make_tie_groups()
        # per local stage, its runs of (index, layer) as `forward_stage` walks them: resolved once, here, where
        # the layers are built (ZeRO-3 and compile change a layer in place; none is replaced)
        self._stage_runs = {stage: [(tuple((i, self.layer(i)) for i in run), recompute)
                                    for run, recompute in self._segments(stage)] for stage in self.local_stages}

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype layers are cast to (None: left as built, fp32 keeps the built dtype)."""
        return self.precision.param_dtype if self.precision.mixed else None

    # ---- construction -------------------------------------------------
    @contextlib.contextmanager
    def _groups(self):
        """The topology's tp, ep and expert-tp groups as the current ones, and its sequence
        parallelism, for building layers."""
        topo = self.topology
        with tensor_parallel(topo.tp_group), expert_parallel(topo.ep_group), \
                expert_tensor_parallel(topo.etp_group), sequence_parallel(topo.sequence_parallel), \
                context_parallel(topo.cp_group, topo.cp_mode):
            yield

    def _build(self, i: int) -> None:
        spec = self.specs[i]
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied:
                self.tied[spec.key] = self._finish(build_layer(self.specs, i, seed=self.seed, device=self.device))
        else:
            built = build_layer(self.specs, i, seed=self.seed, device=self.device)
            if isinstance(built, nn.Module):
                self.layers[str(i)] = self._finish(built)
            else:
                self._funcs[i] = built

    def _finish(self, layer: nn.Module, meta: bool = False) -> nn.Module:
        """Cast a freshly built layer to the module's precision; compile it (not on meta)."""
        if self.param_dtype is not None:
            layer.to(self.param_dtype)
        if self.compile_layers and not meta and any(True for _ in layer.parameters()):
            layer.compile()
        return layer

    def _make_tie_groups(self) -> dict[str, Any]:
        """One process group per (tied key, dp replica, tp rank) spanning the pipeline ranks
        that hold the key; this rank's group for each key it holds. Collective: every rank
        walks the same keys in the same order."""
        topo = self.topology
        groups: dict[str, Any] = {}
        if not dist.is_initialized():
            return groups
        for key, owners in sorted(self.tied_owners().items()):
            if len(owners) < 2:
                continue
            for d in range(topo.dp):
                for t in range(topo.tp):
                    ranks = [topo.global_rank(r, d, t) for r in owners]
                    group = dist.new_group(ranks)
                    if topo.rank in ranks:
                        groups[key] = group
        return groups

    def stage_layers(self, stage: int) -> range:
        """Global indices of the layers of virtual stage `stage`."""
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    def stage_rank(self, stage: int) -> int:
        return self.placement[stage]

    def counted_in_norm(self) -> dict[str, bool]:
        """Whether each local parameter (by name) counts in the global gradient norm on this
        rank, so that summing over pp and tp counts every parameter once: a tp-replicated one
        only on tp rank 0, a tied one only on the first pipeline rank that holds it (an
        expert-TP shard carries `tp_shard_dim`, so each tp rank counts its own)."""
        topo = self.topology
        first_owner = {k: owners[0] for k, owners in self.tied_owners().items()}
        return {name: not ((getattr(p, "tp_shard_dim", None) is None and topo.tp_rank != 0)
                           or (name.startswith("tied.") and first_owner[name.split(".")[1]] != topo.pp_rank))
                for name, p in self.named_parameters()}

    def tied_owners(self) -> dict[str, list[int]]:
        """For each tied key, the sorted pipeline ranks whose stages hold it."""
        owners: dict[str, set[int]] = {}
        for stage in range(self.num_stages):
            for i in self.stage_layers(stage):
                spec = self.specs[i]
                if isinstance(spec, TiedLayerSpec):
                    owners.setdefault(spec.key, set()).add(self.placement[stage])
        return {k: sorted(v) for k, v in owners.items()}

    def layer(self, i: int) -> nn.Module | Callable:
        """This rank's layer `i` (a tied one: the module its key shares); it must be local."""
        spec = self.specs[i]
        if isinstance(spec, TiedLayerSpec):
            return self.tied[spec.key]
        return self.layers[str(i)] if str(i) in self.layers else self._funcs[i]

    # ---- running ------------------------------------------------------
    def run_layer(self, i: int, x, layer: nn.Module | Callable | None = None):
        """Apply layer `i` (this rank's copy, or `layer` when given) to `x`."""
        spec = self.specs[i]
        fn = layer if layer is not None else self.layer(i)
        if isinstance(spec, TiedLayerSpec) and spec.forward_fn is not None:
            through = getattr(fn, "call_tied", None)  # ZeRO-3: FSDP gathers the weights around it
            return through(spec.forward_fn, x) if through is not None else spec.forward_fn(fn, x)
        return fn(x)

    def _segments(self, stage: int) -> list[tuple[list[int], bool]]:
        """Split a stage's layers into runs, each flagged for recomputation or not."""
        idx = list(self.stage_layers(stage))
        if self.checkpoint_interval:
            k = self.checkpoint_interval
            return [(idx[j : j + k], True) for j in range(0, len(idx), k)]
        if self.checkpoint_pattern is not None:
            return [([i], bool(self.checkpoint_pattern.search(spec_name(self.specs[i])))) for i in idx]
        return [(idx, False)]

    def _run_run(self, run: tuple[tuple[int, Any], ...], x):
        """Apply a run of (index, layer) in order, checking in training that each keeps the gradient."""
        check = self.training and torch.is_grad_enabled()
        for i, fn in run:
            y = self.run_layer(i, x, layer=fn)
            if check and cuts_gradient(x, y):  # the check itself, and its message, only then
                check_gradient_flows(x, y, f"layer {i} ({spec_name(self.specs[i])})", fn)
            x = y
        return x

    def forward_stage(self, stage: int, x):
        """Run virtual stage `stage` (which must be local) on `x`."""
        for run, recompute in self._stage_runs[stage]:
            if recompute and torch.is_grad_enabled():
                x = checkpoint(self._run_run, run, x, use_reentrant=False)
            else:
                x = self._run_run(run, x)
        return x

    def forward(self, x):
        """Run every local stage in order: the whole model when pp=1."""
        for stage in self.local_stages:
            x = self.forward_stage(stage, x)
        return x

    # ---- shapes -------------------------------------------------------
    def stage_io_meta(self, example_input) -> list[tuple[Any, Any]]:
        """(input, output) of every virtual stage as meta tensors, for a microbatch
        shaped like `example_input`, in the module's mode (a layer may give other
        shapes in training and eval: a fused loss's head); found by running the
        whole spec list on the meta device, so it costs no memory and needs no
        communication. Also checks that every layer returns a tensor or a tuple of
        tensors."""
        with self._groups():
            meta_layers = self._meta_layers()
        for layer in meta_layers.values():
            if isinstance(layer, nn.Module):
                layer.train(self.training)
        x = to_meta(example_input)
        io = []
        for stage in range(self.num_stages):
            x_in = x
            with torch.no_grad():
                for i in self.stage_layers(stage):
                    x = self.run_layer(i, x, layer=meta_layers[i])
                    check_activation(x, f"layer {i} ({spec_name(self.specs[i])})")
            io.append((x_in, x))
        return io

    def _meta_layers(self) -> dict[int, Any]:
        if not hasattr(self, "_meta_cache"):
            tied: dict[str, nn.Module] = {}
            cache = {}
            for i, spec in enumerate(self.specs):
                if isinstance(spec, TiedLayerSpec):
                    if spec.key not in tied:
                        tied[spec.key] = self._finish(build_layer(self.specs, i, seed=self.seed, device="meta"), True)
                    cache[i] = tied[spec.key]
                else:
                    layer = build_layer(self.specs, i, seed=self.seed, device="meta")
                    cache[i] = self._finish(layer, True) if isinstance(layer, nn.Module) else layer
            object.__setattr__(self, "_meta_cache", cache)  # not a submodule: stays out of state_dict
        return self._meta_cache


def to_meta(x):
    """A meta-device copy of a tensor or tuple of tensors (shapes and dtypes only)."""
    if isinstance(x, tuple):
        return tuple(to_meta(v) for v in x)
    return torch.empty(x.shape, dtype=x.dtype, device="meta")
