"""Gradients into buckets, and their reduction overlapped with backward.

    backward   a post-accumulate-grad hook adds each parameter's gradient into its
               bucket (in `grad_dtype`). Where the bucket's gradient buffer is in the
               parameters' dtype (stages 0/1), `p.grad` is a view of it and autograd
               accumulates in place: the hook, needed then only to note that the
               parameter got a gradient, runs once per step, not once per
               microbatch, except in the pass that reduces its bucket, where it
               counts arrivals. Buckets are reduced in a fixed order, each as soon as
               it and every bucket before it are complete, so the reduction overlaps
               the rest of backward: stages 0/1 during the last backward pass of the
               bucket's stage (all-reduce; reduce-scatter into the own shard), stage 2
               during every pass (every microbatch: the reduced shard is added into
               the rank's gradient shard and the bucket freed, at most
               `max_inflight` buckets in flight).
    step       what no backward pass launched is launched (a plain training loop),
               everything in flight is waited for, tied segments are summed over
               their pipeline owners and sequence-parallel parameters over tp, each
               on the part of the bucket this rank updates.

Stage 2 trades memory for traffic: microbatch m's gradients are reduced before
microbatch m+1's backward, M reductions per step where stages 0/1 do one. Every dp
rank must make the same sequence of `backward_pass` calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..layers.parallel import tp_partial
from ..topology import Topology
from .buckets import Bucket, local
from .collectives import Collectives
from .fsdp import sharded
from .stage import Stage

HOOK_FREE = True  # read "who got a gradient" at the step where no hook is needed; tests set False for the reference


class Reducer:
    """The gradient hooks and reductions over `buckets` (see the module docstring).

    `fsdp_reduces`: stage 3 with layers sharded by FSDP, whose parameters get no hook
    (FSDP reduces them; `take_sharded_grads` copies the result in). `hook`: what each
    armed parameter's post-accumulate-grad hook calls (default `on_grad`; the façade
    passes its own `_on_grad`, which calls `on_grad`, so a test can count the calls)."""

    def __init__(self, buckets: list[Bucket], stage: Stage, comm: Collectives, *, grad_dtype: torch.dtype,
                 max_inflight: int, module: Any, topology: Topology | None, fsdp_reduces: bool,
                 hook: Callable[[nn.Parameter], None] | None = None):
        self.buckets, self.stage, self.comm = buckets, stage, comm
        self.grad_dtype, self.max_inflight, self.module = grad_dtype, max_inflight, module
        self.topology = topology  # a PipelineModule's; None for a plain module (no tp)
        self.fsdp_reduces = fsdp_reduces
        self.hook = hook or self.on_grad
        self.bucket_of = {id(p): b for b in buckets for p in b.params}
        self.reduced_in_backward = [b for b in buckets if b.dp_group is not None]  # stages 0/1: by a backward pass
        self.peak_inflight_bytes = 0
        self.pending: list = []  # stage 2: (work, bucket) reductions in flight
        self.current: list[Bucket] | None = None  # stage 2: buckets of the backward pass running now
        self.dirty = False
        self.touched: set[int] = set()  # ids of parameters that got a gradient this step, here
        self.hooks: dict[int, Any] = {}  # id(p) -> its armed post-accumulate-grad hook's handle
        # no dp group, stages 0/1, autograd accumulating in place: nothing to launch during backward, so
        # no hook; `read_touched` tells who got a gradient from each own view's version counter
        self.free = {id(p): (b, p) for b in buckets for p in b.params if HOOK_FREE and self.needs_no_hook(b, p)}
        self.views: dict[int, tuple[torch.Tensor, int]] = {}  # id(p) -> (its p.grad view, version last seen)
        self.aliased: dict[int, torch.Tensor] = {}  # id(p) -> the gradient buffer its p.grad aliases
        self.read = False  # read_touched ran since the last zero_grad
        # ZeRO-2 with offload: the gradient shards are host memory (`Offload.add_grad` adds each reduced
        # shard in; `flush` before they are read); their collectives go through the device
        self.host_shards: Any = None

    def needs_no_hook(self, b: Bucket, p: nn.Parameter) -> bool:
        return (b.dp_group is None and not self.stage.shards_grads and b.shard_group is None
                and b.grad_buf is not None and b.grad_buf.dtype == p.dtype and not sharded(p))

    # ---- backward -----------------------------------------------------------
    def arm(self, params: Iterable[nn.Parameter]) -> None:
        """Register the gradient hook on those of `params` that have none armed."""
        for p in params:
            skip = id(p) in self.hooks or id(p) in self.free or (self.fsdp_reduces and sharded(p))  # stage 3: FSDP
            if not skip:
                self.hooks[id(p)] = p.register_post_accumulate_grad_hook(self.hook)

    def disarm(self) -> None:
        """Remove every hook for good: another optimizer trains these parameters now."""
        for handle in self.hooks.values():
            handle.remove()
        self.hooks.clear()
        self.arm = lambda params: None  # type: ignore[method-assign]

    def on_grad(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: move p.grad into its bucket (in grad_dtype) and free it.

        Where autograd accumulated in place (stages 0/1, `p.grad` a view of the bucket) and
        the bucket is not waiting for arrivals (it is not reduced during this pass), the
        hook has done all it must this step once it marked `p` touched: it removes
        itself, so a parameter costs one hook call per step, not one per microbatch.
        `zero_grad` re-arms it for the next step, and `backward_pass` for the pass that
        reduces its bucket (which counts arrivals)."""
        b = self.bucket_of[id(p)]
        start, n = b.offsets[id(p)]
        self.touched.add(id(p))
        if b.launched:  # a gradient after its bucket was reduced
            if not self.stage.shards_grads:
                raise RuntimeError(
                    f"a parameter of shape {tuple(p.shape)} got a gradient after its bucket was reduced: a backward "
                    "pass after the one marked final for it, or reentrant checkpointing firing its hook twice; "
                    "use non-reentrant checkpointing (PipelineModule's own), or ZeRO stage 2")
            self.drain()  # stage 2: reduce again at the end of the pass
            b.launched, b.arrived = False, 0
        if b.grad_buf is None:  # stage 2: a bucket starts filling
            b.grad_buf = torch.zeros_like(b.param_buf, dtype=self.grad_dtype)
            self.peak_inflight_bytes = max(self.peak_inflight_bytes, self.inflight_bytes())
        grad = p.grad
        assert grad is not None  # the hook runs once it is accumulated
        in_place = grad.data_ptr() == b.grad_buf[start:].data_ptr()
        if not in_place:
            b.grad_buf[start:start + n].add_(grad.reshape(-1))
            p.grad = None
        self.dirty = True
        if self.current is not None and b in self.current:
            b.arrived += 1
            self.launch_ready(self.current)
        elif in_place:
            self.hooks.pop(id(p)).remove()

    def backward_pass(self, params: Iterable[nn.Parameter], final: Iterable[nn.Parameter] = ()):
        """One backward pass producing gradients for `params`, `final` those complete after it
        (`ZeroOptimizer.backward_pass`): stage 2 reduces every bucket of `params`, stages 0
        and 1 the buckets made only of `final` parameters; those left incomplete are launched
        after the pass, in the same order. Stages 0/1 without a dp group have nothing to
        reduce during backward: their pass is an empty context."""
        if not self.stage.shards_grads and not self.reduced_in_backward:
            return contextlib.nullcontext()
        return self._backward_pass(params, final)

    @contextlib.contextmanager
    def _backward_pass(self, params: Iterable[nn.Parameter], final: Iterable[nn.Parameter]):
        reduces_every_pass = self.stage.shards_grads
        ids = {id(p) for p in (params if reduces_every_pass else final)}
        if reduces_every_pass:
            self.drain()  # the previous pass's reductions overlapped the actions since; finish them
            current = [b for b in self.buckets if any(id(p) in ids for p in b.params)]
        else:  # a bucket with no dp group has nothing to reduce: it needs no arrivals counted
            current = [b for b in self.buckets
                       if b.dp_group is not None and not b.launched and all(id(p) in ids for p in b.params)]
        self.arm(p for b in current for p in b.params)
        self.current = current
        for b in current:
            b.arrived, b.launched = 0, False
        try:
            yield
            for b in current:
                if not b.launched:
                    self.launch(b)
        finally:
            self.current = None
            self.dirty = not reduces_every_pass and self.dirty

    def launch_ready(self, current: list[Bucket]) -> None:
        for b in current:
            if b.launched:
                continue
            if b.arrived < len(b.params):
                return
            self.launch(b)

    def launch(self, b: Bucket) -> None:
        """Start reducing bucket `b` over its dp group: all-reduce (a replicated stage) or
        reduce-scatter into its own shard (stages 1, 2). Stage 2 keeps at most
        `max_inflight` buckets in flight, finishing the oldest first."""
        if b.grad_buf is None:
            b.grad_buf = torch.zeros_like(b.param_buf, dtype=self.grad_dtype)
        work = None
        if b.dp_group is not None:
            if self.stage.shards_master:
                work = self.comm.reduce_scatter(b.grad_buf, b.shard, b.dp_group)
            else:
                work = dist.all_reduce(b.grad_buf, group=b.dp_group, async_op=True)
        self.pending.append((work, b))
        b.launched = True
        while self.stage.shards_grads and len(self.pending) > self.max_inflight:
            self.finish(*self.pending.pop(0))

    def finish(self, work, b: Bucket) -> None:
        if work is not None:
            work.wait()
        if self.stage.shards_grads:  # add the reduced shard into this rank's gradient shard; free the bucket
            assert b.grad_shard is not None and b.grad_buf is not None  # stage 2: a launched bucket
            if self.host_shards is not None:
                self.host_shards.add_grad(b, b.grad_buf[b.shard])  # offload: into the host shard
            else:
                b.grad_shard.add_(b.grad_buf[b.shard])
            b.grad_buf = None

    def drain(self) -> None:
        """Wait for every reduction in flight."""
        for work, b in self.pending:
            self.finish(work, b)
        self.pending.clear()

    def inflight_bytes(self) -> int:
        return sum(b.grad_buf.numel() * b.grad_buf.element_size() for b in self.buckets if b.grad_buf is not None)

    # ---- the step's reduction -------------------------------------------------
    def reduce(self, sums: bool = True) -> None:
        """Finish reducing the step's gradients over each bucket's dp group (launching what
        no backward pass launched: a plain training loop); sum tied segments over pp, and
        sequence-parallel parameters over tp (`sums` False: not those two; `sum_ties`,
        `sum_tp_partial`)."""
        self.read_touched()
        if not self.stage.shards_grads or self.dirty:
            for b in self.buckets:
                if self.stage.shards_grads or not b.launched:
                    self.launch(b)
            self.dirty = False
        self.drain()
        if self.host_shards is not None:
            self.host_shards.flush()
        if sums:
            self.sum_ties()
            self.sum_tp_partial()

    def tied(self) -> list[int]:
        """The buckets of tied segments (summed over pp by `sum_ties`)."""
        tie_groups = getattr(self.module, "tie_groups", {})
        return [bi for bi, b in enumerate(self.buckets) if isinstance(b.segment, str) and b.segment in tie_groups]

    def sum_ties(self) -> None:
        """Sum each tied segment's buckets over the pp ranks holding it."""
        tie_groups = getattr(self.module, "tie_groups", {})
        for bi in self.tied():
            b = self.buckets[bi]
            self.all_reduce(self.owned_grad(b), tie_groups[b.segment])

    def tp_partial_in(self, buckets: list[int]) -> bool:
        """Whether any of `buckets` holds a parameter `sum_tp_partial` sums (tp > 1)."""
        if self.topology is None or self.topology.tp_group is None:
            return False
        return any(tp_partial(p) for bi in buckets for p in self.buckets[bi].params)

    def all_reduce(self, t: torch.Tensor, group) -> None:
        """Sum `t` over `group`; a host gradient shard (offload) through a copy on the topology's
        device (NCCL takes no host tensor)."""
        if self.host_shards is None:
            dist.all_reduce(t, group=group)
            return
        assert self.topology is not None  # tied segments and tp are a PipelineModule's
        on_device = t.to(self.topology.device, copy=True)
        dist.all_reduce(on_device, group=group)
        t.copy_(on_device)

    def read_touched(self) -> None:
        """The hook-free parameters (`free`) that got a gradient this step: those whose own
        view's version moved (autograd accumulated in place); a `p.grad` autograd replaced
        (no zero_grad before, or accumulated out of place) is taken into the bucket, as the
        hook would. A gradient after the last step with no zero_grad between is refused."""
        for pid, (b, p) in self.free.items():
            seen, g = self.views.get(pid), p.grad
            if seen is not None and g is seen[0]:
                if g._version == seen[1]:
                    continue
                if self.read:
                    raise RuntimeError(
                        f"a parameter of shape {tuple(p.shape)} got a gradient after its bucket was reduced: "
                        "a backward after step() with no zero_grad() between")
                self.views[pid] = (g, g._version)
            elif g is not None:
                start, n = b.offsets[pid]
                assert b.grad_buf is not None  # kept whole at stages 0/1 (`needs_no_hook`)
                target = b.grad_buf[start:start + n]
                target.copy_(g.reshape(-1)) if seen is not None else target.add_(g.reshape(-1))
                p.grad = None
            else:
                continue
            self.touched.add(pid)
            self.dirty = True
        self.read = True

    def sum_tp_partial(self) -> None:
        """Sum over the tp group the gradients of the parameters whole on every tp rank whose
        backward gives each rank only its part (`pipekit.layers.parallel.tp_partial`): under
        sequence parallelism the norms, row-parallel biases and GPT-2's position table (each
        rank's copy fed by its sequence slice only), and the LoRA factor beside a split one,
        in the part of each bucket this rank updates, as one all-reduce. Every tp rank has
        the same buckets (the same parameters, tp shards of the same shapes), so the pieces
        line up; nothing is sent when no parameter is marked."""
        group = self.topology.tp_group if self.topology is not None else None
        if group is None:
            return
        pieces = []
        for b in self.buckets:
            owned = self.owned_grad(b)
            start = self.stage.first(b)
            for p in b.params:
                if not tp_partial(p):
                    continue
                offset, n = b.offsets[id(p)]
                lo, hi = max(offset, start), min(offset + n, start + owned.numel())
                if lo < hi:
                    pieces.append(owned[lo - start:hi - start])
        if not pieces:
            return
        flat = torch.cat(pieces)
        self.all_reduce(flat, group)
        torch._foreach_copy_(pieces, list(flat.split([t.numel() for t in pieces])))

    def take_sharded_grads(self, touched: set[int]) -> None:
        """Stage 3, after FSDP reduced its layers' gradients (`touched`: the ids of its
        parameters that got one here): each shard's bucket takes its parameter's local
        gradient (zeros where none)."""
        self.touched |= touched
        for b in self.buckets:
            if b.shard_group is None:
                continue
            p = b.params[0]
            assert b.grad_buf is not None  # made with the bucket, never freed
            if p.grad is None:
                b.grad_buf.zero_()
            else:
                b.grad_buf.copy_(local(p.grad).reshape(-1))
                p.grad = None

    def owned_grad(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced gradient for the part of `b` it updates."""
        if self.stage.shards_grads:
            assert b.grad_shard is not None  # made with the bucket at stage 2
            return b.grad_shard
        assert b.grad_buf is not None  # made with the bucket at stages 0, 1, never freed
        return self.stage.owned(b, b.grad_buf)

    # ---- between steps ----------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the step's gradients; where the gradient buffer is kept whole in the
        parameters' own dtype (stages 0, 1), each `p.grad` becomes a view of it."""
        self.touched.clear()
        self.read = False
        if self.host_shards is not None:
            self.host_shards.flush()  # nothing staged lands in a shard after it is zeroed
        self.arm(p for b in self.buckets for p in b.params)
        for b in self.buckets:
            buf = None if self.stage.shards_grads else b.grad_buf  # stage 2: freed when reduced; starts anew
            if buf is not None:
                buf.zero_()
            for p in b.params:
                if id(p) in self.free:
                    seen = self.views.get(id(p))
                    if seen is not None and p.grad is seen[0] and self.aliased.get(id(p)) is buf:
                        # still the alias of this very buffer, zeroed with it (zero_ moved the buffer's counter only)
                        self.views[id(p)] = (seen[0], seen[0]._version)
                        continue
                in_place = buf is not None and buf.dtype == p.dtype and b.shard_group is None
                p.grad = b.view_of(buf, p) if buf is not None and in_place else None
                if id(p) in self.free:  # its own version counter (a view shares its base's)
                    assert p.grad is not None
                    v = p.grad
                    p.grad = torch.empty(0, dtype=v.dtype, device=v.device).set_(
                        v.untyped_storage(), v.storage_offset(), v.shape, v.stride())
                    self.views[id(p)] = (p.grad, p.grad._version)
                    assert buf is not None  # a hook-free parameter's bucket keeps its whole gradient buffer
                    self.aliased[id(p)] = buf
            b.launched = False
            if b.grad_shard is not None:
                b.grad_shard.zero_()
            b.master.grad = None

    def full_grad(self, p: nn.Parameter) -> torch.Tensor:
        """The accumulated (not yet reduced) gradient of `p` (stages 0, 1)."""
        b = self.bucket_of[id(p)]
        if b.grad_buf is None:
            raise RuntimeError("stage 2 keeps no full gradient after its bucket is reduced")
        return b.view_of(b.grad_buf, p)
