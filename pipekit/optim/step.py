"""The step after the reduction: unscale, norm and clip, the wrapped optimizer, the all-gather.

    unscale    each bucket's owned gradient, in the master dtype, times
               1 / (N * ep * loss scale) (N its dp size; experts: over their ep
               group's tokens too); fused AdamW folds this into its update instead
    norm       the global L2 norm, each parameter once over dp, pp and tp
               (tp-replicated ones on tp rank 0, tied ones on their first owner):
               one all-reduce per distinct (dp or shard group, ep group), then one
               over pp and one over tp; on the device, float64
    touched    which parameters got a gradient anywhere in their dp group (one
               small all-reduce per group; read on the host only where some
               parameter got none here): the others are skipped
    update     the wrapped optimizer steps the pieces of the master parts
    share      the master weights are written into the parameters, and where the
               stage shards them (1, 2) all-gathered: a big bucket into its own
               buffer, small ones packed into messages of up to a bucket

Every collective of the step runs on the communication device (`device`: the topology's),
whatever device the buckets' tensors are on: under parameter offload (`Bucket.host`) the
parameters and master weights are host tensors, while the gradients, the norm's partial sums and
the touched flags are on the device (a host tensor handed to NCCL would fail).

The check for non-finite values and the host's decision whether to step at all are the
façade's (`ZeroOptimizer.step`, over `pipekit.optim.finite.Marks`); fused AdamW's first
pass is `fused_first_pass`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..kernels.adamw import unscale_and_check_
from ..topology import Topology
from .buckets import Bucket, state_device
from .collectives import Collectives, size
from .finite import Marks
from .stage import Stage


class Updater:
    """The phases of the step over this rank's buckets (module docstring)."""

    def __init__(self, buckets: list[Bucket], stage: Stage, comm: Collectives, module: Any, *,
                 topology: Topology | None, master_dtype: torch.dtype, fused: bool, bucket_numel: int,
                 offloaded: bool = False):
        self.buckets, self.stage, self.comm, self.module = buckets, stage, comm, module
        self.topology = topology  # a PipelineModule's; None for a plain module (no pp or tp)
        self.master_dtype, self.fused, self.bucket_numel = master_dtype, fused, bucket_numel
        self.offloaded = offloaded  # masters on the host (offload.py): gradients stay on the device here
        self.current: list[torch.Tensor] = []  # this step's gradients, one per bucket (`grads`)

    def device(self) -> torch.device:
        """Where the step's collectives run: the topology's device (a PipelineModule's), else the
        buckets'; never the host because the parameters are offloaded there."""
        return self.topology.device if self.topology is not None else state_device(self.buckets, None)

    def grads(self, owned_grad: Callable[[Bucket], torch.Tensor], loss_scale: float,
              which: list[int] | None = None) -> tuple[list[torch.Tensor], list[float]]:
        """Each bucket's owned gradient in the master dtype, set as its master's `.grad` (not
        where the master is offloaded to the host: the gradient stays on the device until the
        step), unscaled (not when fused: the update does it), and the unscale factors.
        `which`: those buckets only, in that order (the caller then sets `current`)."""
        grads, unscales = [], []
        for b in (self.buckets if which is None else [self.buckets[bi] for bi in which]):
            g = owned_grad(b)
            g = g if g.dtype == self.master_dtype else g.to(self.master_dtype)
            unscales.append(1.0 / (b.dp_size * size(b.ep_group) * loss_scale))  # experts: over ep tokens too
            if not self.fused:
                g.mul_(unscales[-1])
            if not self.offloaded:
                b.master.grad = g
            grads.append(g)
        if which is None:
            self.current = grads
        return grads, unscales

    def drop_grads(self) -> None:
        """Forget the step's gradients; a host-held shard's device gradient buffer is freed
        (made again for the next step: `ZeroOptimizer._take_sharded_grads`)."""
        self.current = []
        for b in self.buckets:
            b.master.grad = None
            if b.host:
                b.grad_buf = None

    def norm(self) -> torch.Tensor:
        """Global L2 norm of the unscaled, reduced gradients, a 0-dim float64 tensor on the
        device (module docstring)."""
        device = self.device()
        by_group: dict[Any, torch.Tensor] = {}
        assert len(self.current) == len(self.buckets)  # set by `grads` before the norm
        for b, g in zip(self.buckets, self.current):
            key = (self.stage.split_over(b), b.ep_group)
            part = by_group.setdefault(key, torch.zeros((), dtype=torch.float64, device=device))
            first = self.stage.first(b)  # where this rank's gradient starts in the bucket
            for start, end in b.counted_ranges:
                lo, hi = max(start, first), min(end, first + g.numel())
                if lo < hi:
                    part += g[lo - first:hi - first].double().pow(2).sum().to(device)  # ZeRO-2 offload: host g
        total = torch.zeros((), dtype=torch.float64, device=device)
        for groups, part in by_group.items():
            for group in groups:  # its dp shards, then (experts) the other ranks' experts
                if group is not None:
                    dist.all_reduce(part, group=group)
            total += part
        topo = self.topology
        for group in (topo.pp_group, topo.tp_group) if topo is not None else ():
            if group is not None:
                dist.all_reduce(total, group=group)
        return total.sqrt()

    def touched_anywhere(self, touched_here: set[int]) -> set[int]:
        """Ids of the parameters that got a gradient this step on some rank of their dp group
        (one all-reduce per dp group, read on the host only by a rank where some parameter
        got no gradient; the others know the answer). The others are skipped by the wrapped optimizer, as
        torch's optimizers skip a parameter whose .grad is None: an expert that received no
        tokens anywhere keeps its weights, moments and step count, as in one process. Tied
        layers shared by pipeline ranks count as touched; an expert-parallel grouped weight
        counts as touched when any ep rank's share of it is (as the whole tensor is at ep=1)."""
        touched = set(touched_here)
        tie_groups = getattr(self.module, "tie_groups", {})
        by_group: dict[Any, list[nn.Parameter]] = {}
        for b in self.buckets:
            if isinstance(b.segment, str) and b.segment in tie_groups:
                touched.update(id(p) for p in b.params)
            elif b.dp_group is not None or b.ep_group is not None or b.shard_group is not None:
                by_group.setdefault((b.dp_group or b.shard_group, b.ep_group, b.replica_group), []).extend(b.params)
        for groups, params in by_group.items():
            here = [id(p) in touched for p in params]
            flags = (torch.ones(len(params), dtype=torch.uint8, device=self.device()) if all(here) else
                     torch.tensor(here, dtype=torch.uint8, device=self.device()))
            for group in groups:  # experts: a grouped weight is touched when any rank's share of it is
                if group is not None:
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
            if not all(here):  # the one read, where a parameter got no gradient on this rank
                touched.update(id(p) for p, f in zip(params, flags.tolist()) if f)
        return touched

    def inner_step(self, inner: torch.optim.Optimizer, grads: list[torch.Tensor], touched: set[int],
                   hyper: Callable[[int], dict], **fused: Any) -> None:
        """The wrapped optimizer's step over the pieces of the master parts, each group's
        hyperparameters taken from `hyper(group index)` first (an LR schedule sets them on
        the façade's param groups); pieces of untouched parameters are skipped (`fused`:
        FusedAdamW.step's found_inf and grad_scales)."""
        for b, g, inner_group in zip(self.buckets, grads, inner.param_groups):  # g is b.master.grad
            inner_group.update(hyper(b.group_index))
            for piece, (a, e, p) in zip(inner_group["params"], b.pieces):
                piece.grad = g[a:e] if id(p) in touched else None  # skipped, as in one process
        inner.step(**fused)
        for inner_group in inner.param_groups:
            for piece in inner_group["params"]:
                piece.grad = None

    # ---- share: master weights into the parameters --------------------------------
    def share_params(self, written: bool = False) -> None:
        """Write the updated master weights into the model's parameters (`written`: the
        offloaded step has done so, bucket by bucket); where the stage shards them, all-gather
        them: a big bucket straight into its buffer, the owned shards of small ones packed
        into one message of up to a bucket's size (on gloo the number of collectives, not
        their size, dominates)."""
        pending = [self._gather(group, run) for group, runs in self._write_masters(written).items()
                   for run in runs if run]
        for works, message, run in pending:
            for w in works:
                w.wait()
            if message is not None:
                _unpack(message, run)

    def _write_masters(self, written: bool) -> dict[Any, list[list[Bucket]]]:
        """Copy each master into its owned part of the parameters (where it is not that part
        itself, nor `written`); {dp group: runs of buckets to all-gather together}."""
        packs: dict[Any, list[list[Bucket]]] = {}
        for b in self.buckets:
            owned = self.stage.owned(b, b.param_buf)
            if not written and owned.data_ptr() != b.master.data_ptr():
                owned.copy_(b.master)
            if self.stage.shards_master and b.dp_group is not None:
                runs = packs.setdefault(b.dp_group, [[]])
                if b.param_buf.numel() >= self.bucket_numel // 4:  # big enough to travel alone, unpacked
                    runs.append([b])
                    continue
                if sum(x.param_buf.numel() for x in runs[0]) + b.param_buf.numel() > self.bucket_numel:
                    runs.insert(0, [])
                runs[0].append(b)
        return packs

    def _gather(self, group, run: list[Bucket]) -> tuple[list, torch.Tensor | None, list[Bucket]]:
        """Start all-gathering `run` over `group`: (works, packed message or None, run)."""
        n = run[0].dp_size
        if len(run) == 1:
            return self.comm.all_gather(run[0].param_buf, n, group), None, run
        packed = torch.empty(n * sum(b.param_buf.numel() // n for b in run), dtype=run[0].param_buf.dtype,
                             device=run[0].param_buf.device)
        mine = packed.view(n, -1)[dist.get_rank(group)]
        torch.cat([b.param_buf[b.shard] for b in run], out=mine)
        return self.comm.all_gather(packed, n, group), packed, run


def _unpack(message: torch.Tensor, run: list[Bucket]) -> None:
    """Every rank's shards of the buckets of `run` from the gathered `message`."""
    rows, offset = message.view(run[0].dp_size, -1), 0
    for b in run:
        n = b.param_buf.numel() // b.dp_size
        b.param_buf.view(b.dp_size, n).copy_(rows[:, offset:offset + n])
        offset += n


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)), on the device (1 when within it, as torch's
    clip_grad_norm_ does)."""
    return torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0)


def fused_first_pass(grads: list[torch.Tensor], unscales: list[float], marks: Marks, clip: bool) -> torch.Tensor:
    """Fused AdamW's pass 1 (pipekit/kernels/adamw.py): mark non-finite gradients (into
    `marks.grads`) and, when clipping, unscale in place (the norm needs the unscaled values);
    the marks are all-reduced over the world, on the device. Returns pass 2's `found_inf`:
    whether any mark is set, a 0-dim tensor on the device."""
    for g, unscale in zip(grads, unscales):
        unscale_and_check_(g, unscale, marks.grads, in_place=clip)
    marks.reduce()
    return marks.any()
