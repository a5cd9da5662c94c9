"""The loss is the batch's loss: masked labels (-100) give the one-process loss and
gradients at every microbatch count and dp.

A token-level loss is a mean over valid tokens. Averaging per-microbatch means
(the old behaviour) weighs a token in a sparsely labelled microbatch more than
one in a densely labelled one, so the loss and gradients moved with M and dp.
The engine now weighs microbatch m by its share of the global batch's valid
tokens. Labels here are masked unevenly (whole rows in some microbatches,
none in others, one microbatch fully masked), and every layout must give the
one-process loss, every gradient (plain SGD path) and, through ZeroOptimizer,
every weight after two AdamW steps, within 1e-10 in float64.
"""

from __future__ import annotations

import functools

import torch

import pipekit
from pipekit.models import get_model, model_loss, model_specs
from pipekit.optim import ZeroOptimizer
from pipekit.testing import Reference, in_float64, reference_model, run_distributed

TOL = 1e-10
SEED, BATCH, SEQ = 4, 8, 6
GPT = dict(vocab_size=32, max_seq_len=16, n_layers=2, dim=16, n_heads=4)
# (pp, dp, microbatches, zero)
LAYOUTS = [(1, 1, 1, False), (1, 1, 2, False), (1, 1, 4, False), (2, 1, 4, False), (1, 2, 2, False),
           (1, 2, 1, True), (2, 1, 2, True)]


def masked_batch(step: int):
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, GPT["vocab_size"], (BATCH, SEQ + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:].clone()
    y[0, :] = -100  # row 0: nothing to learn
    y[1, 1:] = -100  # row 1: one token
    y[4:6, :] = -100  # rows 4-5: the third of four microbatches is fully masked
    y[7, ::2] = -100
    return x, y


@in_float64
def run_layout(pp: int, dp: int, microbatches: int, zero: bool) -> dict:
    cfg = get_model("gpt2", "tiny", **GPT)
    specs = model_specs(cfg)
    topo = pipekit.Topology(pp=pp, dp=dp)
    module = pipekit.PipelineModule(specs, loss_fn=model_loss(cfg), topology=topo, seed=SEED,
                                    microbatches=microbatches)
    if zero:
        opt, ref_opt = ZeroOptimizer(module, "adamw", stage=1, lr=0.05), functools.partial(torch.optim.AdamW, lr=0.05)
    else:
        opt, ref_opt = torch.optim.SGD(module.parameters(), lr=0.0), functools.partial(torch.optim.SGD, lr=0.0)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    ref = Reference(specs, model_loss(cfg).build(), ref_opt, seed=SEED)
    for step in range(2):
        ref.train_beside(engine, masked_batch(step))
        ref.compare(module, topo, grads=not zero)
    return ref.worst


def run_all(world: int) -> list:
    return [run_layout(*layout) for layout in LAYOUTS if layout[0] * layout[1] == world]


def test_masked_labels_give_the_one_process_loss_at_any_m_and_dp():
    for world in (1, 2):
        layouts = [layout for layout in LAYOUTS if layout[0] * layout[1] == world]
        for rank, results in enumerate(run_distributed(run_all, world, world)):
            for layout, worst in zip(layouts, results):
                for what, diff in worst.items():
                    assert diff <= TOL, f"rank {rank}, (pp, dp, m, zero)={layout}: {what} differs by {diff:.3g}"


def test_the_old_mean_of_means_would_differ(float64):
    """The negative control: the microbatch-mean average differs here, so the test above can fail."""
    cfg = get_model("gpt2", "tiny", **GPT)
    ref = reference_model(model_specs(cfg), SEED)
    loss_fn = model_loss(cfg).build()
    x, y = masked_batch(0)
    whole = loss_fn(ref(x), y).item()
    halves = sum(loss_fn(ref(x[i:i + 4]), y[i:i + 4]).item() for i in (0, 4)) / 2
    assert abs(whole - halves) > 1e-5  # (4.7e-4 here), far above TOL


class TemperedLoss(torch.nn.Module):
    """Cross-entropy of logits times a learned temperature: a loss with a parameter."""

    def __init__(self):
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, logits, labels):
        return torch.nn.functional.cross_entropy((logits * self.temperature).flatten(0, 1), labels.flatten())


@in_float64
def run_tempered(pp: int) -> dict:
    """A loss with a parameter, at pp: trained where the last stage runs, saved from there."""
    from pipekit.checkpoint import full_state_dict
    from pipekit.models.toy import ToyConfig, toy_lm
    from pipekit.spec import LayerSpec

    specs = toy_lm(ToyConfig(vocab=24, dim=8, wide_dim=12, blocks=2))
    module = pipekit.PipelineModule(specs, loss_fn=LayerSpec(TemperedLoss), topology=pipekit.Topology(pp=pp), seed=2,
                                    microbatches=2)
    engine = pipekit.PipelineEngine(module, optimizer=ZeroOptimizer(module, "sgd", stage=1, lr=0.5))
    ref = Reference(specs, TemperedLoss(), functools.partial(torch.optim.SGD, lr=0.5), seed=2)  # the loss's too
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randint(0, 24, (4, 5), generator=gen)
        y = (5 * x + 3) % 24
        engine.train_batch(iter([(x, y)]))
        ref.step((x, y))
    saved = full_state_dict(module)["loss_fn.temperature"].item()
    return {"saved": saved, "reference": ref.loss_fn.temperature.item()}


def test_a_loss_with_parameters_is_trained_and_saved_at_every_pp():
    for pp in (1, 2):
        for rank, got in enumerate(run_distributed(run_tempered, pp, pp)):
            assert got["reference"] != 1.5  # the reference did learn its temperature
            assert abs(got["saved"] - got["reference"]) <= TOL, f"pp={pp} rank {rank}: {got}"
