"""The ZeRO stage as a value that knows what it shards.

What a rank keeps of each bucket, and how the bucket's gradient is reduced over its
data-parallel group of N ranks (r: this rank's r-th of N equal shards):

    stage   master + optimizer state   gradient between passes        reduction           after the step
    0       whole                      whole bucket                   all-reduce          -
    1       shard r                    whole bucket                   reduce-scatter      all-gather params
    2       shard r                    shard r (bucket freed)         reduce-scatter,     all-gather params
                                                                      every pass
    3       as stage 0, over what FSDP2 leaves the rank: its shard of each layer's
            parameters (reduced by FSDP, `pipekit.optim.fsdp`), whole the rest

So stage 3's optimizer side is replicated: FSDP does the sharding, and an FSDP shard
is a bucket of its own (`Bucket.shard_group`). Code that shards asks `shards_master`
or `shards_grads`, never the stage's number, so changing stage 2 never means reading
stage 3's branches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class _Sharded(Protocol):
    """What the stage reads of a bucket (`pipekit.optim.buckets.Bucket`)."""

    dp_group: Any
    shard_group: Any

    @property
    def shard(self) -> slice: ...


@dataclass(frozen=True)
class Stage:
    """ZeRO stage `number` (0, 1, 2 or 3), answering what it shards."""

    number: int

    def __post_init__(self) -> None:
        if isinstance(self.number, bool) or self.number not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3 (an int), got {self.number!r}"
                             + (f" (a {type(self.number).__name__})" if not isinstance(self.number, int) else ""))

    @property
    def fsdp(self) -> bool:
        """Stage 3: FSDP2 shards the layers' parameters (and reduces their gradients)."""
        return self.number == 3

    @property
    def shards_master(self) -> bool:
        """Stages 1, 2: a rank's master weights and optimizer state are its shard of each
        bucket; gradients are reduce-scattered into it and the parameters all-gathered after
        the step."""
        return self.number in (1, 2)

    @property
    def shards_grads(self) -> bool:
        """Stage 2: a bucket's gradient is reduced during every backward pass, added into the
        rank's gradient shard and freed (at most `max_inflight` buckets in flight)."""
        return self.number == 2

    @property
    def replicated(self) -> bool:
        """Stages 0 and 3 (the optimizer's view beside FSDP): each bucket is owned whole."""
        return not self.shards_master

    def owned(self, b: _Sharded, buf: torch.Tensor) -> torch.Tensor:
        """The part of the bucket-sized `buf` this rank updates: all of it, or its shard."""
        return buf if self.replicated else buf[b.shard]

    def first(self, b: _Sharded) -> int:
        """Where the part this rank updates starts in bucket `b`."""
        return 0 if self.replicated else b.shard.start

    def split_over(self, b: _Sharded) -> Any:
        """The group whose ranks hold the other parts of what this rank updates of `b`: its dp
        group when sharding masters, FSDP's shard group for stage 3's shards, else None."""
        return b.dp_group if self.shards_master else b.shard_group
