"""The bucket collectives over a data-parallel group, chosen by its backend.

On gloo, whose reduce-scatter and all-gather measured slower than its all-reduce and
broadcasts, a reduce-scatter is an all-reduce (the whole bucket is summed; only the
shard is read) and an all-gather is one broadcast per shard from its owner; NCCL (and
every other backend) gets the real ones. Both are asynchronous: they return works.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def size(group) -> int:
    """The group's size; 1 for no group."""
    return dist.get_world_size(group) if group is not None else 1


@dataclass(frozen=True)
class Collectives:
    """Reduce-scatter and all-gather, each taking gloo's path where `gloo(group)` says so
    (`pipekit.optim.zero` passes its `_is_gloo`: a test makes it say no, to run the NCCL
    branch on gloo)."""

    gloo: Callable[[Any], bool] = is_gloo

    def reduce_scatter(self, buf: torch.Tensor, shard: slice, group):
        """Sum `buf` over `group` into this rank's `buf[shard]` (async)."""
        if self.gloo(group):
            return dist.all_reduce(buf, group=group, async_op=True)
        return dist.reduce_scatter_tensor(buf[shard], buf, group=group, async_op=True)

    def all_gather(self, buf: torch.Tensor, n: int, group) -> list:
        """Fill `buf` with every rank's shard, `buf` split in `n` (async works)."""
        size = buf.numel() // n
        if self.gloo(group):
            return [dist.broadcast(buf[r * size:(r + 1) * size], src=dist.get_global_rank(group, r), group=group,
                                   async_op=True) for r in range(n)]
        me = dist.get_rank(group)
        return [dist.all_gather_into_tensor(buf, buf[me * size:(me + 1) * size].clone(), group=group,
                                            async_op=True)]
