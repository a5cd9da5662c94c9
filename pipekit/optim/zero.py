"""ZeroOptimizer: ZeRO stages 0, 1 and 2 over data-parallel groups, fp32 master weights.

One class for one rank or many, for fp32 and for half-precision models; on one
rank at stage 0 in fp32 it is exactly the wrapped torch optimizer. It is the
engine's one gradient path: `ZeroOptimizer.wrap(torch_optimizer, module)`
takes a plain optimizer's class, param groups and hyperparameters at stage 0,
and a class or factory is built over whatever a rank holds (nothing, on a
stage without parameters).

Layout. The trainable parameters are packed into flat *buckets*: one run of
buckets per segment (a virtual pipeline stage, or a tied key, which must lay
out the same way on every pipeline rank that holds it) and param group. A
model parameter becomes a view into its bucket's parameter buffer (model
dtype). A bucket records which of its ranges count in the gradient norm on
this rank; that is not part of the layout, since a tied weight counts on its
first pipeline owner only and a tp-replicated one on tp rank 0, while a tied
segment's buckets must match on every owner. Each bucket is padded to a
multiple of its data-parallel group's size N and rank r owns the r-th of the N
equal shards of every bucket, as Megatron's distributed optimizer does.

State per rank, Ψ parameters, half-precision model, fp32 gradients:

    stage 0   params 2Ψ   grads 4Ψ       master 4Ψ    Adam state 8Ψ
    stage 1   params 2Ψ   grads 4Ψ       master 4Ψ/N  Adam state 8Ψ/N
    stage 2   params 2Ψ   grads 4Ψ/N     master 4Ψ/N  Adam state 8Ψ/N   (+ buckets in flight)

(`grad_dtype=` the model dtype halves the gradient column, giving the ZeRO
paper's 16Ψ, 4Ψ + 12Ψ/N and 2Ψ + 14Ψ/N; an fp32 model keeps no separate
master copy: its master shard is a view of its own parameters.)

Communication per optimizer step, per bucket, over its dp group:

    backward   a post-accumulate-grad hook adds each parameter's gradient into
               its bucket (at stages 0/1 in the parameters' dtype, `p.grad`
               is a view of the bucket and autograd accumulates in place, and
               the hook, needed then only to note that the parameter got a
               gradient, runs once per step, not once per microbatch, except
               in the pass that reduces its bucket, where it counts arrivals).
               Buckets are reduced in a fixed order, each as soon as it and
               every bucket before it are complete, so the reduction overlaps
               the rest of backward: stages 0/1 during the last backward pass
               of the bucket's stage (all-reduce; reduce-scatter into the own
               shard), stage 2 during every pass (every microbatch: the
               reduced shard is added into the rank's gradient shard and the
               bucket freed, at most `max_inflight` buckets in flight).
    step       tied segments are summed over their pipeline owners (on
               shards), gradients are unscaled (1 / (N * loss scale)), an fp16
               overflow anywhere (all-reduce over the world) skips the step
               on every rank, the global norm (each parameter once over dp, pp
               and tp) is clipped, the wrapped optimizer steps the master
               shards, and stages 1/2 all-gather the updated parameters.

Host syncs per step: none without a loss scaler (the norm and the clipping
factor stay on the device; `last_grad_norm` is read when read). With one, one
read of the overflow flag, since whether the wrapped optimizer steps at all is
decided on the host (as torch.amp.GradScaler does). A rank where some
parameter got no gradient reads which ones got one elsewhere (below).

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
read) and an all-gather is one broadcast per shard; NCCL gets the real ones.
Stage 2 trades memory for traffic: microbatch m's gradients are reduced
before microbatch m+1's backward, M reductions per step where stages 0/1 do one.

Experts: a param group may carry its own `dp_group` (experts sharded over ep
ranks have a smaller data-parallel group) and an `ep_group` (the ranks holding
the other experts); buckets, reductions, sharding and the norm follow each
group's own dp group, and the norm sums over its ep group. A group that sets
no `dp_group` has its expert-parallel parameters (`p.expert_parallel`, ep > 1)
put in the topology's expert dp and ep groups, so a wrapped plain optimizer
needs no expert groups of its own.

Sequence parallelism (the topology's `sequence_parallel`): the parameters marked
`sequence_parallel` (replicated over tp, each copy fed by its rank's sequence slice:
norms, row-parallel biases, GPT-2's position table, MoE layers) get their gradients
summed over the tp group after the dp reduction, one all-reduce per step over the
part of the buckets this rank updates (`_sum_sequence_parallel`).

A parameter that got no gradient anywhere in its dp group this step (an
expert that received no tokens) is skipped by the wrapped optimizer, as torch's
optimizers skip a parameter whose .grad is None: the wrapped optimizer sees each
parameter's part of a shard as its own pieces, and one small all-reduce per
dp group per step agrees on which parameters were touched (read back only on a
rank where some parameter got no gradient: elsewhere the answer is "all").
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..kernels.adamw import FusedAdamW, unscale_and_check_
from ..layers.parallel import is_sequence_parallel
from ..spec import TiedLayerSpec
from .fsdp import gather_rows, own_rows, replica_group, shard_group
from .scaler import LossScaler

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
_MB = 1 << 20
_PIECE = 1 << 16  # the wrapped optimizer sees a master shard as pieces of this many elements (cache-sized on a CPU)


@dataclass(eq=False)
class Bucket:
    """A flat run of parameters that share a segment, a dp group and a param group."""

    params: list[nn.Parameter]
    group_index: int
    dp_group: Any
    segment: Any
    ep_group: Any = None  # experts: the group their parameters are sharded over (summed in the norm)
    shard_group: Any = None  # stage 3: the dp group FSDP shards its one parameter over (this is its shard)
    replica_group: Any = None  # stage 3, hybrid sharding: the groups holding the same shard
    param_buf: torch.Tensor = field(init=False)
    offsets: dict = field(default_factory=dict)  # id(param) -> (start, numel)
    grad_buf: torch.Tensor | None = None  # full bucket (stages 0, 1; stage 2 while in flight)
    grad_shard: torch.Tensor | None = None  # stage 2: this rank's accumulated shard
    master: torch.Tensor = field(init=False)  # master weights: full (stage 0) or this rank's shard
    arrived: int = 0
    launched: bool = False
    counted_ranges: list = field(default_factory=list)  # [start, end) bucket ranges in the norm here
    pieces: list = field(default_factory=list)  # (start, end, param) in `master`: what the wrapped optimizer steps

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self.dp_group) if self.dp_group is not None else 1

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp_group) if self.dp_group is not None else 0

    @property
    def shard(self) -> slice:
        n = self.param_buf.numel() // self.dp_size
        return slice(self.dp_rank * n, (self.dp_rank + 1) * n)

    def view_of(self, buf: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        """`p`'s part of the bucket-sized `buf`, shaped as `p`."""
        start, n = self.offsets[id(p)]
        return buf[start:start + n].view_as(p)


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
            bucket, the unscale and the overflow check folded in; see "Fused AdamW" below):
            True, False, or "auto" (on for AdamW with float32 master weights on CUDA).
        reshard_after_forward: stage 3: free a layer's gathered parameters after each
            forward (gathered again for its backward) instead of keeping them to the end of
            the step.
        **defaults: the wrapped optimizer's hyperparameters (lr, betas, ...).
    """

    def __init__(self, params, optimizer: str | type = "adamw", *, stage: int = 0, dp_group=None,
                 master_dtype: torch.dtype | None = None, grad_dtype: torch.dtype | None = None,
                 bucket_mb: float = 25.0, clip_grad_norm: float | None = None,
                 loss_scaler: LossScaler | None = None, module: nn.Module | None = None, max_inflight: int = 2,
                 fused: bool | str = False, reshard_after_forward: bool = False, **defaults):
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        if isinstance(optimizer, str):
            if optimizer not in OPTIMIZERS:
                raise ValueError(f"optimizer={optimizer!r} is not one of {list(OPTIMIZERS)} (or pass a class)")
            optimizer = OPTIMIZERS[optimizer]
        self.module = params if isinstance(params, nn.Module) else module
        topo = getattr(self.module, "topology", None)
        if dp_group is None and topo is not None:
            dp_group = topo.dp_group
        groups = _param_groups(params)
        self._requested_grad_dtype = grad_dtype
        self.sharded_layers: list[Any] = []  # stage 3: the layers FSDP shards (FSDPModules)
        if stage == 3:
            groups = self._shard(groups, reshard_after_forward)
        super().__init__(groups, defaults)
        for gi, group in enumerate(self.param_groups):
            _check_hyper(group, gi)
        self.stage, self.optimizer_class = stage, optimizer
        # Stage 3 is stage 0 over what FSDP leaves each rank: the shards of the parameters it
        # manages (reduced by FSDP), and whole the parameters it does not (experts, reduced here).
        self._layout = 0 if stage == 3 else stage
        wide = _widest([p for g in groups for p in g["params"]])
        self.master_dtype, self.grad_dtype = master_dtype or wide, grad_dtype or wide
        self.bucket_numel = max(1, int(bucket_mb * _MB) // self.grad_dtype.itemsize)
        self.clip_grad_norm, self.loss_scaler = clip_grad_norm, loss_scaler
        self.max_inflight = max_inflight
        self.default_dp_group = dp_group
        self.fused = self._fused(fused, [p for g in groups for p in g["params"]])
        self._grad_norm: torch.Tensor | None = None  # the last step's, on the device until read
        self.last_step_skipped = False
        self.peak_inflight_bytes = 0
        self._pending: list = []  # stage 2: (work, bucket) reductions in flight
        self._current: list[Bucket] | None = None  # stage 2: buckets of the backward pass running now
        self._dirty = False
        self._touched: set[int] = set()  # ids of parameters that got a gradient this step, here
        self.buckets = self._make_buckets()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.inner = self._make_inner()
        self._hooks: dict[int, Any] = {}  # id(p) -> its armed post-accumulate-grad hook's handle
        self._arm(p for b in self.buckets for p in b.params)

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

    # ---- construction -------------------------------------------------------
    def _shard(self, groups: list[dict], reshard_after_forward: bool) -> list[dict]:
        """Stage 3: shard the module's layers with FSDP; `groups` with the module's parameters
        replaced by FSDP's (found by name)."""
        from .fsdp import shard_layers

        if self.module is None or not hasattr(self.module, "topology"):
            raise ValueError("ZeRO stage 3 shards the layers of a PipelineModule: pass the module (as params, "
                             "or module=)")
        names = {id(p): n for n, p in self.module.named_parameters()}
        self.sharded_layers = shard_layers(self.module, reshard_after_forward=reshard_after_forward,
                                           reduce_dtype=self._grad_dtype_of(groups))
        now = dict(self.module.named_parameters())
        return [{**g, "params": [now[names[id(p)]] if id(p) in names else p for p in g["params"]]} for g in groups]

    def _grad_dtype_of(self, groups: list[dict]) -> torch.dtype:
        """The dtype gradients will be reduced in (before `grad_dtype` is set: `_shard` runs first)."""
        return self._requested_grad_dtype or _widest([p for g in groups for p in g["params"]])

    def _make_buckets(self) -> list[Bucket]:
        segment_of, counted, first_use = _segments(self.module)
        buckets: list[Bucket] = []
        for gi, group in enumerate(self.param_groups):
            for (dp_group, ep_group), members in self._reduction_groups(group).items():
                runs: dict[tuple, list[nn.Parameter]] = {}
                for p in members:
                    if _sharded(p):  # stage 3: FSDP's shard, a bucket of its own over its local tensor
                        buckets.append(self._shard_bucket(p, gi, counted, segment_of(p)))
                        buckets[-1].ep_group = ep_group
                        continue
                    runs.setdefault(segment_of(p), []).append(p)
                # Launch order: stages before shared tied keys, and within a run the parameters whose
                # gradients complete first (backward visits layers last to first; a tied input
                # embedding, also the head, completes only at the end).
                order = sorted(runs.items(), key=lambda kv: (isinstance(kv[0], str), str(kv[0])))
                for segment, params in order:
                    backward_order = sorted(reversed(params), key=first_use, reverse=True)  # stable: ties reversed
                    for chunk in _chunks(backward_order, self.bucket_numel):
                        buckets.append(self._make_bucket(chunk, gi, dp_group, counted, segment))
                        buckets[-1].ep_group = ep_group
        return buckets

    def _reduction_groups(self, group: dict) -> dict[tuple, list[nn.Parameter]]:
        """{(dp group, ep group): trainable parameters} of a param group: its own "dp_group"
        and "ep_group" when it sets them; else the default dp group, and for experts
        sharded over ep > 1 ranks (`p.expert_parallel`) the topology's expert dp group and
        ep group, so a plain optimizer's param groups need no expert split of their own."""
        topo = getattr(self.module, "topology", None)
        experts: tuple | None = None  # the expert groups, where this param group's experts go to them
        if topo is not None and "dp_group" not in group and getattr(topo, "ep", 1) > 1:
            experts = (topo.edp_group, topo.ep_group)
        out: dict[tuple, list[nn.Parameter]] = {}
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if experts is not None and getattr(p, "expert_parallel", False):
                key = experts
            else:
                key = (group.get("dp_group", self.default_dp_group), group.get("ep_group"))
            out.setdefault(key, []).append(p)
        return out

    def _make_bucket(self, params, gi, dp_group, counted, segment) -> Bucket:
        b = Bucket(params, gi, dp_group, segment)
        n = sum(p.numel() for p in params)
        size = math.ceil(max(n, 1) / b.dp_size) * b.dp_size
        p0 = params[0]
        b.param_buf = torch.zeros(size, dtype=p0.dtype, device=p0.device)
        offset = 0
        for p in params:
            b.param_buf[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = b.param_buf[offset:offset + p.numel()].view_as(p)
            b.offsets[id(p)] = (offset, p.numel())
            if counted(p):
                if b.counted_ranges and b.counted_ranges[-1][1] == offset:
                    b.counted_ranges[-1] = (b.counted_ranges[-1][0], offset + p.numel())
                else:
                    b.counted_ranges.append((offset, offset + p.numel()))
            offset += p.numel()
        if self._layout < 2:
            b.grad_buf = torch.zeros(size, dtype=self.grad_dtype, device=p0.device)
        else:
            b.grad_shard = torch.zeros(size // b.dp_size, dtype=self.grad_dtype, device=p0.device)
        owned = b.param_buf if self._layout == 0 else b.param_buf[b.shard]
        b.master = owned if owned.dtype == self.master_dtype else owned.to(self.master_dtype)
        first = 0 if self._layout == 0 else b.shard.start
        for p in params:  # pieces never straddle two parameters, so each can be skipped alone
            start, n = b.offsets[id(p)]
            lo, hi = max(start, first), min(start + n, first + owned.numel())
            size = max(hi - lo, 1) if self.fused else _PIECE  # fused: one run per bucket whatever the pieces
            b.pieces += [(a - first, min(a + size, hi) - first, p) for a in range(lo, hi, size)]
        return b

    def _shard_bucket(self, p: nn.Parameter, gi: int, counted, segment) -> Bucket:
        """Stage 3: a bucket over FSDP's local shard of `p`, aliased, not copied (FSDP gathers
        the layer from that storage), whose gradient FSDP has already reduced."""
        b = Bucket([p], gi, None, segment, shard_group=shard_group(p), replica_group=replica_group(p))
        local = _local(p).detach()
        b.param_buf = local.view(-1)
        n = b.param_buf.numel()
        b.offsets[id(p)] = (0, n)
        if counted(p) and n:
            b.counted_ranges.append((0, n))
        b.grad_buf = torch.zeros(n, dtype=self.grad_dtype, device=local.device)
        b.master = b.param_buf if b.param_buf.dtype == self.master_dtype else b.param_buf.to(self.master_dtype)
        size = max(n, 1) if self.fused else _PIECE
        b.pieces = [(a, min(a + size, n), p) for a in range(0, n, size)]
        return b

    def _fused(self, fused: bool | str, params: list[nn.Parameter]) -> bool:
        """Whether FusedAdamW steps the master shards (`fused`: True, False or "auto"; the
        same answer on every rank, one without parameters too: the step's collectives differ)."""
        if fused not in (True, False, "auto"):
            raise ValueError(f"fused={fused!r} is not one of [True, False, 'auto']")
        adamw = self.optimizer_class is torch.optim.AdamW
        if fused is True and not adamw:
            raise ValueError(f"fused=True steps AdamW only, got optimizer={self.optimizer_class!r}; use "
                             "optimizer='adamw', or fused=False")
        if fused == "auto":
            device = params[0].device if params else _device(self.module)
            return fused_by_default(self.optimizer_class, self.master_dtype, device.type)
        return bool(fused)

    def _make_inner(self) -> torch.optim.Optimizer | None:
        if not any(b.pieces for b in self.buckets):
            return None
        groups = [{**self._hyper(b.group_index), "params": [b.master[a:e] for a, e, _ in b.pieces]}
                  for b in self.buckets]
        return FusedAdamW(groups) if self.fused else self.optimizer_class(groups)

    def _hyper(self, gi: int) -> dict:
        return {k: v for k, v in self.param_groups[gi].items() if k not in ("params", "dp_group", "ep_group")}

    # ---- gradients ----------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the fp16 loss scale (if any)."""
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def _arm(self, params: Iterable[nn.Parameter]) -> None:
        """Register the gradient hook on those of `params` that have none armed."""
        for p in params:
            if id(p) not in self._hooks and not (self.sharded_layers and _sharded(p)):  # stage 3: FSDP reduces
                self._hooks[id(p)] = p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: move p.grad into its bucket (in grad_dtype) and free it.

        Where autograd accumulated in place (stages 0/1, `p.grad` a view of the bucket) and
        the bucket is not waiting for arrivals (it is not reduced during this pass), the
        hook has done all it must this step once it marked `p` touched: it removes
        itself, so a parameter costs one hook call per step, not one per microbatch.
        `zero_grad` re-arms it for the next step, and `backward_pass` for the pass that
        reduces its bucket (which counts arrivals)."""
        b = self._bucket_of[id(p)]
        start, n = b.offsets[id(p)]
        self._touched.add(id(p))
        if b.launched:  # a gradient after its bucket was reduced
            if self._layout < 2:
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} got a gradient after its bucket was reduced: a backward "
                    "pass after the one marked final for it, or reentrant checkpointing firing its hook twice; "
                    "use non-reentrant checkpointing (PipelineModule's own), or ZeRO stage 2")
            self._drain()  # stage 2: reduce again at the end of the pass
            b.launched, b.arrived = False, 0
        if b.grad_buf is None:  # stage 2: a bucket starts filling
            b.grad_buf = torch.zeros_like(b.param_buf, dtype=self.grad_dtype)
            self.peak_inflight_bytes = max(self.peak_inflight_bytes, self._inflight_bytes())
        grad = p.grad
        assert grad is not None  # the hook runs once it is accumulated
        in_place = grad.data_ptr() == b.grad_buf[start:].data_ptr()
        if not in_place:
            b.grad_buf[start:start + n].add_(grad.reshape(-1))
            p.grad = None
        self._dirty = True
        if self._current is not None and b in self._current:
            b.arrived += 1
            self._launch_ready(self._current)
        elif in_place:
            self._hooks.pop(id(p)).remove()

    @contextlib.contextmanager
    def backward_pass(self, params: Iterable[nn.Parameter], final: Iterable[nn.Parameter] = ()):
        """Wrap one backward pass that produces gradients for `params` (a stage and its tied
        layers); `final`: those of them whose gradients are complete for this step after it.

        Stage 2 reduces (and frees) every bucket of `params` during and right after each
        pass; stages 0 and 1 reduce the buckets made only of `final` parameters during
        their last pass, so the reduction overlaps the rest of backward. A bucket is
        launched when it and every bucket before it in a fixed order are complete; those
        left (holding parameters that got no gradient) are launched after the pass in the
        same order. Every dp rank must make the same sequence of calls."""
        ids = {id(p) for p in (params if self._layout == 2 else final)}
        if self._layout == 2:
            self._drain()  # the previous pass's reductions overlapped the actions since; finish them
            current = [b for b in self.buckets if any(id(p) in ids for p in b.params)]
        else:  # a bucket with no dp group has nothing to reduce: it needs no arrivals counted
            current = [b for b in self.buckets
                       if b.dp_group is not None and not b.launched and all(id(p) in ids for p in b.params)]
        self._arm(p for b in current for p in b.params)
        self._current = current
        for b in current:
            b.arrived, b.launched = 0, False
        try:
            yield
            for b in current:
                if not b.launched:
                    self._launch(b)
        finally:
            self._current = None
            self._dirty = self._layout < 2 and self._dirty

    def _launch_ready(self, current: list[Bucket]) -> None:
        for b in current:
            if b.launched:
                continue
            if b.arrived < len(b.params):
                return
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        """Start reducing bucket `b` over its dp group: all-reduce (stage 0) or
        reduce-scatter into its own shard (stages 1, 2). Stage 2 keeps at most
        `max_inflight` buckets in flight, finishing the oldest first."""
        if b.grad_buf is None:
            b.grad_buf = torch.zeros_like(b.param_buf, dtype=self.grad_dtype)
        work = None
        if b.dp_group is not None:
            if self._layout == 0:
                work = dist.all_reduce(b.grad_buf, group=b.dp_group, async_op=True)
            else:
                work = _reduce_scatter(b.grad_buf, b.shard, b.dp_group)
        self._pending.append((work, b))
        b.launched = True
        while self._layout == 2 and len(self._pending) > self.max_inflight:
            self._finish(*self._pending.pop(0))

    def _finish(self, work, b: Bucket) -> None:
        if work is not None:
            work.wait()
        if self._layout == 2:  # add the reduced shard into this rank's gradient shard; free the bucket
            assert b.grad_shard is not None and b.grad_buf is not None  # stage 2: a launched bucket
            b.grad_shard.add_(b.grad_buf[b.shard])
            b.grad_buf = None

    def _drain(self) -> None:
        """Wait for every reduction in flight."""
        for work, b in self._pending:
            self._finish(work, b)
        self._pending.clear()

    def _inflight_bytes(self) -> int:
        return sum(b.grad_buf.numel() * b.grad_buf.element_size() for b in self.buckets if b.grad_buf is not None)

    def _reduce(self) -> None:
        """Finish reducing the step's gradients over each bucket's dp group (launching what
        no backward pass launched: a plain training loop); sum tied segments over pp.
        Stage 3: FSDP reduce-scatters its layers' gradients first (`fsdp.reduce_gradients`)."""
        if self.sharded_layers:
            self._take_sharded_grads()
        if self._layout < 2 or self._dirty:
            for b in self.buckets:
                if self._layout == 2 or not b.launched:
                    self._launch(b)
            self._dirty = False
        self._drain()
        tie_groups = getattr(self.module, "tie_groups", {})
        for b in self.buckets:
            if isinstance(b.segment, str) and b.segment in tie_groups:
                dist.all_reduce(self._owned_grad(b), group=tie_groups[b.segment])
        self._sum_sequence_parallel()

    def _sum_sequence_parallel(self) -> None:
        """Sequence parallelism (the topology's `sequence_parallel`): sum over the tp group the
        gradients of the parameters marked `sequence_parallel` (norms, row-parallel biases,
        GPT-2's position table: replicated over tp, each rank's copy fed by its sequence slice
        only), in the part of each bucket this rank updates, as one all-reduce. Every tp rank
        has the same buckets (the same parameters, tp shards of the same shapes), so the
        pieces line up."""
        topo = getattr(self.module, "topology", None)
        group = getattr(topo, "tp_group", None) if getattr(topo, "sequence_parallel", False) else None
        if group is None:
            return
        pieces = []
        for b in self.buckets:
            owned = self._owned_grad(b)
            start = 0 if self._layout == 0 else b.shard.start
            for p in b.params:
                if not is_sequence_parallel(p):
                    continue
                offset, n = b.offsets[id(p)]
                lo, hi = max(offset, start), min(offset + n, start + owned.numel())
                if lo < hi:
                    pieces.append(owned[lo - start:hi - start])
        if not pieces:
            return
        flat = torch.cat(pieces)
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(pieces, list(flat.split([t.numel() for t in pieces])))

    def _take_sharded_grads(self) -> None:
        from .fsdp import reduce_gradients

        self._touched |= reduce_gradients(self.sharded_layers)
        for b in self.buckets:
            if b.shard_group is None:
                continue
            p = b.params[0]
            assert b.grad_buf is not None  # made with the bucket, never freed
            if p.grad is None:
                b.grad_buf.zero_()
            else:
                b.grad_buf.copy_(_local(p.grad).reshape(-1))
                p.grad = None

    def _owned_grad(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced gradient for the part of `b` it updates."""
        if self._layout == 2:
            assert b.grad_shard is not None  # made with the bucket at stage 2
            return b.grad_shard
        assert b.grad_buf is not None  # made with the bucket at stages 0, 1, never freed
        return b.grad_buf if self._layout == 0 else b.grad_buf[b.shard]

    @contextlib.contextmanager
    def gathered(self, params: list):
        """Stage 3 with `reshard_after_forward`: the layers holding `params` gathered for the
        block inside (a split backward's weight pass, after its input pass resharded them),
        resharded after. Elsewhere nothing to do."""
        layers: list[Any] = [layer for layer in self.sharded_layers if getattr(layer, "pipekit_reshard", False)]
        ids = {id(p) for p in params}
        mine = [layer for layer in layers if any(id(p) in ids for p in layer.parameters())]
        for layer in mine:
            layer.unshard()
        try:
            yield
        finally:
            for layer in mine:
                layer.reshard()

    def autograd_params(self, params: list) -> list:
        """The tensors autograd differentiates for `params` in a forward run now: the
        parameters themselves, but at stage 3 FSDP's gathered copies of its sharded ones."""
        if not self.sharded_layers:
            return params
        from .fsdp import gathered_params

        gathered = gathered_params(self.sharded_layers)
        return [gathered.get(id(p), p) for p in params]

    # ---- the step -----------------------------------------------------------
    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping (None without clipping, or
        after a skipped step). Kept on the device: reading it is the host sync."""
        return None if self._grad_norm is None else self._grad_norm.item()

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """Reduce, unscale, check overflow, clip, update the master weights, share them.

        Host syncs: none, except with a loss scaler, which reads one flag (did any rank
        overflow?) to decide whether to step at all, as torch.amp.GradScaler does: the
        wrapped optimizer, its host-side step counts and an LR schedule need that
        decision on the host (fused AdamW reads it too, but only once every update is
        queued: `_fused_step`). Where a parameter got no gradient on this rank, one more
        read (of which parameters got one anywhere; see `_touched_anywhere`)."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure")
        self._reduce()
        self._arm(p for b in self.buckets for p in b.params)  # a gradient before zero_grad is refused by its hook
        grads, unscales = [], []
        for b in self.buckets:
            g = self._owned_grad(b)
            g = g if g.dtype == self.master_dtype else g.to(self.master_dtype)
            unscales.append(1.0 / (b.dp_size * _size(b.ep_group) * self.loss_scale))  # experts: over ep tokens too
            if not self.fused:
                g.mul_(unscales[-1])
            b.master.grad = g
            grads.append(g)
        self._grad_norm = None
        if self.fused:
            self._fused_step(grads, unscales)
            return None
        self.last_step_skipped = self._overflow(grads)
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.last_step_skipped)
        if self.last_step_skipped:
            for b in self.buckets:
                b.master.grad = None
            return None
        if self.clip_grad_norm is not None:
            self._clip(grads, self.clip_grad_norm)
        if self.inner is not None:
            self._inner_step(grads)
        self._finish_step()
        return None

    def _inner_step(self, grads: list[torch.Tensor], **fused: Any) -> None:
        """The wrapped optimizer's step over the pieces of the master shards (`fused`:
        FusedAdamW.step's found_inf and grad_scales)."""
        assert self.inner is not None
        touched = self._touched_anywhere()
        for b, g, inner_group in zip(self.buckets, grads, self.inner.param_groups):  # g is b.master.grad
            inner_group.update(self._hyper(b.group_index))
            for piece, (a, e, p) in zip(inner_group["params"], b.pieces):
                piece.grad = g[a:e] if id(p) in touched else None  # skipped, as in one process
        self.inner.step(**fused)
        for inner_group in self.inner.param_groups:
            for piece in inner_group["params"]:
                piece.grad = None

    def _finish_step(self) -> None:
        self._share_params()
        for b in self.buckets:  # a converted (bf16 -> fp32) gradient copy is not kept between steps
            b.master.grad = None

    def _fused_step(self, grads: list[torch.Tensor], unscales: list[float]) -> None:
        """`step` with FusedAdamW, in two passes over the gradients (pipekit/kernels/adamw.py
        says why): pass 1 checks for an overflow (with a loss scaler) and, when clipping,
        unscales in place (the norm needs the unscaled values); the flag is all-reduced and
        the clipping coefficient made, both on the device; pass 2, the update, multiplies
        each gradient by what is left of its scale (1 / (N * loss scale), or the clipping
        coefficient) as it loads it and writes nothing where the flag is set. The one host
        read of the flag (loss scaler, `last_step_skipped`) comes after every update is queued."""
        found_inf = None
        if self.loss_scaler is not None:
            found_inf = torch.zeros((), dtype=torch.float32, device=self._state_device())
        clip = self.clip_grad_norm is not None
        if clip or found_inf is not None:
            for g, unscale in zip(grads, unscales):
                unscale_and_check_(g, unscale, found_inf, in_place=clip)
        if found_inf is not None and dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        scales: list[float | torch.Tensor] = list(unscales)
        if self.clip_grad_norm is not None:
            scales = [self._clip_coef(self.clip_grad_norm)] * len(grads)
        if self.inner is not None:
            self._inner_step(grads, found_inf=found_inf, grad_scales=scales)
        self.last_step_skipped = found_inf is not None and bool(found_inf.item())
        if self.loss_scaler is not None:
            self.loss_scaler.update(self.last_step_skipped)
        if self.last_step_skipped:
            self._grad_norm = None
            for b in self.buckets:
                b.master.grad = None
            return
        self._finish_step()

    def _clip(self, grads: list[torch.Tensor], max_norm: float) -> None:
        """Scale the gradients so that their global norm is at most `max_norm`, on the
        device (multiplied by 1 when within it, as torch's clip_grad_norm_ does)."""
        coef = self._clip_coef(max_norm)
        for g in grads:
            g.mul_(coef)

    def _clip_coef(self, max_norm: float) -> torch.Tensor:
        """min(1, max_norm / (norm + 1e-6)) of the global gradient norm, on the device; the
        norm is kept for `last_grad_norm`."""
        norm = self._grad_norm = self._norm()
        return torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0)

    def _touched_anywhere(self) -> set[int]:
        """Ids of the parameters that got a gradient this step on some rank of their dp group
        (one all-reduce per dp group, read on the host only by a rank where some parameter
        got no gradient; the others know the answer). The others are skipped by the wrapped optimizer, as
        torch's optimizers skip a parameter whose .grad is None: an expert that received no
        tokens anywhere keeps its weights, moments and step count, as in one process. Tied
        layers shared by pipeline ranks count as touched; an expert-parallel grouped weight
        counts as touched when any ep rank's share of it is (as the whole tensor is at ep=1)."""
        touched = set(self._touched)
        tie_groups = getattr(self.module, "tie_groups", {})
        by_group: dict[Any, list[nn.Parameter]] = {}
        for b in self.buckets:
            if isinstance(b.segment, str) and b.segment in tie_groups:
                touched.update(id(p) for p in b.params)
            elif b.dp_group is not None or b.ep_group is not None or b.shard_group is not None:
                by_group.setdefault((b.dp_group or b.shard_group, b.ep_group, b.replica_group), []).extend(b.params)
        for groups, params in by_group.items():
            here = [id(p) in touched for p in params]
            flags = (torch.ones(len(params), dtype=torch.uint8, device=self._state_device()) if all(here) else
                     torch.tensor(here, dtype=torch.uint8, device=self._state_device()))
            for group in groups:  # experts: a grouped weight is touched when any rank's share of it is
                if group is not None:
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            if not all(here):  # the one read, where a parameter got no gradient on this rank
                touched.update(id(p) for p, f in zip(params, flags.tolist()) if f)
        return touched

    def _state_device(self) -> torch.device:
        return self.buckets[0].param_buf.device if self.buckets else _device(self.module)

    def _overflow(self, grads: list[torch.Tensor]) -> bool:
        """True when any rank of the job holds an inf/NaN gradient (checked only with a loss scaler)."""
        if self.loss_scaler is None:
            return False
        device = self.buckets[0].param_buf.device if self.buckets else _device(self.module)
        bad = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bool(bad.item())

    def grad_norm(self) -> float:
        """Global L2 norm of the unscaled, reduced gradients (during `step`), read on the
        host; see `_norm`."""
        return self._norm().item()

    def _norm(self) -> torch.Tensor:
        """Global L2 norm of the unscaled, reduced gradients, a 0-dim float64 tensor on the
        device: each parameter once over dp, pp and tp (tp-replicated ones on tp rank 0,
        tied ones on their first owner). One all-reduce per distinct dp group (stages 1,
        2), then one over pp and one over tp."""
        device = self.buckets[0].param_buf.device if self.buckets else _device(self.module)
        by_group: dict[Any, torch.Tensor] = {}
        for b in self.buckets:
            key = (b.dp_group if self._layout > 0 else b.shard_group, b.ep_group)
            part = by_group.setdefault(key, torch.zeros((), dtype=torch.float64, device=device))
            g = b.master.grad
            assert g is not None  # set by `step` before the norm
            first = 0 if self._layout == 0 else b.shard.start  # where this rank's gradient starts in the bucket
            for start, end in b.counted_ranges:
                lo, hi = max(start, first), min(end, first + g.numel())
                if lo < hi:
                    part += g[lo - first:hi - first].double().pow(2).sum()
        total = torch.zeros((), dtype=torch.float64, device=device)
        for groups, part in by_group.items():
            for group in groups:  # its dp shards, then (experts) the other ranks' experts
                if group is not None:
                    dist.all_reduce(part, group=group)
            total += part
        topo = getattr(self.module, "topology", None)
        for group in (getattr(topo, "pp_group", None), getattr(topo, "tp_group", None)):
            if group is not None:
                dist.all_reduce(total, group=group)
        return total.sqrt()

    def _share_params(self) -> None:
        """Write the updated master weights into the model's parameters; at stages 1, 2
        all-gather them: a big bucket straight into its buffer, the owned shards of small
        ones packed into one message of up to a bucket's size (on gloo the number of
        collectives, not their size, dominates)."""
        packs: dict[Any, list[list[Bucket]]] = {}
        for b in self.buckets:
            owned = b.param_buf if self._layout == 0 else b.param_buf[b.shard]
            if owned.data_ptr() != b.master.data_ptr():
                owned.copy_(b.master)
            if self._layout > 0 and b.dp_group is not None:
                runs = packs.setdefault(b.dp_group, [[]])
                if b.param_buf.numel() >= self.bucket_numel // 4:  # big enough to travel alone, unpacked
                    runs.append([b])
                    continue
                if sum(x.param_buf.numel() for x in runs[0]) + b.param_buf.numel() > self.bucket_numel:
                    runs.insert(0, [])
                runs[0].append(b)
        pending: list[tuple[list, torch.Tensor | None, list[Bucket]]] = []  # (works, packed message, buckets)
        for group, runs in packs.items():
            for run in (r for r in runs if r):
                n = run[0].dp_size
                if len(run) == 1:
                    pending.append((_all_gather(run[0].param_buf, n, group), None, run))
                    continue
                packed = torch.empty(n * sum(b.param_buf.numel() // n for b in run), dtype=run[0].param_buf.dtype,
                                     device=run[0].param_buf.device)
                mine = packed.view(n, -1)[dist.get_rank(group)]
                torch.cat([b.param_buf[b.shard] for b in run], out=mine)
                pending.append((_all_gather(packed, n, group), packed, run))
        for works, message, run in pending:
            for w in works:
                w.wait()
            if message is None:
                continue
            rows, offset = message.view(run[0].dp_size, -1), 0
            for b in run:
                size = b.param_buf.numel() // b.dp_size
                b.param_buf.view(b.dp_size, size).copy_(rows[:, offset:offset + size])
                offset += size

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the step's gradients. At stages 0 and 1, when gradients are kept in the
        parameters' own dtype, each `p.grad` becomes a view of its bucket, so autograd
        accumulates into the bucket in place (no copy in the hook)."""
        self._touched.clear()
        self._arm(p for b in self.buckets for p in b.params)
        for b in self.buckets:
            buf = b.grad_buf if self._layout < 2 else None  # stage 2: freed when reduced; starts anew
            if buf is not None:
                buf.zero_()
            for p in b.params:
                in_place = buf is not None and buf.dtype == p.dtype and b.shard_group is None
                p.grad = b.view_of(buf, p) if buf is not None and in_place else None
            b.launched = False
            if b.grad_shard is not None:
                b.grad_shard.zero_()
            b.master.grad = None

    # ---- introspection ------------------------------------------------------
    def full_grad(self, p: nn.Parameter) -> torch.Tensor:
        """The accumulated (not yet reduced) gradient of `p` (stages 0, 1)."""
        b = self._bucket_of[id(p)]
        if b.grad_buf is None:
            raise RuntimeError("stage 2 keeps no full gradient after its bucket is reduced")
        return b.view_of(b.grad_buf, p)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients, master weights and optimizer state.
        Stage 2's gradients include the largest set of buckets in flight seen so far."""
        def nbytes(t):
            return t.numel() * t.element_size() if t is not None else 0

        params = sum(nbytes(b.param_buf) for b in self.buckets)
        grads = sum(nbytes(b.grad_buf) if self._layout < 2 else nbytes(b.grad_shard) for b in self.buckets)
        if self._layout == 2:
            grads += self.peak_inflight_bytes
        master = sum(nbytes(b.master) for b in self.buckets if not _is_view_of(b.master, b.param_buf))
        state = 0
        if self.inner is not None:
            for s in self.inner.state.values():
                state += sum(nbytes(v) for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1)
        return {"params": params, "grads": grads, "master": master, "optimizer_state": state}

    # ---- layout-free state ------------------------------------------------------
    @torch.no_grad()
    def param_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """The optimizer state by parameter, independent of stage, dp size and bucketing:
        {param: {"exp_avg": ..., "exp_avg_sq": ..., "step": ..., "master": ...}}.

        Per-element entries of the wrapped optimizer's state have the parameter's shape
        (this rank's tp shard), in their own dtype; scalar entries ("step") are 0-dim;
        "master" (the fp32 master weights) is there when it is a separate copy
        (half-precision models). A parameter the wrapped optimizer never stepped has only
        "master". Collective over each bucket's dp group at stages 1 and 2: the shards are
        all-gathered (a transient full copy of one bucket's state at a time)."""
        per_param: dict[nn.Parameter, dict[str, torch.Tensor]] = {p: {} for b in self.buckets for p in b.params}
        kinds = self._state_kinds()
        inner = self.inner
        for bi, b in enumerate(self.buckets):
            pieces, state = (inner.param_groups[bi]["params"], inner.state) if inner is not None else ([], {})
            if b.shard_group is not None:
                per_param[b.params[0]] = self._shard_state(b, kinds, pieces, state)
                continue
            if not _is_view_of(b.master, b.param_buf):
                full = self._gathered(b, b.master)
                for p in b.params:
                    start, n = b.offsets[id(p)]
                    per_param[p]["master"] = full[start:start + n].view_as(p).clone()
            for key, (scalar, dtype) in kinds.items():
                flat, has = _entry_of(b, key, scalar, dtype, pieces, state)
                full, present = self._gathered(b, flat), self._gathered(b, has)
                for p in b.params:
                    start, n = b.offsets[id(p)]
                    if present[start:start + n].all():
                        part = full[start:start + n]
                        per_param[p][key] = part[0].clone() if scalar else part.view_as(p).clone()
        return per_param

    def _shard_state(self, b: Bucket, kinds: dict, pieces: list, state: dict) -> dict[str, torch.Tensor]:
        """Stage 3: `param_state`'s entries of a sharded parameter, gathered over its dp group
        (FSDP's dim-0 shards), shaped as the whole parameter (this rank's tp shard of it)."""
        p, out = b.params[0], {}
        if not _is_view_of(b.master, b.param_buf):
            out["master"] = gather_rows(b.master, p.shape, b.shard_group).clone()
        for key, (scalar, dtype) in kinds.items():
            flat, has = _entry_of(b, key, scalar, dtype, pieces, state)
            full, present = gather_rows(flat, p.shape, b.shard_group), gather_rows(has, p.shape, b.shard_group)
            if present.numel() and present.all():
                out[key] = full.reshape(-1)[0].clone() if scalar else full.clone()
        return out

    def _load_shard_state(self, b: Bucket, given: dict[str, torch.Tensor], pieces: list, state: dict) -> None:
        """Stage 3: this rank's rows of a sharded parameter's entries (`load_param_state`)."""
        p = b.params[0]
        for key, value in given.items():
            scalar = value.dim() == 0 and p.dim() > 0
            mine = value.to(b.master.device) if scalar else own_rows(value.to(b.master.device), b.shard_group)
            if key == "master":
                if not _is_view_of(b.master, b.param_buf):
                    b.master.copy_(mine.reshape(-1))
                continue
            flat = mine if scalar else mine.reshape(-1)
            for piece, (a, e, _) in zip(pieces, b.pieces):
                state[piece][key] = flat.clone() if scalar else flat[a:e].view_as(piece).clone()
        if "master" not in given and not _is_view_of(b.master, b.param_buf):
            b.master.copy_(b.param_buf)

    def _state_kinds(self) -> dict[str, tuple[bool, torch.dtype]]:
        """{key: (scalar, dtype)} of the wrapped optimizer's state entries held anywhere in
        each dp group (agreed over the groups, since a rank whose pieces were never stepped
        holds none)."""
        kinds: dict[str, tuple[bool, torch.dtype]] = {}
        if self.inner is not None:
            for piece, state in self.inner.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        kinds.setdefault(key, (value.shape != piece.shape, value.dtype))
        groups = {b.dp_group for b in self.buckets if b.dp_group is not None and self._layout > 0}
        groups |= {b.shard_group for b in self.buckets if b.shard_group is not None}
        for group in groups:
            everyone: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, kinds, group=group)
            for other in everyone:
                for key, kind in other.items():
                    kinds.setdefault(key, kind)
        return dict(sorted(kinds.items()))

    def _gathered(self, b: Bucket, owned: torch.Tensor) -> torch.Tensor:
        """A bucket-sized tensor from every dp rank's `owned` shard (itself at stage 0 or dp=1)."""
        if self._layout == 0 or b.dp_size == 1:
            return owned
        full = torch.zeros(b.param_buf.numel(), dtype=owned.dtype, device=owned.device)
        full[b.shard].copy_(owned)
        for w in _all_gather(full, b.dp_size, b.dp_group):
            w.wait()
        return full

    @torch.no_grad()
    def load_param_state(self, per_param: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Load state in `param_state`'s form into any stage, dp size and bucketing (no
        communication: every rank is given the state of all its parameters). Call after
        the model's weights are loaded: master copies missing from `per_param` are taken
        from the parameters; a parameter without optimizer entries starts fresh."""
        inner = self.inner
        for bi, b in enumerate(self.buckets):
            pieces, state = (inner.param_groups[bi]["params"], inner.state) if inner is not None else ([], {})
            if b.shard_group is not None:
                self._load_shard_state(b, per_param.get(b.params[0], {}), pieces, state)
                continue
            separate = not _is_view_of(b.master, b.param_buf)
            owned = b.param_buf if self._layout == 0 else b.param_buf[b.shard]
            keys = sorted(set().union(*(per_param.get(p, {}).keys() for p in b.params)))
            for key in keys:
                example = next(per_param[p][key] for p in b.params if key in per_param.get(p, {}))
                full = torch.zeros(b.param_buf.numel(), dtype=example.dtype, device=b.param_buf.device)
                for p in b.params:
                    if key in per_param.get(p, {}):
                        start, n = b.offsets[id(p)]
                        value = per_param[p][key].to(full.device)
                        full[start:start + n] = value.reshape(-1) if value.numel() == n else value
                mine = full if self._layout == 0 else full[b.shard]
                if key == "master":
                    if separate:
                        b.master.copy_(mine)
                    continue
                for piece, (a, e, p) in zip(pieces, b.pieces):
                    given = per_param.get(p, {}).get(key)
                    if given is not None:
                        scalar = given.dim() == 0 and p.dim() > 0
                        state[piece][key] = mine[a].clone() if scalar else mine[a:e].view_as(piece).clone()
            if separate and "master" not in keys:
                b.master.copy_(owned)

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict() if self.inner else None,
                "masters": [b.master.clone() for b in self.buckets],
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
                "param_groups": [self._hyper(i) for i in range(len(self.param_groups))]}

    def load_state_dict(self, state: dict) -> None:
        """Load a state saved by the same layout (layout-free checkpoints are their own issue)."""
        if self.inner is not None:
            self.inner.load_state_dict(state["inner"])
        for b, m in zip(self.buckets, state["masters"]):
            b.master.copy_(m)
        self._share_params()
        if self.loss_scaler is not None and state.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        for g, h in zip(self.param_groups, state["param_groups"]):
            g.update(h)


# ---- helpers -----------------------------------------------------------------
def _entry_of(b: Bucket, key: str, scalar: bool, dtype: torch.dtype, pieces: list,
              state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of bucket `b` of the wrapped optimizer's entry `key`, flat as its master
    (a scalar entry, a step count, spread over its piece), and where it holds one (1) or none."""
    flat = torch.zeros(b.master.numel(), dtype=dtype, device=b.master.device)
    has = torch.zeros(b.master.numel(), dtype=torch.uint8, device=b.master.device)
    for piece, (a, e, _) in zip(pieces, b.pieces):
        value = state.get(piece, {}).get(key)
        if value is not None:
            flat[a:e] = value if scalar else value.reshape(-1)
            has[a:e] = 1
    return flat, has


def _sharded(p: torch.Tensor) -> bool:
    from .fsdp import sharded

    return sharded(p)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP's shard), a view of its storage."""
    return t.to_local()  # type: ignore[attr-defined]  # a DTensor


def fused_by_default(optimizer_class: type, master_dtype: torch.dtype, device_type: str) -> bool:
    """`fused="auto"`'s answer: FusedAdamW for AdamW over float32 master shards on CUDA (elsewhere
    its reference side would run, no faster than torch's AdamW)."""
    return optimizer_class is torch.optim.AdamW and master_dtype == torch.float32 and device_type == "cuda"


def _check_hyper(group: dict, index: int) -> None:
    """The checks torch's optimizers make on their constructor's arguments, made on every
    param group (the wrapped optimizer is built over pieces, with the groups' values)."""
    where = f" (param group {index})" if index else ""
    lr = group.get("lr")
    if lr is not None and not (isinstance(lr, (int, float, torch.Tensor)) and 0 <= float(lr) < math.inf):
        raise ValueError(f"lr={lr!r}{where} must be a finite number >= 0")
    for key in ("eps", "weight_decay", "momentum"):
        value = group.get(key)
        if value is not None and not (isinstance(value, (int, float)) and 0 <= value < math.inf):
            raise ValueError(f"{key}={value!r}{where} must be a finite number >= 0")
    betas = group.get("betas")
    if betas is not None and not all(0 <= float(b) < 1 for b in betas):
        raise ValueError(f"betas={tuple(betas)!r}{where} must each be in [0, 1)")


def _param_groups(params) -> list[dict]:
    """Param groups (at least one, possibly empty: a stage may have no parameters)."""
    if isinstance(params, nn.Module):
        return [{"params": [p for p in params.parameters() if p.requires_grad]}]
    params = list(params)
    if params and isinstance(params[0], dict):
        return [{**g, "params": list(g["params"])} for g in params]
    return [{"params": params}]


def _widest(params: list[torch.Tensor]) -> torch.dtype:
    """float32, or the parameters' own float dtype when it is wider (float64)."""
    dtype = torch.float32
    for p in params:
        dtype = torch.promote_types(dtype, p.dtype)
    return dtype


def _chunks(params: list[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    """Consecutive runs of parameters of at most `limit` elements (a bigger one alone)."""
    out: list[list[nn.Parameter]] = []
    run: list[nn.Parameter] = []
    size = 0
    for p in params:
        if run and size + p.numel() > limit:
            out.append(run)
            run, size = [], 0
        run.append(p)
        size += p.numel()
    if run:
        out.append(run)
    return out


def _segments(module) -> tuple[Callable, Callable, Callable]:
    """segment_of(p), counted(p) and first_use(p) for a PipelineModule (else one
    segment, all counted, module order).

    Segments: the virtual stage holding a layer, or the tied key (a string) for
    a tied layer held by several pipeline ranks, whose buckets must match on
    every rank holding it; a tied layer held by this rank alone joins its
    lowest local stage (the last to finish backward).
    Counted: `PipelineModule.counted_in_norm`.
    First use: the lowest layer index using the parameter here; a gradient is
    complete once backward has passed it, so buckets are launched in
    decreasing first use."""
    if module is None or not hasattr(module, "stage_layers"):
        order = {id(p): i for i, p in enumerate(module.parameters())} if module is not None else {}
        return (lambda p: 0), (lambda p: True), (lambda p: order.get(id(p), 0))
    segment: dict[int, int | str] = {}  # id(p) -> virtual stage or tied key
    first_use: dict[int, int] = {}  # id(p) -> layer index
    tied_at: dict[str, tuple[int, int]] = {}  # tied key -> (stage, layer index) of its first use here
    for stage in module.local_stages:
        for i in module.stage_layers(stage):
            spec = module.specs[i]
            if isinstance(spec, TiedLayerSpec):
                tied_at.setdefault(spec.key, (stage, i))
            elif str(i) in module.layers:
                for p in module.layers[str(i)].parameters():
                    segment[id(p)], first_use[id(p)] = stage, i
    for key, layer in module.tied.items():
        shared = key in getattr(module, "tie_groups", {})  # summed over pipeline ranks: the same buckets there
        stage, index = tied_at.get(key, (key, 0))
        for p in layer.parameters():
            segment[id(p)], first_use[id(p)] = (key if shared else stage), index
    in_norm = module.counted_in_norm()
    counted = {id(p): in_norm[name] for name, p in module.named_parameters()}
    return ((lambda p: segment.get(id(p), "other")), (lambda p: counted.get(id(p), True)),
            (lambda p: first_use.get(id(p), 0)))


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def _reduce_scatter(buf: torch.Tensor, shard: slice, group):
    """Sum `buf` over `group` into this rank's `buf[shard]` (async). On gloo, whose
    reduce-scatter is emulated and measured slower than its all-reduce, an all-reduce
    (the whole bucket is summed; only the shard is read)."""
    if _is_gloo(group):
        return dist.all_reduce(buf, group=group, async_op=True)
    return dist.reduce_scatter_tensor(buf[shard], buf, group=group, async_op=True)


def _all_gather(buf: torch.Tensor, n: int, group) -> list:
    """Fill `buf` with every rank's shard (async works). On gloo, one broadcast per shard
    from its owner (measured faster there than all_gather_into_tensor)."""
    size = buf.numel() // n
    if _is_gloo(group):
        return [dist.broadcast(buf[r * size:(r + 1) * size], src=dist.get_global_rank(group, r), group=group,
                               async_op=True) for r in range(n)]
    me = dist.get_rank(group)
    return [dist.all_gather_into_tensor(buf, buf[me * size:(me + 1) * size].clone(), group=group, async_op=True)]


def _is_view_of(t: torch.Tensor, base: torch.Tensor) -> bool:
    start, end = base.data_ptr(), base.data_ptr() + base.numel() * base.element_size()
    return start <= t.data_ptr() < end


def _device(module) -> torch.device:
    topo = getattr(module, "topology", None)
    return topo.device if topo is not None else torch.device("cpu")
