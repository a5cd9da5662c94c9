"""Flat buckets: how a rank's trainable parameters are laid out for ZeRO.

The parameters are packed into flat *buckets*: one run of buckets per segment (a
virtual pipeline stage, or a tied key, which must lay out the same way on every
pipeline rank that holds it), param group and (dp group, ep group). A model parameter
becomes a view into its bucket's parameter buffer (model dtype). Each bucket is padded
to a multiple of its dp group's size N, and rank r owns the r-th of the N equal shards
of every bucket, as Megatron's distributed optimizer does (`Stage.owned`).

A bucket also records which of its ranges count in the gradient norm on this rank;
that is not part of the layout, since a tied weight counts on its first pipeline owner
only and a tp-replicated one on tp rank 0, while a tied segment's buckets must match
on every owner. And it records its *pieces*: the runs of its master part that the
wrapped optimizer steps as tensors of their own (never straddling two parameters, so
one without a gradient can be skipped alone; 64k elements for torch's optimizers, one
run per parameter part for the fused one).

Buckets are made in launch order: stages before shared tied keys, and within a run the
parameters whose gradients complete first. At stage 3 each FSDP shard is a bucket of
its own, aliasing FSDP's local tensor; where FSDP keeps that shard in host memory
(parameter offload: `Bucket.host`), the bucket's gradient buffer is made on the device for each
step only (`ZeroOptimizer`). Nothing here communicates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..spec import TiedLayerSpec
from ..topology import Topology
from .fsdp import host_shard, replica_group, shard_group, sharded
from .stage import Stage

PIECE = 1 << 16  # the wrapped optimizer sees a master shard as pieces of this many elements (cache-sized on a CPU)


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
    host: bool = False  # stage 3, parameter offload: FSDP keeps this shard (param_buf) in host memory
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


@dataclass(frozen=True)
class Layout:
    """What making buckets needs to know besides the parameters."""

    stage: Stage
    bucket_numel: int  # elements of gradient per bucket
    grad_dtype: torch.dtype
    master_dtype: torch.dtype
    fused: bool  # FusedAdamW: one piece per parameter part
    module: Any = None  # the PipelineModule (segments, tied keys), an nn.Module or None
    topology: Topology | None = None  # a PipelineModule's (expert groups); None for any other module
    default_dp_group: Any = None


def make_buckets(param_groups: list[dict], layout: Layout) -> list[Bucket]:
    """The buckets of `param_groups`' trainable parameters, in launch order (module docstring);
    each parameter's `.data` becomes a view of its bucket."""
    segment_of, counted, first_use = _segments(layout.module)
    buckets: list[Bucket] = []
    for gi, group in enumerate(param_groups):
        for (dp_group, ep_group), members in _reduction_groups(group, layout).items():
            runs: dict[tuple, list[nn.Parameter]] = {}
            for p in members:
                if sharded(p):  # stage 3: FSDP's shard, a bucket of its own over its local tensor
                    buckets.append(_shard_bucket(p, gi, counted, segment_of(p), layout))
                    buckets[-1].ep_group = ep_group
                    continue
                runs.setdefault(segment_of(p), []).append(p)
            # Launch order: stages before shared tied keys, and within a run the parameters whose
            # gradients complete first (backward visits layers last to first; a tied input
            # embedding, also the head, completes only at the end).
            order = sorted(runs.items(), key=lambda kv: (isinstance(kv[0], str), str(kv[0])))
            for segment, params in order:
                backward_order = sorted(reversed(params), key=first_use, reverse=True)  # stable: ties reversed
                for chunk in _chunks(backward_order, layout.bucket_numel):
                    buckets.append(_flat_bucket(chunk, gi, dp_group, counted, segment, layout))
                    buckets[-1].ep_group = ep_group
    return buckets


def _reduction_groups(group: dict, layout: Layout) -> dict[tuple, list[nn.Parameter]]:
    """{(dp group, ep group): trainable parameters} of a param group: its own "dp_group"
    and "ep_group" when it sets them; else the default dp group, and for experts
    sharded over ep > 1 ranks (`p.expert_parallel`) the topology's expert dp group and
    ep group, so a plain optimizer's param groups need no expert split of their own."""
    topo = layout.topology
    experts: tuple | None = None  # the expert groups, where this param group's experts go to them
    if topo is not None and "dp_group" not in group and topo.ep > 1:
        experts = (topo.edp_group, topo.ep_group)
    out: dict[tuple, list[nn.Parameter]] = {}
    for p in group["params"]:
        if not p.requires_grad:
            continue
        if experts is not None and getattr(p, "expert_parallel", False):
            key = experts
        else:
            key = (group.get("dp_group", layout.default_dp_group), group.get("ep_group"))
        out.setdefault(key, []).append(p)
    return out


def _flat_bucket(params, gi, dp_group, counted, segment, layout: Layout) -> Bucket:
    """A bucket over `params`, copied into its buffer and made views of it; its gradient
    buffer (stages 0, 1) or gradient shard (stage 2), its master part and its pieces."""
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
    if layout.stage.shards_grads:
        b.grad_shard = torch.zeros(size // b.dp_size, dtype=layout.grad_dtype, device=p0.device)
    else:
        b.grad_buf = torch.zeros(size, dtype=layout.grad_dtype, device=p0.device)
    owned = layout.stage.owned(b, b.param_buf)
    b.master = owned if owned.dtype == layout.master_dtype else owned.to(layout.master_dtype)
    b.pieces = _pieces(b, layout.stage.first(b), owned.numel(), layout.fused)
    return b


def _pieces(b: Bucket, first: int, n_owned: int, fused: bool) -> list:
    """(start, end, param) runs of the owned part [first, first + n_owned) of `b`, relative
    to it: pieces never straddle two parameters, so each can be skipped alone."""
    pieces = []
    for p in b.params:
        start, n = b.offsets[id(p)]
        lo, hi = max(start, first), min(start + n, first + n_owned)
        size = max(hi - lo, 1) if fused else PIECE  # fused: one run per bucket whatever the pieces
        pieces += [(a - first, min(a + size, hi) - first, p) for a in range(lo, hi, size)]
    return pieces


def _shard_bucket(p: nn.Parameter, gi: int, counted, segment, layout: Layout) -> Bucket:
    """Stage 3: a bucket over FSDP's local shard of `p`, aliased, not copied (FSDP gathers
    the layer from that storage), whose gradient FSDP has already reduced. A host-held shard's
    gradient buffer is left to the step (made on the device for it: `ZeroOptimizer`)."""
    b = Bucket([p], gi, None, segment, shard_group=shard_group(p), replica_group=replica_group(p),
               host=host_shard(p))
    local_part = local(p).detach()
    b.param_buf = local_part.view(-1)
    n = b.param_buf.numel()
    b.offsets[id(p)] = (0, n)
    if counted(p) and n:
        b.counted_ranges.append((0, n))
    b.grad_buf = None if b.host else torch.zeros(n, dtype=layout.grad_dtype, device=local_part.device)
    b.master = b.param_buf if b.param_buf.dtype == layout.master_dtype else b.param_buf.to(layout.master_dtype)
    size = max(n, 1) if layout.fused else PIECE
    b.pieces = [(a, min(a + size, n), p) for a in range(0, n, size)]
    return b


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


def widest(params: list[torch.Tensor]) -> torch.dtype:
    """float32, or the parameters' own float dtype when it is wider (float64)."""
    dtype = torch.float32
    for p in params:
        dtype = torch.promote_types(dtype, p.dtype)
    return dtype


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP's shard), a view of its storage."""
    return t.to_local()  # type: ignore[attr-defined]  # a DTensor


def is_view_of(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether `t` starts inside `base`'s storage (an fp32 model's master is its own parameters)."""
    start, end = base.data_ptr(), base.data_ptr() + base.numel() * base.element_size()
    return start <= t.data_ptr() < end


def state_device(buckets: list[Bucket], topology: Topology | None) -> torch.device:
    """Where this rank's optimizer state lives: its buckets' device, else the topology's."""
    return buckets[0].param_buf.device if buckets else topology_device(topology)


def topology_device(topology: Topology | None) -> torch.device:
    """A PipelineModule's device (its topology's); the CPU for a module without one."""
    return topology.device if topology is not None else torch.device("cpu")
