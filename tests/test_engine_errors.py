"""Bad input gets a clear error naming the value; a silent peer fails, never hangs."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
from torch import nn

import pipekit
from pipekit.models.toy import ToyConfig, lm_loss, synthetic_batches, toy_lm
from pipekit.schedules import ScheduleError
from pipekit.testing import run_distributed
from pipekit.topology import grid_sizes

CFG = ToyConfig(vocab=16, dim=8, wide_dim=8, blocks=1)


def test_world_size_must_match_the_grid():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by pp\*tp = 4\*1 = 4"):
        grid_sizes(6, 4)
    with pytest.raises(ValueError, match=r"world size 12 is not divisible by pp\*tp = 2\*4 = 8"):
        grid_sizes(12, 2, tp=4)
    with pytest.raises(ValueError, match=r"world size 8 does not match pp\*dp\*tp = 2\*2\*1 = 4"):
        grid_sizes(8, 2, 2)
    assert grid_sizes(8, 2) == (2, 4, 1)
    assert grid_sizes(8, 2, tp=2) == (2, 2, 2)


def test_grid_needs_distributed_beyond_one_process():
    with pytest.raises(RuntimeError, match=r"Topology\(pp=2, dp=None, tp=1\) needs torch.distributed"):
        pipekit.Topology(pp=2)


def _engine(schedule="1f1b", microbatches=2, chunks=1, specs=None):
    module = pipekit.PipelineModule(specs or toy_lm(CFG), loss_fn=lm_loss, schedule=schedule, microbatches=microbatches,
                                    chunks_per_rank=chunks)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    return pipekit.PipelineEngine(module, optimizer=opt)


def test_schedule_errors_name_the_value():
    with pytest.raises(ScheduleError, match=r"microbatches.*got 0"):
        _engine(microbatches=0)
    with pytest.raises(ScheduleError, match=r"unknown schedule 'zigzag'"):
        _engine(schedule="zigzag")
    with pytest.raises(ValueError, match=r"chunks_per_rank=2.*interleaved_1f1b"):
        _engine(schedule="1f1b", chunks=2)


def test_interleaving_rejects_microbatch_counts_it_cannot_use():
    with pytest.raises(ScheduleError, match=r"multiple of pp=2, got 3"):
        pipekit.schedules.build_schedule("interleaved_1f1b", 2, 3, 2)
    with pytest.raises(ScheduleError, match=r"at least pp=4 microbatches, got 2"):
        pipekit.schedules.build_schedule("interleaved_1f1b", 4, 2, 2)


def test_batch_that_does_not_split_into_microbatches():
    engine = _engine(microbatches=4)
    batch = next(synthetic_batches(CFG.vocab, 6, 3))
    with pytest.raises(ValueError, match=r"inputs batch size 6 does not split into 4 microbatches"):
        engine.train_batch(iter([batch]))


def test_batch_must_be_a_pair():
    with pytest.raises(TypeError, match=r"pair \(inputs, labels\)"):
        _engine().train_batch(iter([torch.zeros(4, 3, dtype=torch.long)]))


class ReturnsDict(nn.Module):
    def forward(self, x):
        return {"hidden": x}


class ReturnsList(nn.Module):
    def forward(self, x):
        return [x, 1]


@pytest.mark.parametrize("bad, shown", [(ReturnsDict, r"returned dict"),
                                        (ReturnsList, r"returned list\(Tensor, int\)")])
def test_layer_returning_something_else(bad, shown):
    specs = [pipekit.LayerSpec(nn.Linear, 4, 4), pipekit.LayerSpec(bad), pipekit.LayerSpec(nn.Linear, 4, 4)]
    module = pipekit.PipelineModule(specs, loss_fn=nn.functional.mse_loss)
    engine = pipekit.PipelineEngine(module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=rf"layer 1 \({bad.__name__}\) {shown}; every layer must return a Tensor"):
        engine.train_batch(iter([(torch.randn(2, 4), torch.randn(2, 4))]))


def test_partition_errors_reach_the_user():
    with pytest.raises(ValueError, match=r"5 layers into 8 stages"):
        pipekit.partition([pipekit.LayerSpec(nn.Linear, 2, 2)] * 5, 8, "uniform")


def _silent_peer() -> str:
    """Rank 1 builds its stage and then never runs: rank 0 must fail, naming what it waited for."""
    topo = pipekit.Topology(pp=2)
    module = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, topology=topo, schedule="1f1b", microbatches=2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    engine = pipekit.PipelineEngine(module, optimizer=opt, timeout=datetime.timedelta(seconds=2))
    if topo.pp_rank == 1:
        time.sleep(6)
        return ""
    try:
        engine.train_batch(synthetic_batches(CFG.vocab, 4, 3))
    except pipekit.PipelineError as e:
        return str(e)
    return "no error"


def test_silent_peer_fails_with_rank_and_action_named():
    message = run_distributed(_silent_peer, 2, timeout=60)[0]
    assert "rank 0 (pp_rank 0, dp_rank 0) failed at action" in message
    assert "0RECV_B0 (stage 0, RECV_B, microbatch 0)" in message
    assert "no message from rank 1 within 2 s" in message
    assert ">>" in message and "0SEND_F1" in message  # the whole action list, failing step marked


def test_train_batch_takes_the_batch_itself_or_an_iterator():
    batch = next(synthetic_batches(CFG.vocab, 4, 3))
    assert _engine().train_batch(batch, reduce_loss=True) == _engine().train_batch(iter([batch]), reduce_loss=True)
    with pytest.raises(TypeError, match=r"a batch \(inputs, labels\) or an iterator of batches, got Tensor"):
        _engine().train_batch(torch.zeros(4, 3, dtype=torch.long))


def _peer_gone() -> str:
    """Rank 1 builds its stage and leaves at once: rank 0 must say the peer closed, without waiting out
    the (long) timeout and without calling it silent."""
    topo = pipekit.Topology(pp=2)
    module = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, topology=topo, microbatches=2)
    engine = pipekit.PipelineEngine(module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                    timeout=datetime.timedelta(seconds=60))
    if topo.pp_rank == 1:
        return ""
    start = time.monotonic()
    try:
        engine.train_batch(synthetic_batches(CFG.vocab, 4, 3))
    except pipekit.PipelineError as e:
        return f"{time.monotonic() - start:.1f} {e}"
    return "no error"


def test_a_closed_peer_is_told_apart_from_a_silent_one():
    message = run_distributed(_peer_gone, 2, timeout=90)[0]
    waited, text = message.split(" ", 1)
    assert "rank 1 closed its connection before sending" in text and "no message from rank" not in text
    assert "0RECV_B0 (stage 0, RECV_B, microbatch 0)" in text
    assert float(waited) < 30, f"waited {waited} s"


def _ranks_that_disagree() -> list[str]:
    """Two mistakes on one pp=2 group: seeds that differ per rank (refused on every rank at
    construction), then reduce_loss=True on rank 0 only (rank 0 fails, saying what the ranks must
    agree on)."""
    topo = pipekit.Topology(pp=2)
    said = []
    try:
        pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, topology=topo, seed=topo.rank, microbatches=2)
        said.append("no error")
    except ValueError as e:
        said.append(str(e))
    module = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, topology=topo, microbatches=2)
    engine = pipekit.PipelineEngine(module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                    timeout=datetime.timedelta(seconds=2))
    if topo.pp_rank == 1:
        engine.train_batch(synthetic_batches(CFG.vocab, 4, 3), reduce_loss=False)
        time.sleep(6)
        return said
    try:
        engine.train_batch(synthetic_batches(CFG.vocab, 4, 3), reduce_loss=True)
        said.append("no error")
    except pipekit.PipelineError as e:
        said.append(str(e))
    return said


def test_ranks_must_agree_on_the_seed_and_on_reduce_loss():
    results = run_distributed(_ranks_that_disagree, 2, timeout=90)
    for said in results:
        assert "PipelineModule(seed=...) differs across ranks (from 0 to 1" in said[0], said[0]
    # the loss is summed with the step's non-finite marks: rank 0 knows at once that rank 1 did not ask
    assert "rank 0: 1 of the 2 ranks passed reduce_loss=True to train_batch" in results[0][1], results[0][1]
    assert "every rank must pass the same reduce_loss" in results[0][1]
