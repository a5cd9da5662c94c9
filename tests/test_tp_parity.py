"""Tensor parallelism inside the pipeline: tp in {2, 4} and pp x tp x dp mixes
train GPT-2 and Llama (tiny, float64) exactly like one process; so does an
untied GPT-2 whose 29 ids are padded to 32 rows (run at the layouts with tp > 1:
each tp size builds the same padded tables from the same draws, and masks its
own shard of the head).

Each layout runs 3 optimizer steps (AdamW-free SGD with momentum, global
gradient clipping on) and every rank checks its loss, every local gradient and
every local weight — a tp shard against the same slice of the single-process
tensor — within 1e-10; the clipping norm is checked against torch's own
`clip_grad_norm_` on the reference.
"""

from __future__ import annotations

import pytest
import torch

import pipekit
from pipekit.models import get_model, model_loss, model_specs
from pipekit.testing import Reference, in_float64, run_distributed

TOL = 1e-10
SEED = 99
BATCH, SEQ, STEPS, CLIP = 8, 6, 3, 0.5
MODELS = {
    "gpt2": dict(vocab_size=32, max_seq_len=16, n_layers=3, dim=16, n_heads=4),
    "llama": dict(vocab_size=32, max_seq_len=16, n_layers=3, dim=32, n_heads=8, n_kv_heads=4, hidden=24),
    "gpt2-padded": dict(vocab_size=29, vocab_pad_multiple=8, tie_embeddings=False, max_seq_len=16, n_layers=2,
                        dim=16, n_heads=4),
}
# (pp, dp, tp, schedule, microbatches)
LAYOUTS = {
    2: [(1, 1, 2, "1f1b", 2)],
    4: [(1, 1, 4, "gpipe", 2), (2, 1, 2, "1f1b", 4), (2, 2, 1, "1f1b", 2), (1, 2, 2, "gpipe", 2)],
}


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


@in_float64
def run_layout(family: str, pp: int, dp: int, tp: int, schedule: str, microbatches: int) -> dict:
    cfg = get_model(family.split("-")[0], "tiny", **MODELS[family])
    specs = model_specs(cfg)
    topo = pipekit.Topology(pp=pp, dp=dp, tp=tp)
    module = pipekit.PipelineModule(specs, loss_fn=model_loss(cfg), topology=topo, seed=SEED, schedule=schedule,
                                    microbatches=microbatches)
    engine = pipekit.PipelineEngine(module, optimizer=sgd(module.parameters()), clip_grad_norm=CLIP)
    ref = Reference(specs, model_loss(cfg).build(), sgd, seed=SEED, clip=CLIP)
    assert ref.compare(module, topo, grads=False, what="start") == 0.0, f"{ref.where['start']} starts different"

    gen = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
        ref.train_beside(engine, (ids[:, :-1], ids[:, 1:]))
        ref.compare(module, topo)
    return ref.worst


def cases(layouts: list) -> list:
    """(model, layout) pairs: every model at every layout, the padded one only where tp > 1."""
    return [(m, layout) for m in MODELS for layout in layouts if layout[2] > 1 or not m.endswith("-padded")]


def check(layouts: list) -> list:
    return [run_layout(model, *layout) for model, layout in cases(layouts)]


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_tensor_parallel_layouts_match_single_process(world):
    layouts = LAYOUTS[world]
    for rank, results in enumerate(run_distributed(check, world, layouts, timeout=400)):
        for (family, layout), worst in zip(cases(layouts), results):
            for what, diff in worst.items():
                where = f"rank {rank}, {family} (pp, dp, tp)={layout[:3]} {layout[3]}"
                assert diff <= TOL, f"{where}: {what} differs by {diff:.3g}"
