"""`pipekit.optim.stage.Stage`: what each ZeRO stage shards, asked as questions, without
processes (a bucket here is a stand-in with a shard and groups)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pipekit.optim.stage import Stage


@dataclass
class FakeBucket:
    shard: slice
    dp_group: object = "dp"
    shard_group: object = None


@pytest.mark.parametrize("number, shards_master, shards_grads, replicated, fsdp", [
    (0, False, False, True, False),
    (1, True, False, False, False),
    (2, True, True, False, False),
    (3, False, False, True, True),
])
def test_each_stage_says_what_it_shards(number, shards_master, shards_grads, replicated, fsdp):
    s = Stage(number)
    assert (s.shards_master, s.shards_grads, s.replicated, s.fsdp) == (shards_master, shards_grads, replicated, fsdp)


@pytest.mark.parametrize("number", [-1, 4, 5])
def test_a_stage_outside_0_to_3_is_refused_with_the_number_given(number):
    with pytest.raises(ValueError, match=rf"ZeRO stage must be 0, 1, 2 or 3 \(an int\), got {number}"):
        Stage(number)


def test_a_replicated_stage_owns_the_whole_bucket_a_sharding_one_its_shard():
    buf, b = torch.arange(8), FakeBucket(shard=slice(4, 8))
    for number in (0, 3):
        assert Stage(number).owned(b, buf) is buf and Stage(number).first(b) == 0
    for number in (1, 2):
        assert Stage(number).owned(b, buf).tolist() == [4, 5, 6, 7] and Stage(number).first(b) == 4


def test_the_parts_of_a_gradient_are_split_over_dp_when_sharding_else_over_fsdps_shard_group():
    b = FakeBucket(shard=slice(0, 4), dp_group="dp", shard_group="fsdp")
    assert [Stage(n).split_over(b) for n in (0, 1, 2, 3)] == ["fsdp", "dp", "dp", "fsdp"]
    assert Stage(0).split_over(FakeBucket(shard=slice(0, 4))) is None  # a whole bucket: nothing to sum


def test_a_stage_is_a_value():
    assert Stage(2) == Stage(2) and Stage(1) != Stage(2) and len({Stage(1), Stage(1)}) == 1
    with pytest.raises(AttributeError):
        Stage(1).number = 2  # type: ignore[misc]
