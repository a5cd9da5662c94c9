"""The engine records what it ran in the simulator's timeline format."""

from __future__ import annotations

import torch

import pipekit
from pipekit.models.toy import ToyConfig, lm_loss, synthetic_batches, toy_lm
from pipekit.schedules import simulate, to_chrome_trace
from pipekit.testing import run_distributed

CFG = ToyConfig(vocab=16, dim=8, wide_dim=8, blocks=1)


def _record(schedule: str, chunks: int):
    topo = pipekit.Topology(pp=2)
    module = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, topology=topo, schedule=schedule, microbatches=4,
                                    chunks_per_rank=chunks)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    engine = pipekit.PipelineEngine(module, optimizer=opt, record_timeline=True)
    engine.train_batch(synthetic_batches(CFG.vocab, 8, 3))
    return engine.timeline, [str(a) for a in engine.actions], engine.schedule


def _both():
    return [_record("1f1b", 1), _record("interleaved_1f1b", 2)]


def test_measured_timeline_matches_the_schedule():
    for rank, runs in enumerate(run_distributed(_both, 2)):
        for timeline, actions, schedule in runs:
            assert [e.action for e in timeline] == actions
            assert all(e.rank == rank and 0 <= e.start <= e.end for e in timeline)
            assert all(a.end <= b.start for a, b in zip(timeline, timeline[1:]))
            predicted = [e.action for e in simulate(schedule).timeline if e.rank == rank]
            measured = [e.action for e in timeline if "SEND" not in e.action and "RECV" not in e.action]
            assert predicted == measured
            trace = to_chrome_trace(timeline)
            assert len(trace["traceEvents"]) >= len(timeline)
