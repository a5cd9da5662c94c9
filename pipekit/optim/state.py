"""Optimizer state by parameter, independent of stage, dp size and bucketing.

`param_state` gives {param: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...,
"master": ...}}: per-element entries of the wrapped optimizer's state shaped as the
parameter (this rank's tp shard), in their own dtype; scalar entries ("step") 0-dim;
"master" (the fp32 master weights) where it is a separate copy (half-precision
models). A parameter the wrapped optimizer never stepped has only "master".

Communication: which entries exist is agreed over each dp group that shards (one
`all_gather_object` per group: a rank whose pieces never stepped holds none); then,
where the stage shards masters, every entry of one bucket at a time is all-gathered
(a transient full copy of that bucket's state), and at stage 3 each FSDP shard's
entries are gathered over its shard group (dim-0 rows). `load_param_state` needs
none: every rank is given the state of all its parameters and keeps its part.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from .buckets import Bucket, is_view_of
from .collectives import Collectives
from .fsdp import comm_device, gather_rows, own_rows
from .stage import Stage

PerParam = dict[nn.Parameter, dict[str, torch.Tensor]]
Resident = Callable[[int], AbstractContextManager]


def param_state(buckets: list[Bucket], inner: torch.optim.Optimizer | None, stage: Stage,
                comm: Collectives, resident: Resident = lambda bi: nullcontext()) -> PerParam:
    """The state of every parameter of `buckets` (module docstring); collective. `resident(i)`:
    a context manager holding bucket i's master part and state in memory (offload=nvme)."""
    per_param: PerParam = {p: {} for b in buckets for p in b.params}
    kinds = _state_kinds(buckets, inner, stage)
    for bi, b in enumerate(buckets):
        with resident(bi):
            _bucket_state(b, bi, inner, stage, comm, kinds, per_param)
    return per_param


def _bucket_state(b: Bucket, bi: int, inner: torch.optim.Optimizer | None, stage: Stage, comm: Collectives,
                  kinds: dict, per_param: PerParam) -> None:
    """`param_state`'s entries of bucket `b` into `per_param`."""
    pieces, state = _inner_of(inner, bi)
    if b.shard_group is not None:
        per_param[b.params[0]] = _shard_state(b, kinds, pieces, state)
        return
    if keeps_master(b):
        full = _gathered(b, b.master, stage, comm)
        for p in b.params:
            start, n = b.offsets[id(p)]
            per_param[p]["master"] = full[start:start + n].view_as(p).clone()
    for key, (scalar, dtype) in kinds.items():
        flat, has = _entry_of(b, key, scalar, dtype, pieces, state)
        full, present = _gathered(b, flat, stage, comm), _gathered(b, has, stage, comm)
        for p in b.params:
            start, n = b.offsets[id(p)]
            if present[start:start + n].all():
                part = full[start:start + n]
                per_param[p][key] = part[0].clone() if scalar else part.view_as(p).clone()


def load_param_state(buckets: list[Bucket], inner: torch.optim.Optimizer | None, stage: Stage,
                     per_param: PerParam, resident: Resident = lambda bi: nullcontext()) -> None:
    """Load state in `param_state`'s form into any stage, dp size and bucketing (no
    communication). Master copies missing from `per_param` are taken from the parameters;
    a parameter without optimizer entries starts fresh."""
    for bi, b in enumerate(buckets):
        pieces, state = _inner_of(inner, bi)
        with resident(bi):
            if b.shard_group is not None:
                _load_shard_state(b, per_param.get(b.params[0], {}), pieces, state)
            else:
                _load_flat_state(b, per_param, pieces, state, stage)


def keeps_master(b: Bucket) -> bool:
    """Whether `b`'s master weights are a copy of their own in a checkpoint: in a wider dtype
    than the parameters (a half-precision model). An offloaded float32 model's host master
    equals its parameters after every step, so it is not saved (the checkpoint is the same
    with offload and without)."""
    return b.master.dtype != b.param_buf.dtype


def _separate(b: Bucket) -> bool:
    """Whether `b.master` is not the parameters' own storage (a wider copy, or offloaded)."""
    return not is_view_of(b.master, b.param_buf)


def _load_flat_state(b: Bucket, per_param: PerParam, pieces: list, state: dict, stage: Stage) -> None:
    """A flat bucket's part of `load_param_state`: each key laid out bucket-sized, this rank's
    part of it into its master or its pieces' state."""
    separate, keeps = _separate(b), keeps_master(b)
    owned = stage.owned(b, b.param_buf)
    keys = sorted(set().union(*(per_param.get(p, {}).keys() for p in b.params)))
    for key in keys:
        example = next(per_param[p][key] for p in b.params if key in per_param.get(p, {}))
        full = torch.zeros(b.param_buf.numel(), dtype=example.dtype, device=b.param_buf.device)
        for p in b.params:
            if key in per_param.get(p, {}):
                start, n = b.offsets[id(p)]
                value = per_param[p][key].to(full.device)
                full[start:start + n] = value.reshape(-1) if value.numel() == n else value
        mine = stage.owned(b, full)
        if key == "master":
            if keeps:
                b.master.copy_(mine)
            continue
        for piece, (a, e, p) in zip(pieces, b.pieces):
            given = per_param.get(p, {}).get(key)
            if given is not None:
                scalar = given.dim() == 0 and p.dim() > 0
                state[piece][key] = mine[a].clone() if scalar else mine[a:e].view_as(piece).clone()
    if separate and not (keeps and "master" in keys):
        b.master.copy_(owned)


def _shard_state(b: Bucket, kinds: dict, pieces: list, state: dict) -> dict[str, torch.Tensor]:
    """Stage 3: `param_state`'s entries of a sharded parameter, gathered over its dp group
    (FSDP's dim-0 shards), shaped as the whole parameter (this rank's tp shard of it). The
    all-gathers run on the mesh's device, a host-held shard's entries copied there and back."""
    p, out = b.params[0], {}
    device = comm_device(p)
    if keeps_master(b):
        out["master"] = gather_rows(b.master, p.shape, b.shard_group, device).clone()
    for key, (scalar, dtype) in kinds.items():
        flat, has = _entry_of(b, key, scalar, dtype, pieces, state)
        full, present = (gather_rows(flat, p.shape, b.shard_group, device),
                         gather_rows(has, p.shape, b.shard_group, device))
        if present.numel() and present.all():
            out[key] = full.reshape(-1)[0].clone() if scalar else full.clone()
    return out


def _load_shard_state(b: Bucket, given: dict[str, torch.Tensor], pieces: list, state: dict) -> None:
    """Stage 3: this rank's rows of a sharded parameter's entries (`load_param_state`)."""
    p = b.params[0]
    for key, value in given.items():
        scalar = value.dim() == 0 and p.dim() > 0
        mine = value.to(b.master.device) if scalar else own_rows(value.to(b.master.device), b.shard_group)
        if key == "master":
            if keeps_master(b):
                b.master.copy_(mine.reshape(-1))
            continue
        flat = mine if scalar else mine.reshape(-1)
        for piece, (a, e, _) in zip(pieces, b.pieces):
            state[piece][key] = flat.clone() if scalar else flat[a:e].view_as(piece).clone()
    if _separate(b) and not ("master" in given and keeps_master(b)):
        b.master.copy_(b.param_buf)


def _inner_of(inner: torch.optim.Optimizer | None, bi: int) -> tuple[list, dict]:
    """Bucket `bi`'s pieces in the wrapped optimizer and its state (none without one)."""
    return (inner.param_groups[bi]["params"], inner.state) if inner is not None else ([], {})


def _state_kinds(buckets: list[Bucket], inner: torch.optim.Optimizer | None,
                 stage: Stage) -> dict[str, tuple[bool, torch.dtype]]:
    """{key: (scalar, dtype)} of the wrapped optimizer's state entries held anywhere in
    each dp group (agreed over the groups, since a rank whose pieces were never stepped
    holds none)."""
    kinds: dict[str, tuple[bool, torch.dtype]] = {}
    if inner is not None:
        for piece, state in inner.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    kinds.setdefault(key, (value.shape != piece.shape, value.dtype))
    # in bucket order, the same on every rank (a set's order is not: two ranks would gather over
    # the dense and the expert groups in opposite orders and wait for each other)
    groups = [b.dp_group for b in buckets if b.dp_group is not None and stage.shards_master]
    groups += [b.shard_group for b in buckets if b.shard_group is not None]
    for group in dict.fromkeys(groups):
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, kinds, group=group)
        for other in everyone:
            for key, kind in other.items():
                kinds.setdefault(key, kind)
    return dict(sorted(kinds.items()))


def _gathered(b: Bucket, owned: torch.Tensor, stage: Stage, comm: Collectives) -> torch.Tensor:
    """A bucket-sized tensor from every dp rank's `owned` shard (itself where the bucket is
    owned whole, or at dp=1)."""
    if stage.replicated or b.dp_size == 1:
        return owned
    full = torch.zeros(b.param_buf.numel(), dtype=owned.dtype, device=owned.device)
    full[b.shard].copy_(owned)
    for w in comm.all_gather(full, b.dp_size, b.dp_group):
        w.wait()
    return full


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
