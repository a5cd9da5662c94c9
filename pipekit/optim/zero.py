"""ZeroOptimizer: ZeRO stages 0-3 over data-parallel groups, fp32 master weights.

One class for one rank or many, for fp32 and for half-precision models; on one
rank at stage 0 in fp32 it is exactly the wrapped torch optimizer. It is the
engine's one gradient path: `ZeroOptimizer.wrap(torch_optimizer, module)`
takes a plain optimizer's class, param groups and hyperparameters at stage 0,
and a class or factory is built over whatever a rank holds (nothing, on a
stage without parameters).

The class is a façade over its parts, a file each:

    stage.py        `Stage`: what a ZeRO stage shards (masters, gradients; FSDP at 3)
    buckets.py      `Bucket` and how the parameters are laid out in flat buckets
    reducer.py      the gradient hooks and the reductions overlapped with backward
    step.py         unscale, norm and clip, the wrapped optimizer's step, the all-gather
    state.py        optimizer state by parameter, independent of the layout (checkpoints)
    collectives.py  gloo-aware reduce-scatter and all-gather
    hyper.py        param groups, hyperparameter checks, the optimizer by name, fused
    fsdp.py         stage 3: the layers sharded by FSDP2, and the optimizer's bridge to it

Layout (buckets.py). The trainable parameters are packed into flat buckets, one
run per segment (virtual stage or shared tied key), param group and dp group; a
parameter becomes a view into its bucket. Each bucket is padded to a multiple of
its dp group's size N and rank r owns the r-th of its N equal shards. Stage 3 is
stage 0 over what FSDP leaves each rank: the shards of the parameters it manages
(each a bucket of its own, reduced by FSDP), and whole the parameters it does not
(experts without replicas, reduced here).

State per rank, Ψ parameters, half-precision model, fp32 gradients:

    stage 0   params 2Ψ     grads 4Ψ       master 4Ψ    Adam state 8Ψ
    stage 1   params 2Ψ     grads 4Ψ       master 4Ψ/N  Adam state 8Ψ/N
    stage 2   params 2Ψ     grads 4Ψ/N     master 4Ψ/N  Adam state 8Ψ/N   (+ buckets in flight)
    stage 3   params 2Ψ/N   grads 4Ψ/N     master 4Ψ/N  Adam state 8Ψ/N   (+ layers FSDP holds whole)

(`grad_dtype=` the model dtype halves the gradient column, giving the ZeRO
paper's 16Ψ, 4Ψ + 12Ψ/N and 2Ψ + 14Ψ/N; an fp32 model keeps no separate
master copy: its master shard is a view of its own parameters.)

Communication per optimizer step, per bucket, over its dp group:

    backward   (reducer.py) a hook adds each gradient into its bucket; buckets are
               reduced in a fixed order as they complete, overlapping the rest of
               backward: stages 0/1 during the last backward pass of the bucket's
               stage (all-reduce; reduce-scatter into the own shard), stage 2
               during every pass (the reduced shard added into the rank's gradient
               shard and the bucket freed, at most `max_inflight` in flight).
               Stage 3: FSDP reduce-scatters its layers' gradients once, at the
               start of the step (`fsdp.reduce_gradients`).
    step       (reducer.py) tied segments are summed over their pipeline owners
               and sequence-parallel parameters over tp, on shards; (step.py)
               gradients are unscaled (1 / (N * loss scale)), a non-finite
               gradient, loss or input anywhere (finite.py: one all-reduce of a
               few flags over the world) skips the step on every rank,
               the global norm (each parameter once over dp, pp and tp) is
               clipped, one small all-reduce per dp group agrees on which
               parameters got a gradient, the wrapped optimizer steps the master
               shards, and stages 1/2 all-gather the updated parameters.

Host syncs per step: one, the read of the reduced non-finite marks
(`finite.Marks.verdict`), since whether the wrapped optimizer steps at all is
decided on the host (as torch.amp.GradScaler does), with or without a loss
scaler: a NaN born in the data or in backward never reaches the weights (the
norm and the clipping factor stay on the device; `last_grad_norm` is read when
read). A rank where some parameter got no gradient reads which ones got one
elsewhere.

Fused AdamW (`fused=True`, or "auto" on CUDA float32 masters): the wrapped
optimizer is `pipekit.kernels.adamw.FusedAdamW`, whose state per piece is torch
AdamW's (so `param_state` checkpoints move between fused and unfused runs) held
in flat per-bucket buffers: a bucket's shard is one kernel launch, and its
pieces are whole parameter parts (the Python work per step is per parameter,
not per 64k elements as for torch's optimizers' cache-sized pieces). The step
makes two passes over the gradients instead of up to four (unscale, overflow
check, clip, update): pass 1 checks for an overflow (with a loss scaler) and,
when clipping, unscales in place; pass 2 is the update, which multiplies each
gradient by the rest of its scale (the unscale, or the clipping coefficient)
as it loads it and skips on the device where the all-reduced flag is set. The
gradients meet the same float multiplications as unfused; the overflow flag is
read on the host once every update is queued (pipekit/kernels/adamw.py).

On gloo, whose reduce-scatter and all-gather measured slower than its
all-reduce and broadcasts, a reduce-scatter is an all-reduce (only the shard is
read) and an all-gather is one broadcast per shard; NCCL gets the real ones
(collectives.py).

Experts: a param group may carry its own `dp_group` (experts sharded over ep
ranks have a smaller data-parallel group) and an `ep_group` (the ranks holding
the other experts); buckets, reductions, sharding and the norm follow each
group's own dp group, and the norm sums over its ep group. A group that sets
no `dp_group` has its expert-parallel parameters (`p.expert_parallel`, ep > 1)
put in the topology's expert dp and ep groups, so a wrapped plain optimizer
needs no expert groups of its own.

A parameter that got no gradient anywhere in its dp group this step (an expert
that received no tokens) is skipped by the wrapped optimizer, as torch's skip a
.grad of None: it sees each parameter's part of a shard as pieces of its own.

Offload (`offload="cpu"|"nvme"`, offload.py): master weights and optimizer state in host
memory or files, the step on the CPU; at stage 2 the gradient shards are host memory too (each
reduced shard added in as reduced), so the device's gradients are only the buckets in flight.

Parameter offload (stage 3, `offload_params="cpu"`): FSDP keeps the parameter shards
and their reduced gradients in host memory between uses (fsdp.py); their master
weights and optimizer state are then host memory too and the step is offload.py's
(`offload="none"` steps as `"cpu"`). At the step each such shard's gradient is taken
into a buffer on the device made for that step (freed after it), where the tied
and tp sums, the norm, the non-finite marks and the clipping happen as without
offload; offload.py copies it to the host for the update.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..kernels.adamw import FusedAdamW
from ..topology import Topology
from .buckets import Bucket, Layout, is_view_of, make_buckets, topology_device, widest
from .collectives import Collectives
from .collectives import is_gloo as _is_gloo  # looked up here when an optimizer is made: a test replaces it
from .finite import Marks, Skip
from .fsdp import autograd_params, gathered_for, reduce_gradients, shard_groups
from .hyper import OPTIMIZERS, check_hyper, choose_fused, fused_by_default, optimizer_class, param_groups
from .offload import Offload, check_offload, check_offload_params, check_overlap, steps_on
from .reducer import Reducer
from .scaler import LossScaler
from .stage import Stage
from .state import load_param_state, param_state
from .step import Updater, clip_coef, fused_first_pass

__all__ = ["OPTIMIZERS", "Bucket", "ZeroOptimizer", "fused_by_default"]
_MB = 1 << 20


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO over each parameter's data-parallel group; wraps a torch optimizer.

    Args:
        params: a PipelineModule (its dp group, stages, tied keys and tp
            layout are used), an nn.Module, or parameters / param groups
            (groups may set "dp_group").
        optimizer: "adamw", "sgd", a torch optimizer class or a factory
            (`functools.partial(torch.optim.AdamW, lr=...)`), applied to the master
            shards with each group's hyperparameters. A torch optimizer instance:
            `ZeroOptimizer.wrap`.
        stage: 0 (replicated), 1 (master weights and optimizer state
            sharded), 2 (gradients too, reduced during backward), 3 (parameters
            too: each layer of `module` sharded by FSDP2, `pipekit.optim.fsdp`).
            Kept as `stage`; `sharding` is the `Stage` that answers what it shards.
        dp_group: the data-parallel group (default: the module's; None: no dp).
        master_dtype: dtype of master weights and optimizer state (default:
            float32, or the parameters' dtype when wider, e.g. float64).
        grad_dtype: dtype gradients are accumulated and reduced in (same default).
        bucket_mb: size of a bucket, in MB of gradients.
        clip_grad_norm: clip the global gradient norm to this (None: off).
        loss_scaler: a LossScaler for fp16 (None: no scaling, no overflow check).
        module: the PipelineModule the param groups come from, when `params`
            is a list of groups (weight decay on matrices only, say).
        max_inflight: stage 2 keeps at most this many reduced buckets in flight.
        fused: step AdamW with `pipekit.kernels.adamw.FusedAdamW` (one kernel launch per
            bucket, the unscale and the overflow check folded in; see "Fused AdamW" in the
            module docstring): True, False, or "auto" (on for AdamW with float32 master
            weights on CUDA).
        reshard_after_forward: stage 3: free a layer's gathered parameters after each
            forward (gathered again for its backward) instead of keeping them to the end of
            the step.
        offload: "none", "cpu" (master weights and optimizer state in host memory, the step
            on the CPU) or "nvme" (in files under `offload_dir`, a few buckets in memory at
            a time); `pipekit.optim.offload`. `pin_memory`: page-locked host buffers (CUDA).
        offload_params: stage 3: "cpu" keeps the parameter shards and their gradients in host
            memory between uses (FSDP2's CPUOffloadPolicy), and so their step on the CPU
            (`offload` "none" acts as "cpu"); "none" (default) keeps them on the device.
        offload_overlap: with "cpu" or "nvme" offload, begin each rank's host step as soon as its own
            gradients are reduced, before the world's verdict (non-finite check, global norm),
            in a background thread; a kept copy of the state is put back where the step is
            skipped or clipped (then stepped again). The same bits; one more copy of the
            offloaded state in host memory (nvme: a second file per bucket). See `_early_step`.
        **defaults: the wrapped optimizer's hyperparameters (lr, betas, ...).
    """

    def __init__(self, params, optimizer: str | type = "adamw", *, stage: int = 0, dp_group=None,
                 master_dtype: torch.dtype | None = None, grad_dtype: torch.dtype | None = None,
                 bucket_mb: float = 25.0, clip_grad_norm: float | None = None,
                 loss_scaler: LossScaler | None = None, module: nn.Module | None = None, max_inflight: int = 2,
                 fused: bool | str = False, reshard_after_forward: bool = False, offload: str = "none",
                 offload_dir: str | None = None, pin_memory: bool = True, offload_params: str = "none",
                 offload_overlap: bool = False, **defaults):
        if params is None or isinstance(params, (str, torch.Tensor)):
            raise TypeError(f"ZeroOptimizer takes the parameters to train (module.parameters(), a PipelineModule, "
                            f"or param groups), got {type(params).__name__}")
        self.sharding = Stage(stage)
        check_offload_params(offload_params, stage)
        check_offload(offload, offload_dir)
        check_overlap(steps_on(offload, offload_params), offload_overlap)
        if fused is True and (offload, offload_params) != ("none", "none"):
            which = f"offload={offload!r}" if offload != "none" else f"offload_params={offload_params!r}"
            raise ValueError(f"fused=True is the device kernel, but {which} steps on the CPU; use fused=False (or "
                             f"'auto') with offload")
        optimizer = optimizer_class(optimizer)
        self.module = params if isinstance(params, nn.Module) else module
        # the one place a PipelineModule (its Topology) is told from a plain module or none
        self.topology: Topology | None = getattr(self.module, "topology", None)
        if dp_group is None and self.topology is not None:
            dp_group = self.topology.dp_group
        groups = param_groups(params)
        self.sharded_layers: list[Any] = []  # stage 3: the layers FSDP shards (FSDPModules)
        if self.sharding.fsdp:
            reduce_dtype = grad_dtype or widest([p for g in groups for p in g["params"]])
            self.sharded_layers, groups = shard_groups(self.module, groups, reduce_dtype=reduce_dtype,
                                                       reshard_after_forward=reshard_after_forward,
                                                       offload_params=offload_params == "cpu", pin_memory=pin_memory)
        if self.sharded_layers:  # offloaded shards' master weights and state are on the host: so is their step
            offload = steps_on(offload, offload_params)
        super().__init__(groups, defaults)
        for gi, group in enumerate(self.param_groups):
            check_hyper(group, gi)
        self.stage, self.optimizer_class = stage, optimizer
        all_params = [p for g in groups for p in g["params"]]
        wide = widest(all_params)
        self.master_dtype, self.grad_dtype = master_dtype or wide, grad_dtype or wide
        self.bucket_numel = max(1, int(bucket_mb * _MB) // self.grad_dtype.itemsize)
        self.clip_grad_norm, self.loss_scaler = clip_grad_norm, loss_scaler
        self.max_inflight = max_inflight
        self.default_dp_group = dp_group
        # where the step's collectives run: the topology's device (the parameters' but where offloaded)
        device = (self.topology.device if self.topology is not None else
                  all_params[0].device if all_params else topology_device(None))
        # offloaded, the step runs on the host: "auto" answers for the CPU
        self.fused = choose_fused(fused, optimizer, self.master_dtype,
                                  device if offload == "none" else torch.device("cpu"))
        self._grad_norm: torch.Tensor | None = None  # the last step's, on the device until read
        self.last_skip: Skip | None = None  # why the last step was skipped (None: it was not)
        layout = Layout(self.sharding, self.bucket_numel, grad_dtype=self.grad_dtype, master_dtype=self.master_dtype,
                        fused=self.fused, module=self.module, topology=self.topology, default_dp_group=dp_group)
        self.buckets = make_buckets(self.param_groups, layout)
        self.offload = (Offload(offload, self.buckets, self.sharding, offload_dir=offload_dir, pin_memory=pin_memory,
                                device=device, overlap=offload_overlap) if offload != "none" else None)
        self.inner = self._make_inner()
        if self.offload is not None:
            self.offload.attach(self.inner)
        comm = Collectives(_is_gloo)
        self._reducer = Reducer(self.buckets, self.sharding, comm, grad_dtype=self.grad_dtype,
                                max_inflight=max_inflight, module=self.module, topology=self.topology,
                                fsdp_reduces=bool(self.sharded_layers), hook=self._on_grad)
        if self.offload is not None and self.offload.grads_on_host:
            self._reducer.host_shards = self.offload
        self._updater = Updater(self.buckets, self.sharding, comm, self.module, topology=self.topology,
                                master_dtype=self.master_dtype, fused=self.fused, bucket_numel=self.bucket_numel,
                                offloaded=self.offload is not None)
        self._comm = comm
        self._superseded_by: str | None = None
        self._take_parameters()
        self._reducer.arm(self._params())

    def _take_parameters(self) -> None:
        """Each parameter is trained by one ZeroOptimizer: a newer one over the same parameters (a
        second PipelineEngine on a module, a notebook cell run again) takes them over, and the
        older one, its hooks removed, refuses to run (`_check_current`) instead of both
        moving the same gradients."""
        for p in self._params():
            owner = getattr(p, "_pipekit_optimizer", None)
            old = owner() if owner is not None else None
            if old is not None and old is not self and old._superseded_by is None:
                old._reducer.disarm()
                old._superseded_by = f"a newer {type(self).__name__} (stage {self.stage})"
            p._pipekit_optimizer = weakref.ref(self)  # type: ignore[attr-defined]

    def _check_current(self) -> None:
        if self._superseded_by is not None:
            raise RuntimeError(f"this {type(self).__name__}'s parameters are trained by {self._superseded_by} built "
                               f"over the same module since (a second PipelineEngine or ZeroOptimizer on it); use "
                               f"the newest, or build a new PipelineModule for a second one")

    @classmethod
    def wrap(cls, optimizer: torch.optim.Optimizer, module: nn.Module) -> ZeroOptimizer:
        """Stage 0 around a plain torch optimizer over `module`'s parameters: the same
        class, param groups and hyperparameters, stepping the master copies. The param
        groups are shared (the same dicts), so an LR scheduler made for `optimizer`
        still sets the learning rate. `optimizer` itself is not stepped again, so it
        must hold no state yet."""
        if optimizer.state:
            raise ValueError(f"{type(optimizer).__name__} already holds state (it has stepped, or loaded a "
                             "state dict); wrap a fresh one, or build pipekit.optim.ZeroOptimizer(module, ...)")
        zero = cls(optimizer.param_groups, type(optimizer), module=module, stage=0)
        zero.param_groups = optimizer.param_groups
        return zero

    def _make_inner(self) -> torch.optim.Optimizer | None:
        if not any(b.pieces for b in self.buckets):
            return None
        pieces = (self.offload.pieces if self.offload is not None else
                  [[b.master[a:e] for a, e, _ in b.pieces] for b in self.buckets])
        groups = [{**self._hyper(b.group_index), "params": mine} for b, mine in zip(self.buckets, pieces)]
        return FusedAdamW(groups) if self.fused else self.optimizer_class(groups)

    def _world(self) -> int | None:
        """The ranks a step's non-finite marks are agreed over: its topology's (1 for a rank
        alone), or the whole world for a plain module."""
        return None if self.topology is None else self.topology.world_size

    def _hyper(self, gi: int) -> dict:
        """Param group `gi`'s hyperparameters, read when asked (`wrap` shares its groups)."""
        return {k: v for k, v in self.param_groups[gi].items() if k not in ("params", "dp_group", "ep_group")}

    def _params(self) -> Iterable[nn.Parameter]:
        return (p for b in self.buckets for p in b.params)

    # ---- gradients ----------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the fp16 loss scale (if any)."""
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def peak_inflight_bytes(self) -> int:
        """Stage 2: the most gradient bytes held in buckets in flight at once, so far."""
        return self._reducer.peak_inflight_bytes

    def _on_grad(self, p: nn.Parameter) -> None:
        """Each parameter's post-accumulate-grad hook: its gradient into its bucket
        (`Reducer.on_grad`)."""
        self._reducer.on_grad(p)

    def backward_pass(self, params: Iterable[nn.Parameter], final: Iterable[nn.Parameter] = ()):
        """A context manager around one backward pass that produces gradients for `params` (a
        stage and its tied layers); `final`: those of them whose gradients are complete for
        this step after it.

        Stage 2 reduces (and frees) every bucket of `params` during and right after each
        pass; stages 0 and 1 reduce the buckets made only of `final` parameters during
        their last pass, so the reduction overlaps the rest of backward. A bucket is
        launched when it and every bucket before it in a fixed order are complete; those
        left (holding parameters that got no gradient) are launched after the pass in the
        same order. Every dp rank must make the same sequence of calls."""
        self._check_current()
        return self._reducer.backward_pass(params, final)

    def gathered(self, params: list):
        """Stage 3 with `reshard_after_forward`: a context manager holding the layers with
        `params` gathered for the block inside (a split backward's weight pass, after its
        input pass resharded them), resharded after. Elsewhere nothing to do."""
        return gathered_for(self.sharded_layers, params)

    def autograd_params(self, params: list) -> list:
        """The tensors autograd differentiates for `params` in a forward run now: the
        parameters themselves, but at stage 3 FSDP's gathered copies of its sharded ones."""
        return autograd_params(self.sharded_layers, params)

    def _reduce(self, sums: bool = True) -> None:
        """Finish reducing the step's gradients (`Reducer.reduce`; `sums` False: not the pp sums
        of tied layers nor tp's partial sums); at stage 3 FSDP reduce-scatters its layers'
        gradients first."""
        if self.sharded_layers:
            self._take_sharded_grads()
        self._reducer.reduce(sums)

    def _take_sharded_grads(self) -> None:
        """Stage 3: FSDP's reduce-scatter of its layers' gradients, taken into their buckets; a
        host-held shard's (parameter offload) into a buffer on the device made for this step
        (`Updater.drop_grads` frees it)."""
        touched = reduce_gradients(self.sharded_layers)
        device = self._updater.device()
        for b in self.buckets:
            if b.host:
                b.grad_buf = torch.empty(b.param_buf.numel(), dtype=self.grad_dtype, device=device)
        self._reducer.take_sharded_grads(touched)

    # ---- the step -----------------------------------------------------------
    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping (None without clipping, or
        after a skipped step). Kept on the device: reading it is the host sync."""
        return None if self._grad_norm is None else self._grad_norm.item()

    @torch.no_grad()
    def step(self, closure: Callable | None = None, *, marks: Marks | None = None):
        """Reduce, unscale, check for non-finite values, clip, update the master weights, share them.

        The check (`pipekit.optim.finite`): a non-finite gradient on any rank, or anything
        `marks` holds (the engine's: each microbatch's loss and inputs), skips the step on
        every rank; `last_skip` says why. Host syncs: that one read of the reduced marks,
        which decides on the host whether the wrapped optimizer steps at all, as
        torch.amp.GradScaler does: the wrapped optimizer, its host-side step counts and an
        LR schedule need that decision there (fused AdamW reads it too, but only once every
        update is queued: `_fused_step`). Where a parameter got no gradient on this rank, one
        more read (of which parameters got one anywhere; see `Updater.touched_anywhere`)."""
        self._check_current()
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure")
        if self.offload is not None and self.offload.overlap and self.inner is not None and not self.fused:
            self._early_step(marks)
            return None
        self._reduce()
        self._reducer.arm(self._params())  # a gradient before zero_grad is refused by its hook
        grads, unscales = self._updater.grads(self._reducer.owned_grad, self.loss_scale)
        self._grad_norm = None
        marks = marks if marks is not None else Marks(self._updater.device(), world=self._world())
        if self.fused:
            self._fused_step(grads, unscales, marks)
            return None
        marks.mark_grads(grads)
        marks.reduce()
        if self._skipped(marks):
            self._updater.drop_grads()
            return None
        if self.clip_grad_norm is not None:
            self._clip(grads, self.clip_grad_norm)
        if self.inner is not None:
            self._inner_step(grads)
        self._finish_step()
        return None

    def _early_step(self, marks: Marks | None) -> None:
        """`step` with `offload_overlap`: the host step begins (in a thread, over the gradients
        as they are before clipping) before the world-wide collectives that decide it (the
        non-finite marks, the global norm), so a stage whose backward ends first steps while
        the others finish theirs; the verdict then keeps it, puts it back (skipped), or puts it
        back and steps again clipped (`Offload.finish`): the same bits as without overlap.
        A tied layer's buckets wait for their pp sum (the partner stage's gradient); the others
        begin before it, unless a tied bucket also takes a tp partial sum (then both sums come
        first, in the order the step without overlap makes them)."""
        assert self.offload is not None
        self._reduce(sums=False)
        self._reducer.arm(self._params())  # a gradient before zero_grad is refused by its hook
        tied = self._reducer.tied()
        if self._reducer.tp_partial_in(tied):
            self._reducer.sum_ties()
            tied = []
        self._reducer.sum_tp_partial()
        later = set(tied)
        first = [bi for bi in range(len(self.buckets)) if bi not in later]
        grads: dict[int, torch.Tensor] = {}
        grads.update(zip(first, self._updater.grads(self._reducer.owned_grad, self.loss_scale, first)[0]))
        touched = self._updater.touched_anywhere(self._reducer.touched)
        early = self.offload.start(grads, touched, self._hyper, only=first)
        if tied:
            self._reducer.sum_ties()
            grads.update(zip(tied, self._updater.grads(self._reducer.owned_grad, self.loss_scale, tied)[0]))
            self.offload.extend(early, grads, self._hyper, only=tied)
        ordered = [grads[bi] for bi in range(len(self.buckets))]
        self._updater.current = ordered
        self._grad_norm = None
        marks = marks if marks is not None else Marks(self._updater.device(), world=self._world())
        marks.mark_grads(ordered)
        marks.reduce()
        skipped = self._skipped(marks)
        coef = None
        if not skipped and self.clip_grad_norm is not None:
            coef = self._clip_coef(self.clip_grad_norm)
        self.offload.finish(early, skip=skipped, coef=coef)  # nvme's early thread read the device's gradients
        if coef is not None and not self.offload.grads_on_host:  # ZeRO-2's host shards: finish clipped them
            for g in ordered:
                g.mul_(coef)  # as without overlap: the device's gradients are clipped too
        if skipped:
            self._updater.drop_grads()
            return
        self._finish_step()

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped on every rank (`last_skip` says why)."""
        return self.last_skip is not None

    def _skipped(self, marks: Marks) -> bool:
        """Read the reduced marks (the host read) into `last_skip`; the loss scaler counts a
        skip as an overflow. True when the step is skipped."""
        scaler = self.loss_scaler
        recoverable = scaler is not None and scaler.dynamic and scaler.scale > scaler.min_scale
        skip = marks.verdict()
        if scaler is not None:
            scaler.update(skip is not None)
        if skip is not None:
            fp16_overflow = recoverable and not (skip.losses or skip.inputs)
            skip = replace(skip, loss_scale=scaler.scale if scaler is not None else None, overflow=fp16_overflow)
        self.last_skip = skip
        return skip is not None

    def _inner_step(self, grads: list[torch.Tensor], **fused: Any) -> None:
        """The wrapped optimizer's step over the pieces of the master shards, those of the
        parameters no rank gave a gradient skipped (`fused`: FusedAdamW.step's found_inf
        and grad_scales)."""
        assert self.inner is not None
        touched = self._updater.touched_anywhere(self._reducer.touched)
        if self.offload is not None:
            self.offload.step(grads, touched, self._hyper)  # and each master into the parameters
            return
        self._updater.inner_step(self.inner, grads, touched, self._hyper, **fused)

    def _finish_step(self) -> None:
        self._updater.share_params(written=self.offload is not None and self.inner is not None)
        self._updater.drop_grads()  # a converted (bf16 -> fp32) gradient copy is not kept between steps

    def _fused_step(self, grads: list[torch.Tensor], unscales: list[float], marks: Marks) -> None:
        """`step` with FusedAdamW, in two passes over the gradients (pipekit/kernels/adamw.py
        says why): pass 1 (`fused_first_pass`) marks non-finite gradients and, when clipping,
        unscales in place; the clipping coefficient is made on the device; pass 2, the
        update, multiplies each gradient by what is left of its scale (1 / (N * loss
        scale), or the clipping coefficient) as it loads it and writes nothing where any
        reduced mark is set. The one host read of the marks (loss scaler, `last_skip`)
        comes after every update is queued."""
        found_inf = fused_first_pass(grads, unscales, marks, clip=self.clip_grad_norm is not None)
        scales: list[float | torch.Tensor] = list(unscales)
        if self.clip_grad_norm is not None:
            scales = [self._clip_coef(self.clip_grad_norm)] * len(grads)
        if self.inner is not None:
            self._inner_step(grads, found_inf=found_inf, grad_scales=scales)
        if self._skipped(marks):
            self._grad_norm = None
            self._updater.drop_grads()
            return
        self._finish_step()

    def _clip(self, grads: list[torch.Tensor], max_norm: float) -> None:
        """Scale the gradients so that their global norm is at most `max_norm`, on the device."""
        coef = self._clip_coef(max_norm)
        on: dict[torch.device, torch.Tensor] = {coef.device: coef}
        for g in grads:  # ZeRO-2 offload: host shards, times the coefficient read once onto the host
            if g.device not in on:
                on[g.device] = coef.to(g.device)
            g.mul_(on[g.device])

    def _clip_coef(self, max_norm: float) -> torch.Tensor:
        """The clipping coefficient of the global gradient norm, on the device; the norm is
        kept for `last_grad_norm`."""
        norm = self._grad_norm = self._updater.norm()
        return clip_coef(norm, max_norm)

    def grad_norm(self) -> float:
        """Global L2 norm of the unscaled, reduced gradients (during `step`), read on the
        host; see `Updater.norm`."""
        return self._updater.norm().item()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the step's gradients. At stages 0 and 1, when gradients are kept in the
        parameters' own dtype, each `p.grad` becomes a view of its bucket, so autograd
        accumulates into the bucket in place (no copy in the hook)."""
        self._check_current()
        self._reducer.zero_grad()

    # ---- introspection ------------------------------------------------------
    def full_grad(self, p: nn.Parameter) -> torch.Tensor:
        """The accumulated (not yet reduced) gradient of `p` (stages 0, 1)."""
        return self._reducer.full_grad(p)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds on its device for parameters, gradients, master weights and
        optimizer state. Stage 2's gradients include the largest set of buckets in flight seen
        so far. Offloaded, master weights and state are not on the device: "host" and "disk"
        say what the offload holds (host: what is in memory now; on a CPU-only run that is the
        same memory as the device's)."""
        def nbytes(t):
            return t.numel() * t.element_size() if t is not None else 0

        shards_grads = self.sharding.shards_grads
        params = sum(nbytes(b.param_buf) for b in self.buckets if not b.host)  # host-held shards: under "host"
        on_host = self.offload is not None and self.offload.grads_on_host  # ZeRO-2's shards: under "host"
        grads = sum(0 if on_host else nbytes(b.grad_shard) if shards_grads else nbytes(b.grad_buf)
                    for b in self.buckets)
        if shards_grads:
            grads += self.peak_inflight_bytes
        if self.offload is not None:
            host = self.offload.host_bytes() + sum(nbytes(b.param_buf) for b in self.buckets
                                                   if b.host and not is_view_of(b.master, b.param_buf))
            return {"params": params, "grads": grads, "master": 0, "optimizer_state": 0,
                    "host": host, "disk": self.offload.disk_bytes()}
        master = sum(nbytes(b.master) for b in self.buckets if not is_view_of(b.master, b.param_buf))
        state = 0
        if self.inner is not None:
            for s in self.inner.state.values():
                state += sum(nbytes(v) for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1)
        return {"params": params, "grads": grads, "master": master, "optimizer_state": state}

    # ---- state --------------------------------------------------------------
    @torch.no_grad()
    def param_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """The optimizer state by parameter, independent of stage, dp size and bucketing:
        {param: {"exp_avg": ..., "exp_avg_sq": ..., "step": ..., "master": ...}}
        (`pipekit.optim.state`). Collective over each bucket's dp group where the stage
        shards (a transient full copy of one bucket's state at a time)."""
        return param_state(self.buckets, self.inner, self.sharding, self._comm, resident=self._resident)

    @torch.no_grad()
    def load_param_state(self, per_param: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Load state in `param_state`'s form into any stage, dp size and bucketing (no
        communication: every rank is given the state of all its parameters). Call after
        the model's weights are loaded: master copies missing from `per_param` are taken
        from the parameters; a parameter without optimizer entries starts fresh."""
        load_param_state(self.buckets, self.inner, self.sharding, per_param, resident=self._resident)

    def _resident(self, bi: int):
        """Bucket `bi`'s master part and state in memory inside the block (offload=nvme pages it)."""
        return self.offload.resident(bi) if self.offload is not None else nullcontext()

    def state_dict(self) -> dict:
        with self.offload.all_resident() if self.offload is not None else nullcontext():
            inner = self.inner.state_dict() if self.inner else None
            if self.offload is not None and self.offload.kind == "nvme":
                inner = copy.deepcopy(inner)  # its tensors' storages are freed when the buckets go out
            return {"inner": inner, "masters": [b.master.clone() for b in self.buckets],
                    "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
                    "param_groups": [self._hyper(i) for i in range(len(self.param_groups))]}

    def load_state_dict(self, state: dict) -> None:
        """Load a state saved by the same layout (layout-free checkpoints: `load_param_state`)."""
        with self.offload.all_resident() if self.offload is not None else nullcontext():
            if self.inner is not None:
                self.inner.load_state_dict(state["inner"])
            for b, m in zip(self.buckets, state["masters"]):
                b.master.copy_(m)
            self._updater.share_params()
        if self.loss_scaler is not None and state.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        for g, h in zip(self.param_groups, state["param_groups"]):
            g.update(h)
