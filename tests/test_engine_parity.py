"""Layout invariance of the pipeline engine, on CPU with gloo, in float64.

Every layout below trains the toy language model (tied embedding/head, a
(hidden, positions) tuple activation with an integer half, layers of two
widths, a plain function in the spec list) for 3 optimizer steps and must
match the same model trained in one process as a plain `nn.Sequential` with a
plain torch optimizer: losses, every local gradient and every local weight
within 1e-10. One spawned group per world size runs all of its layouts.
"""

from __future__ import annotations

import pytest
import torch

import pipekit
from pipekit.models.toy import ToyConfig, lm_loss, synthetic_batches, toy_lm
from pipekit.testing import Reference, in_float64, run_distributed

TOL = 1e-10
STEPS = 3
GLOBAL_BATCH, SEQ = 16, 5
CFG = ToyConfig(vocab=24, dim=8, wide_dim=12, blocks=2)
SEED = 1234

# (pp, dp, schedule, chunks_per_rank, microbatches, extra PipelineModule kwargs)
LAYOUTS = [
    (1, 1, "gpipe", 1, 4, {}),
    (1, 1, "1f1b", 1, 2, {"partition": "uniform"}),
    (1, 1, "interleaved_1f1b", 2, 4, {}),
    (2, 1, "gpipe", 1, 4, {}),
    (2, 1, "1f1b", 1, 4, {"activation_checkpoint_interval": 2}),
    (2, 1, "1f1b", 1, 8, {"partition": "type:MLPBlock"}),
    (2, 1, "interleaved_1f1b", 2, 4, {"partition": [0, 3, 6, 8, 11]}),
    (1, 2, "gpipe", 1, 2, {"checkpoint_layers": "MLPBlock"}),
    (1, 2, "1f1b", 1, 4, {}),
    (1, 2, "interleaved_1f1b", 2, 4, {}),
    (4, 1, "gpipe", 1, 4, {}),
    (4, 1, "1f1b", 1, 8, {"partition": "uniform"}),
    (4, 1, "interleaved_1f1b", 2, 4, {}),
    (2, 2, "gpipe", 1, 4, {}),
    (2, 2, "1f1b", 1, 2, {}),
    (2, 2, "interleaved_1f1b", 2, 4, {}),
    (4, 2, "gpipe", 1, 4, {}),
    (4, 2, "1f1b", 1, 4, {}),
    (4, 2, "interleaved_1f1b", 2, 4, {}),
]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@in_float64
def run_layout(pp, dp, schedule, chunks, microbatches, kwargs) -> dict:
    specs = toy_lm(CFG)
    topo = pipekit.Topology(pp=pp, dp=dp)
    module = pipekit.PipelineModule(specs, loss_fn=lm_loss, topology=topo, seed=SEED, schedule=schedule,
                                    microbatches=microbatches, chunks_per_rank=chunks, **kwargs)
    engine = pipekit.PipelineEngine(module, optimizer=sgd(module.parameters()))
    ref = Reference(specs, lm_loss, sgd, seed=SEED)
    assert list(module.parameters()), "every rank must own parameters in these layouts"
    assert ref.compare(module, topo, grads=False, what="start") == 0.0, f"{ref.where['start']} starts different"

    data = synthetic_batches(CFG.vocab, GLOBAL_BATCH, SEQ, seed=7)
    for _ in range(STEPS):
        ref.train_beside(engine, next(data))
        ref.compare(module, topo)
    ref.eval_beside(engine, next(data))
    return ref.worst


def check_layouts(layouts: list) -> list[dict]:
    return [run_layout(*layout) for layout in layouts]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_layouts_match_single_process(world):
    layouts = [lay for lay in LAYOUTS if lay[0] * lay[1] == world]
    per_rank = run_distributed(check_layouts, world, layouts, timeout=300)
    for rank, results in enumerate(per_rank):
        for layout, worst in zip(layouts, results):
            for what, diff in worst.items():
                assert diff <= TOL, f"rank {rank}, layout {layout[:5]}: {what} differs by {diff:.3g}"
