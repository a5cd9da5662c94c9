"""Host synchronisations per training step, counted on the CPU.

On a GPU, every read of a device value by the host (`.item()`, `.tolist()`,
`bool(t)`, `float(t)`, `int(t)`, `.cpu()`, `.numpy()`) waits for the device to
drain its queue, so a step should make none beyond what the user asks for
(`reduce_loss=True` returns a float: that read is asked for; `last_grad_norm`
is read lazily). Here the Tensor methods that read a value are wrapped in
each worker and counted during `engine.train_batch`, after a first step (which
agrees on the input shapes once, by design). Each counted call is reported
with the pipekit function that made it, so a failure says where.

One spawned group of four ranks (pp=2 x dp=2) runs: a plain torch optimizer
(SGD with momentum, clipping, a token-level loss with masked labels), and
ZeRO-1 in fp16 with a dynamic loss scaler and clipping. Before the change
that made these counts (issue 15), a step read 1 value on the first pipeline
rank and 4 on the last (token weights 3, clipping norm 1) with the plain
optimizer, 3 and 6 with ZeRO-1 fp16 (overflow, norm, touched parameters);
now 0 and 0, and 1 and 1 (the overflow flag). SGD keeps no step
counter (AdamW keeps its `step` on the host by design), so what is counted is
pipekit's alone.
"""

from __future__ import annotations

import collections
import traceback

import torch

import pipekit
from pipekit.models.toy import ToyConfig, lm_loss, toy_lm
from pipekit.optim import LossScaler, ZeroOptimizer
from pipekit.testing import run_distributed

CFG = ToyConfig(vocab=16, dim=8, wide_dim=8, blocks=1)
BATCH, SEQ, STEPS = 8, 3, 3
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")


def _batch(step: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab, (BATCH, SEQ), generator=gen)
    y = (5 * x + 3) % CFG.vocab
    y[0, :] = -100  # masked labels: the token weights matter
    return x, y


class _Counter:
    """Wraps the value-reading Tensor methods; counts calls while `on`, by pipekit call site."""

    def __init__(self):
        self.on, self.sites = False, collections.Counter()
        self._real = {name: getattr(torch.Tensor, name) for name in READS}
        for name, real in self._real.items():
            setattr(torch.Tensor, name, self._wrap(name, real))

    def _wrap(self, name, real):
        def read(t, *args, **kwargs):
            if self.on:
                self.on = False  # a read inside a read (tolist -> item) counts once
                try:
                    self.sites[f"{name} at {_site()}"] += 1
                finally:
                    self.on = True
            return real(t, *args, **kwargs)
        return read

    def restore(self) -> None:
        for name, real in self._real.items():
            setattr(torch.Tensor, name, real)


def _site() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/pipekit/" in f.filename.replace("\\", "/")]
    return f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].name}" if frames else "?"


def _count(engine, counter: _Counter, reduce_loss: bool = False) -> dict:
    """Host reads per train_batch, after a first step (the shapes' agreement)."""
    engine.train_batch(_batch(0))
    counter.sites.clear()
    counter.on = True
    try:
        for step in range(1, STEPS + 1):
            engine.train_batch(_batch(step), reduce_loss=reduce_loss)
    finally:
        counter.on = False
    return {"per_step": sum(counter.sites.values()) / STEPS, "sites": dict(counter.sites)}


def _plain(topo):
    module = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, topology=topo, seed=1, microbatches=2)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    return pipekit.PipelineEngine(module, optimizer=opt, clip_grad_norm=0.5)


def _zero_fp16(topo):
    module = pipekit.PipelineModule(toy_lm(CFG), loss_fn=lm_loss, topology=topo, seed=1, microbatches=2,
                                    precision="fp16")
    opt = ZeroOptimizer(module, "sgd", stage=1, lr=0.1, momentum=0.9, loss_scaler=LossScaler(initial_scale_power=8))
    return pipekit.PipelineEngine(module, optimizer=opt, clip_grad_norm=0.5)


def count_syncs() -> dict:
    topo = pipekit.Topology(pp=2, dp=2)
    counter = _Counter()
    try:
        return {"plain": _count(_plain(topo), counter), "zero_fp16": _count(_zero_fp16(topo), counter),
                "reduce_loss": _count(_plain(topo), counter, reduce_loss=True)}
    finally:
        counter.restore()


def test_a_training_step_reads_nothing_back_from_the_device():
    for rank, out in enumerate(run_distributed(count_syncs, 4, timeout=300)):
        # loss weights, token counts, the gradient norm and clipping stay on the device
        assert out["plain"]["per_step"] == 0, f"rank {rank}: host reads per step {out['plain']}"
        # fp16: one read of one flag, whether any rank overflowed, which decides on the host whether
        # the optimizer steps at all (its step counts and an LR schedule live there), as
        # torch.amp.GradScaler's step does; the finite check itself runs on the device
        assert out["zero_fp16"]["sites"] == {"item at zero.py:_overflow": STEPS}, f"rank {rank}: {out['zero_fp16']}"
        # reduce_loss=True: the caller asks for a float, one read on every rank
        assert out["reduce_loss"]["sites"] == {"item at engine.py:_mean_loss": STEPS}, f"rank {rank}: {out}"
