"""A non-finite loss or gradient skips the step, on every path, and says so once (issue 27).

A NaN in one input row (the loss goes non-finite first), and a NaN born in backward with
a finite loss (a hook on one parameter in one process; a layer whose backward poisons its
input grad at pp=2 x dp=2): the step is skipped on every rank, the weights are bitwise
unchanged, one line names the step and the cause, and the next good batch trains exactly
as if the bad one never came (compared bitwise with an engine that never saw it). One
process (the engine, and a bare ZeroOptimizer), and one spawned 4-rank group (pp=2 x dp=2,
float64) for ZeRO 0-3 and fused AdamW. `pipekit train` in process: a run whose loss goes
non-finite stops after train.max_skipped_steps skips in a row, saved no checkpoint with
non-finite weights, and names the newest checkpoint whose weights trained a step cleanly.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import pipekit
from pipekit.optim import ZeroOptimizer
from pipekit.spec import LayerSpec
from pipekit.testing import in_float64, run_distributed

BATCH, DIM, OUT = 8, 6, 3
POISON = {"on": False}  # per process: PoisonGrad's backward gives NaN while set


class PoisonGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, math.nan) if POISON["on"] else g


class Poison(nn.Module):
    """Identity forward; a NaN input grad while POISON is on (the loss stays finite)."""

    def forward(self, x):
        return PoisonGrad.apply(x)


def specs():
    return [LayerSpec(nn.Linear, DIM, 8), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 8, 8), LayerSpec(Poison),
            LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 8, OUT)]


def batch(step: int, rows: int = BATCH, nan_row: int | None = None):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(rows, DIM, generator=gen), torch.randn(rows, OUT, generator=gen)
    if nan_row is not None:
        x[nan_row, 2] = math.nan
    return x, y


def engine(topo=None, optimizer=None, lines=None, microbatches=2):
    module = pipekit.PipelineModule(specs(), loss_fn=nn.functional.mse_loss, topology=topo, seed=5,
                                    microbatches=microbatches)
    opt = optimizer(module) if optimizer else torch.optim.AdamW(module.parameters(), lr=1e-2)
    return pipekit.PipelineEngine(module, optimizer=opt, clip_grad_norm=1.0,
                                  say=lines.append if lines is not None else print)


def weights(e) -> list[torch.Tensor]:
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in e.module.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def bad_and_good(make, share) -> dict:
    """Train good, NaN-input, NaN-gradient, good batches; and beside it an engine that sees
    the good ones only. `share(step, nan_row)`: this rank's batch."""
    lines: list[str] = []
    e, ref = make(lines), make([])
    out = {}
    for stepped in (e, ref):
        stepped.train_batch(share(0, None))
    before = weights(e)
    e.train_batch(share(1, 6))  # row 6 of the global batch: microbatch 1 of 2 (of dp rank 1 of 2)
    out["input_skipped"] = e.last_step_skipped and same(weights(e), before)
    POISON["on"] = True
    try:
        loss = e.train_batch(share(2, None), reduce_loss=True)
    finally:
        POISON["on"] = False
    out["grad_skipped"] = e.last_step_skipped and math.isfinite(loss) and same(weights(e), before)
    for stepped in (e, ref):
        stepped.train_batch(share(3, None))
    out["then_as_if_never"] = not e.last_step_skipped and same(weights(e), weights(ref))
    out["moved"] = not same(weights(e), before)
    out["lines"] = lines
    return out


# ---- one process ------------------------------------------------------------------------------
def test_one_nan_input_row_or_nan_gradient_skips_the_step_in_one_process(float64):
    out = bad_and_good(lambda lines: engine(lines=lines), lambda step, row: batch(step, nan_row=row))
    assert out["input_skipped"] and out["grad_skipped"] and out["then_as_if_never"] and out["moved"], out
    assert out["lines"] == [
        "step 2: skipped on every rank, the loss went non-finite first (loss of microbatch 1 of dp rank 0; "
        "inputs of microbatch 1 of dp rank 0 hold a NaN or inf); the weights and optimizer state are unchanged",
        "step 3: skipped on every rank, the gradients went non-finite (the loss was finite); the weights and "
        "optimizer state are unchanged"]


def test_a_nan_gradient_from_a_hook_skips_a_bare_zero_optimizer_step(float64):
    model = nn.Linear(4, 2)
    opt = ZeroOptimizer(model, "adamw", lr=0.1, clip_grad_norm=1.0)
    poison = {"on": True}
    model.weight.register_hook(lambda g: torch.full_like(g, math.nan) if poison["on"] else g)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    assert opt.last_skip is not None and opt.last_skip.grads and not opt.last_skip.losses
    assert same([p.detach() for p in model.parameters()], before) and not opt.inner.state
    poison["on"] = False
    opt.zero_grad()
    model(torch.randn(3, 4)).square().mean().backward()
    opt.step()
    assert opt.last_skip is None and not same([p.detach() for p in model.parameters()], before)


# ---- pp=2 x dp=2, ZeRO 0-3 ---------------------------------------------------------------------
CASES = {"zero0": dict(stage=0), "zero1 fused": dict(stage=1, fused=True), "zero2": dict(stage=2),
         "zero3": dict(stage=3)}


@in_float64
def distributed_cases() -> dict:
    topo = pipekit.Topology(pp=2, dp=2)
    rows = BATCH // topo.dp

    def share(step, nan_row):
        x, y = batch(step, nan_row=nan_row)
        return x[topo.dp_rank * rows:(topo.dp_rank + 1) * rows], y[topo.dp_rank * rows:(topo.dp_rank + 1) * rows]

    out = {}
    for name, kw in CASES.items():
        def make(lines, kw=kw):
            return engine(topo, lambda m: ZeroOptimizer(m, "adamw", lr=1e-2, **kw), lines)
        out[name] = bad_and_good(make, share)
    return out


def test_one_nan_input_row_or_nan_gradient_skips_the_step_everywhere_at_pp2_dp2_zero0_to_3():
    results = run_distributed(distributed_cases, 4, timeout=300)
    for rank, out in enumerate(results):
        for name, got in out.items():
            assert got["input_skipped"] and got["grad_skipped"], (rank, name, got)
            assert got["then_as_if_never"] and got["moved"], (rank, name, got)
            # said once, by global rank 0 (stage 0: it saw the inputs; the loss is on stage 1)
            assert got["lines"] == ([
                "step 2: skipped on every rank, the loss went non-finite first (loss of microbatch 1 of dp rank 1; "
                "inputs of microbatch 1 of dp rank 1 hold a NaN or inf); the weights and optimizer state are "
                "unchanged",
                "step 3: skipped on every rank, the gradients went non-finite (the loss was finite); the weights "
                "and optimizer state are unchanged"] if rank == 0 else []), (rank, name)


# ---- pipekit train ------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_diverging_run_stops_saving_no_nonfinite_weights_and_names_a_good_checkpoint(tmp_path, monkeypatch):
    """Step 4's batch trains cleanly on huge weights (lr 1e6 from step 4 on): from step 5 every
    loss is inf/NaN, so steps 5-7 are skipped and the run stops. The checkpoints of steps 4 and 6
    hold the weights that fail (4: saved before the streak, 6: inside it, so not saved); the
    advice names step 2's, and no checkpoint on disk holds a non-finite weight."""
    import pipekit.run.loop as loop  # here: the spawned workers need none of the run's imports
    from pipekit.config import load_config

    cfg = load_config(os.path.join(ROOT, "configs/toy.yaml"), [
        "parallel.pp=1", "model.dim=16", "train.micro_batch=2", "train.seq_len=8", "schedule.microbatches=1",
        "train.steps=8", "checkpoint.every=2", "checkpoint.keep=3", "logging.progress=false",
        "logging.tensorboard=false", "data.val_every=0", "logging.peak_tflops=1", "optimizer.clip_grad_norm=null",
        "optimizer.warmup_steps=0", "train.max_skipped_steps=3", f"logging.out_dir={tmp_path / 'run'}"])
    real = loop.PipelineEngine.train_batch

    def blow_up_at_step_4(self, data=None, **kw):
        if self.steps_run == 3:
            for group in self.optimizer.param_groups:
                group["lr"] = 1e6
            self.lr_scheduler = None
        return real(self, data, **kw)

    monkeypatch.setattr(loop.PipelineEngine, "train_batch", blow_up_at_step_4)
    with pytest.raises(loop.NonFiniteLoss) as e:
        loop.train(cfg)
    said = str(e.value)
    ckpts = tmp_path / "run" / "checkpoints"
    assert said.startswith("step 5: the loss is nan (training diverged): steps 5-7 skipped, 3 in a row"), said
    assert f"resume from {ckpts / 'step_00000002'}" in said, said
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000002", "step_00000004"]
    for step in ckpts.glob("step_*"):
        dcp_to_torch_save(str(step), str(tmp_path / "flat.pt"))
        flat = torch.load(tmp_path / "flat.pt", weights_only=False)
        tensors = [t for t in _tensors(flat) if t.is_floating_point()]
        assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors), step


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


def test_marks_name_the_microbatches_whatever_their_inputs_hold():
    """Marks, alone: a NaN among a microbatch's float inputs marks that microbatch only (token
    ids are never marked, a microbatch of ids alone is skipped), a non-scalar loss is checked
    whole, and a NaN loss that weighs nothing is not marked."""
    from pipekit.optim.finite import Marks

    ids = torch.zeros(2, 3, dtype=torch.long)
    nan = torch.tensor([[1.0, float("nan")]])
    marks = Marks(dp=1, microbatches=3)
    marks.mark_inputs([(nan, ids), ids, (torch.ones(1, 2), ids)])
    marks.mark_losses([torch.tensor(1.0), torch.tensor([2.0, float("inf")]), torch.tensor(float("nan"))],
                      torch.tensor([1.0, 1.0, 0.0]))
    skip = marks.verdict()
    assert skip is not None and skip.inputs == ((0, 0),) and skip.losses == ((0, 1),) and not skip.grads
    clean = Marks(dp=1, microbatches=2)
    clean.mark_inputs([ids, ids])
    clean.mark_losses([torch.tensor(1.0), torch.tensor(2.0)], torch.ones(2))
    assert clean.verdict() is None
