"""Host synchronisations per training step, counted on the CPU.

On a GPU, every read of a device value by the host (`.item()`, `.tolist()`,
`bool(t)`, `float(t)`, `int(t)`, `.cpu()`, `.numpy()`) waits for the device to
drain its queue, so a step should make none beyond what the user asks for
(`reduce_loss=True` returns a float, read with the marks' verdict; `last_grad_norm`
is read lazily). Here the Tensor methods that read a value are wrapped in
each worker (`pipekit.testing.HostReads`) and counted during `engine.train_batch`, after a first step (which
agrees on the input shapes once, by design). Each counted call is reported
with the pipekit function that made it, so a failure says where.

MoE (issue 17): one spawned group of two ranks trains a tiny model with two
MoE blocks over two microbatches, at ep=1 (dp=2) and ep=2, dropless and with
a capacity, with a gemm that takes device offsets (grouped_mm) and with the
loop. The counts are pipekit/moe/dispatch.py's named ones: none at ep=1 with
grouped_mm and none with a capacity (padded to it: static shapes and splits);
one per MoE layer per microbatch for the dropless exchange sizes at ep=2;
one more for the loop gemm, which slices on the host.

One spawned group of four ranks (pp=2 x dp=2) runs: a plain torch optimizer
(SGD with momentum, clipping, a token-level loss with masked labels), and
ZeRO-1 in fp16 with a dynamic loss scaler and clipping. Before the change
that made these counts (issue 15), a step read 1 value on the first pipeline
rank and 4 on the last (token weights 3, clipping norm 1) with the plain
optimizer, 3 and 6 with ZeRO-1 fp16 (overflow, norm, touched parameters);
then 0 and 0, and 1 and 1 (the overflow flag); since issue 27 1 and 1 in both (the
reduced non-finite marks of losses, inputs and gradients, which decide whether to step). SGD keeps no step
counter (AdamW keeps its `step` on the host by design), so what is counted is
pipekit's alone.
"""

from __future__ import annotations

import torch
from torch import nn

import pipekit
from pipekit import LayerSpec, TiedLayerSpec
from pipekit.auxloss import metrics
from pipekit.kernels.dispatch import kernels, use_triton
from pipekit.models import toy
from pipekit.models.toy import ToyConfig, lm_loss, toy_lm
from pipekit.moe import MoEMLP
from pipekit.optim import LossScaler, ZeroOptimizer
from pipekit.testing import HostReads, run_distributed

CFG = ToyConfig(vocab=16, dim=8, wide_dim=8, blocks=1)
BATCH, SEQ, STEPS = 8, 3, 3


def _batch(step: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab, (BATCH, SEQ), generator=gen)
    y = (5 * x + 3) % CFG.vocab
    y[0, :] = -100  # masked labels: the token weights matter
    return x, y


def _count(engine, counter: HostReads, reduce_loss: bool = False) -> dict:
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
    counter = HostReads()
    try:
        return {"plain": _count(_plain(topo), counter), "zero_fp16": _count(_zero_fp16(topo), counter),
                "reduce_loss": _count(_plain(topo), counter, reduce_loss=True)}
    finally:
        counter.restore()


VERDICT = "tolist at finite.py:verdict"  # whether any rank's loss, inputs or gradients are not finite


def test_a_training_step_reads_back_only_whether_to_step():
    for rank, out in enumerate(run_distributed(count_syncs, 4, timeout=300)):
        # loss weights, token counts, the gradient norm and clipping stay on the device; one read of the
        # world's non-finite marks (losses, inputs, gradients: issue 27), which decides on the host whether
        # the optimizer steps at all (its step counts and an LR schedule live there), as
        # torch.amp.GradScaler's step does; the finite check itself runs on the device
        assert out["plain"]["sites"] == {VERDICT: STEPS}, f"rank {rank}: host reads per step {out['plain']}"
        # fp16: the same one read (an overflow is a non-finite gradient)
        assert out["zero_fp16"]["sites"] == {VERDICT: STEPS}, f"rank {rank}: {out['zero_fp16']}"
        # reduce_loss=True: the caller asks for a float, which comes in the same read (the loss shares are
        # summed with the marks, in the same all-reduce): no read, and no collective, of its own
        assert out["reduce_loss"]["sites"] == {VERDICT: STEPS}, f"rank {rank}: {out}"


# ---- MoE: the named reads of dispatch, per MoE layer per microbatch ------------------------
MOE_LAYERS, MICROBATCHES = 2, 2
EXCHANGE_SIZES = "tolist at dispatch.py:dispatch"  # dropless ep > 1: all_to_all_single's split sizes
LOOP_SIZES = "tolist at grouped_gemm.py:host_sizes"  # the loop gemm slices on the host


class MoEBlock(nn.Module):
    """Pre-norm residual MoEMLP on the hidden half of a (hidden, positions) pair."""

    def __init__(self, dim: int, **moe):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.moe = MoEMLP(dim, dim, 4, 2, **moe)

    def forward(self, x):
        h, pos = x
        return h + self.moe(self.norm(h)), pos


def _moe_engine(ep: int, **moe):
    dim = 8  # float32 rows of 32 bytes: grouped_mm runs on the CPU
    specs = [TiedLayerSpec("embed", toy.TokenEmbedding, CFG.vocab, dim), LayerSpec(toy.AddPositions, dim),
             *[LayerSpec(MoEBlock, dim, **moe) for _ in range(MOE_LAYERS)], toy.drop_positions,
             TiedLayerSpec("embed", toy.TokenEmbedding, CFG.vocab, dim, forward_fn=toy.embedding_logits)]
    module = pipekit.PipelineModule(specs, loss_fn=lm_loss, topology=pipekit.Topology(dp=2, ep=ep), seed=1,
                                    microbatches=MICROBATCHES)
    return pipekit.PipelineEngine(module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1))


MOE_CASES = {  # name: (ep, MoEMLP options, the reads expected per MoE layer per microbatch)
    "ep1 dropless grouped_mm": (1, dict(gemm="grouped_mm"), {}),
    "ep1 dropless loop": (1, dict(gemm="loop"), {LOOP_SIZES: 1}),
    "ep1 capacity loop": (1, dict(gemm="loop", capacity_factor=1.0, pad_to_capacity=True), {}),
    "ep2 dropless grouped_mm": (2, dict(gemm="grouped_mm"), {EXCHANGE_SIZES: 1}),
    "ep2 dropless loop": (2, dict(gemm="loop"), {EXCHANGE_SIZES: 1, LOOP_SIZES: 1}),
    "ep2 capacity grouped_mm": (2, dict(gemm="grouped_mm", capacity_factor=1.0, drop_policy="probs",
                                        pad_to_capacity=True), {}),
    "ep2 capacity loop": (2, dict(gemm="loop", capacity_factor=0.5, pad_to_capacity=True), {}),
}


def count_moe_syncs() -> dict:
    counter = HostReads()
    try:
        return {name: _count(_moe_engine(ep, **moe), counter) for name, (ep, moe, _) in MOE_CASES.items()}
    finally:
        counter.restore()


def test_moe_dispatch_reads_back_only_its_named_sizes_and_the_step_verdict():
    for rank, out in enumerate(run_distributed(count_moe_syncs, 2, timeout=300)):
        for name, (_, _, per_call) in MOE_CASES.items():
            want = {VERDICT: STEPS, **{site: n * MOE_LAYERS * MICROBATCHES * STEPS for site, n in per_call.items()}}
            assert out[name]["sites"] == want, f"rank {rank}, {name}: host reads {out[name]}"


def test_moe_layer_on_triton_kernels_reads_nothing_back():
    """ep=1 dropless on the Triton permute, grouped gemm and unpermute (CPU: the interpreter):
    the counts go to the kernels as device offsets, forward and backward read nothing."""
    layer = MoEMLP(8, 8, 4, 2, gemm="triton")
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    counter = HostReads()
    try:
        with kernels("triton"):
            assert use_triton(x), "the Triton side must run here (TRITON_INTERPRET=1 on a CPU)"
            counter.on = True
            layer(x).square().sum().backward()
            counter.on = False
    finally:
        counter.restore()
        metrics.pop()  # the layer's metrics, recorded in this process
    assert dict(counter.sites) == {} and x.grad is not None and layer.experts.w_gate.grad is not None
