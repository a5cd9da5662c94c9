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
from pipekit.testing import reference_model, reference_name, run_distributed

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


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def run_layout(pp, dp, schedule, chunks, microbatches, kwargs) -> dict:
    torch.set_default_dtype(torch.float64)
    specs = toy_lm(CFG)
    topo = pipekit.Topology(pp=pp, dp=dp)
    module = pipekit.PipelineModule(specs, loss_fn=lm_loss, topology=topo, seed=SEED, schedule=schedule,
                                    microbatches=microbatches, chunks_per_rank=chunks, **kwargs)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    engine = pipekit.PipelineEngine(module, optimizer=opt)

    ref = reference_model(specs, SEED)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_params = dict(ref.named_parameters())
    local = dict(module.named_parameters())
    assert local, "every rank must own parameters in these layouts"
    for name, p in local.items():
        assert max_diff(p.detach(), ref_params[reference_name(name, specs)].detach()) == 0.0, f"{name} starts different"

    data = synthetic_batches(CFG.vocab, GLOBAL_BATCH, SEQ, seed=7)
    worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    shard = GLOBAL_BATCH // dp
    for _ in range(STEPS):
        tokens, labels = next(data)
        mine = slice(topo.dp_rank * shard, (topo.dp_rank + 1) * shard)
        loss = engine.train_batch(iter([(tokens[mine], labels[mine])]), reduce_loss=True)

        ref_opt.zero_grad()
        ref_loss = lm_loss(ref(tokens), labels)
        ref_loss.backward()
        ref_opt.step()

        worst["loss"] = max(worst["loss"], abs(loss - ref_loss.item()))
        for name, p in local.items():
            r = ref_params[reference_name(name, specs)]
            worst["grad"] = max(worst["grad"], max_diff(p.grad, r.grad))
            worst["weight"] = max(worst["weight"], max_diff(p.detach(), r.detach()))

    tokens, labels = next(data)
    mine = slice(topo.dp_rank * shard, (topo.dp_rank + 1) * shard)
    eval_loss = engine.eval_batch(iter([(tokens[mine], labels[mine])]), reduce_loss=True)
    with torch.no_grad():
        worst["eval_loss"] = abs(eval_loss - lm_loss(ref(tokens), labels).item())
    return worst


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
