"""Sequence parallelism (`Topology(sequence_parallel=True)`, `parallel.sequence_parallel`) equals one process.

On 4 gloo ranks, float64, 3 AdamW steps with global-norm clipping, sequence-parallel:
GPT-2 (tied, learned positions) and Llama (untied, rotary positions inside attention)
at tp=4, tp=2 x dp=2 and pp=2 x tp=2; besides, at tp=2 x dp=2: GPT-2 with the fused
head-and-loss, GPT-2 under ZeRO stage 1 and Llama under stage 2 (the sequence-parallel
gradient sum on this rank's shard only), Llama with every layer recomputed in backward
(activation checkpointing: the all-gathers run again there); Llama with the fused loss
(untied head) at tp=4; at pp=2 x tp=2, GPT-2 with the zero-bubble split backward
(zb_h1) and Llama under DualPipe-V with overlapped forwards and backwards (the layers'
collectives on `pipekit.comm.lane`); MoE, each tp rank routing its own slice: Mixtral with
the global-batch balancing loss, the z-loss and the aux-free bias at tp=4 and
tp=2 x dp=2 x ep=2, GPT-2-MoE (with a shared expert) at pp=2 x tp=2.

Every rank checks its loss, the clipping norm, every local weight and (at ZeRO stage 0;
under stages 1 and 2 a rank's gradients are final on its own shard only) every local
gradient within 1e-10 of the one-process model. Each case also checks that the sequence
really was split: every block's output, and the first stage's output (the p2p message
at pp=2), is (B, T/tp, D); and that the norms, row-parallel biases, GPT-2's position
table and the MoE layers carry the `sequence_parallel` mark (their gradients would be
wrong without the sum over tp, which the gradient check sees).
"""

from __future__ import annotations

import pytest
import torch

import pipekit
from pipekit import auxloss
from pipekit.layers import TransformerBlock
from pipekit.layers.parallel import (
    expert_tensor_parallel,
    gather_sequence,
    is_sequence_parallel,
    reduce_scatter_sequence,
    sequence_parallel,
    tensor_parallel,
)
from pipekit.models import get_model, model_loss, model_specs
from pipekit.moe import apply_bias_updates
from pipekit.optim import ZeroOptimizer
from pipekit.schedules import build_schedule
from pipekit.testing import FakeGroup, Reference, in_float64, run_distributed

TOL = 1e-10
SEED = 11
BATCH, SEQ, STEPS, CLIP = 4, 8, 3, 0.05
MODELS = {
    "gpt2": dict(vocab_size=32, max_seq_len=16, n_layers=2, dim=16, n_heads=4),
    "llama": dict(vocab_size=32, max_seq_len=16, n_layers=2, dim=16, n_heads=4, n_kv_heads=4, hidden=24),
    "gpt2-fused": dict(vocab_size=32, max_seq_len=16, n_layers=2, dim=16, n_heads=4, fused_loss=True),
    "llama-fused": dict(vocab_size=32, max_seq_len=16, n_layers=2, dim=16, n_heads=4, n_kv_heads=4, hidden=24,
                        fused_loss=True),
    # MoE: every tp rank routes its own sequence slice; the global-batch balance, the z-loss and the
    # aux-free bias (loads summed over dp and tp, losses averaged over them) equal one process
    "mixtral": dict(vocab_size=32, max_seq_len=16, n_layers=2, dim=16, n_heads=4, n_kv_heads=4, hidden=8,
                    n_experts=8, top_k=2, aux_loss_coef=0.01, global_balance=True, z_loss_coef=1e-3,
                    bias_update_rate=1e-3),
    "gpt2-moe": dict(vocab_size=32, max_seq_len=16, n_layers=2, dim=16, n_heads=4, n_experts=4, top_k=1,
                     n_shared_experts=1, aux_loss_coef=0.0, z_loss_coef=0.0),
}
# (model, (pp, dp, tp, ep), ZeRO stage, schedule)
CASES = [
    ("gpt2", (1, 1, 4, 1), 0, "1f1b"), ("gpt2", (1, 2, 2, 1), 1, "1f1b"), ("gpt2", (2, 1, 2, 1), 0, "zb_h1"),
    ("llama", (1, 1, 4, 1), 0, "1f1b"), ("llama", (1, 2, 2, 1), 0, "1f1b+recompute"),
    ("llama", (2, 1, 2, 1), 0, "1f1b"),
    ("gpt2-fused", (1, 2, 2, 1), 0, "1f1b"), ("llama", (1, 2, 2, 1), 2, "1f1b"),
    ("mixtral", (1, 1, 4, 1), 0, "1f1b"), ("mixtral", (1, 2, 2, 2), 0, "1f1b"), ("gpt2-moe", (2, 1, 2, 1), 0, "1f1b"),
    ("llama-fused", (1, 1, 4, 1), 0, "1f1b"),
    ("llama", (2, 1, 2, 1), 0, "dualpipe_v+overlap"),  # forwards beside backwards: the lanes' twin groups
]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@in_float64
def run_case(family: str, layout: tuple, stage: int, schedule: str) -> dict:
    auxloss.metrics.pop()  # the MoE metrics of an earlier case (other expert counts)
    pp, dp, tp, ep = layout
    cfg = get_model(family.split("-")[0], "tiny", **MODELS[family])
    specs = model_specs(cfg)
    topo = pipekit.Topology(pp=pp, dp=dp, tp=tp, ep=ep, sequence_parallel=True)
    name, _, extra = schedule.partition("+")
    overlap, recompute = extra == "overlap", extra == "recompute"
    microbatches = 4 if overlap else 2
    module = pipekit.PipelineModule(specs, loss_fn=model_loss(cfg), topology=topo, seed=SEED,
                                    schedule=build_schedule(name, pp, microbatches, overlap=overlap),
                                    activation_checkpoint_interval=1 if recompute else 0)
    opt = ZeroOptimizer(module, "adamw", stage=stage, lr=1e-2, weight_decay=0.1)
    engine = pipekit.PipelineEngine(module, optimizer=opt, clip_grad_norm=CLIP, record_timeline=overlap)
    plain = get_model(family.split("-")[0], "tiny", **{**MODELS[family], "fused_loss": False})
    # the fused model's weights, unfused head and loss
    ref = Reference(model_specs(plain), model_loss(plain).build(), adamw, seed=SEED, clip=CLIP)
    marked = sorted(n for n, p in module.named_parameters() if is_sequence_parallel(p))
    boundary = tuple(module.stage_io_meta(torch.zeros(BATCH // dp // microbatches, SEQ, dtype=torch.long))[0][1].shape)
    block_out: list[tuple] = []  # what the local blocks give in training (a rank may hold none)
    for block in (m for m in module.modules() if isinstance(m, TransformerBlock)):
        block.register_forward_hook(lambda mod, args, out: block_out.append(tuple(out.shape)))

    ref.compare(module, topo, grads=False, what="start")
    gen = torch.Generator().manual_seed(5)
    clipped, overlapped = True, 0
    for _ in range(STEPS):
        ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
        ref.train_beside(engine, (ids[:, :-1], ids[:, 1:]))
        overlapped += sum("+" in e.action for e in engine.timeline)
        clipped = clipped and ref.grad_norm > CLIP
        apply_bias_updates(ref.model)  # the engine moves the aux-free bias after its step
        ref.compare(module, topo, grads=stage == 0)  # ZeRO-1/2: a rank's gradients are final on its own shard only
    return {"worst": ref.worst, "marked": marked, "boundary": boundary, "blocks": set(block_out),
            "clipped": clipped, "microbatches": microbatches, "overlapped": overlapped, "topology": repr(topo)}


@in_float64
def reduce_scatter_paths() -> float:
    """`_reduce_scatter` along T: the gloo path (all-reduce, slice) against the one other backends
    take (`reduce_scatter_single`, forced here by naming the backend otherwise) and the plain sum."""
    from unittest import mock

    from pipekit.layers.parallel import _reduce_scatter

    topo = pipekit.Topology(tp=4)
    x = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(topo.rank))
    whole = sum(torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(r)) for r in range(4))
    mine = whole[:, 2 * topo.tp_rank:2 * topo.tp_rank + 2]
    gloo = _reduce_scatter(x, topo.tp_group, 1)
    with mock.patch("torch.distributed.get_backend", return_value="other"):
        other = _reduce_scatter(x, topo.tp_group, 1)
    return max((gloo - mine).abs().max().item(), (other - mine).abs().max().item())


def check() -> list:
    return [run_case(*case) for case in CASES] + [reduce_scatter_paths()]


@pytest.fixture(scope="module")
def results():
    return run_distributed(check, 4, timeout=400)


def test_sequence_parallel_layouts_match_one_process(results):
    for rank, res in enumerate(results):
        assert res[-1] <= TOL, f"rank {rank}: a reduce-scatter path differs from the sum by {res[-1]:.3g}"
    for rank, res in enumerate(results):
        for (family, layout, stage, schedule), r in zip(CASES, res):
            where = f"rank {rank}, {family} (pp, dp, tp, ep)={layout} ZeRO-{stage} {schedule}"
            for what, diff in r["worst"].items():
                assert diff <= TOL, f"{where}: {what} differs by {diff:.3g}"
            assert r["clipped"], f"{where}: the clipping never acted"
            assert "sequence_parallel=True" in r["topology"], where
            assert (r["overlapped"] > 0) == schedule.endswith("+overlap"), (where, r["overlapped"])


def test_sequence_parallel_splits_the_activations_and_marks_the_replicated_parameters(results):
    for i, case in enumerate(CASES):
        assert any(res[i]["blocks"] for res in results), f"{case}: no rank ran a block"
    for rank, res in enumerate(results):
        for (family, layout, *_), r in zip(CASES, res):
            pp, dp, tp, _ = layout
            where = f"rank {rank}, {family} {layout}"
            # a microbatch's rows, this rank's T/tp positions, dim
            split = (BATCH // dp // r["microbatches"], SEQ // tp, 16)
            assert r["blocks"] <= {split}, (where, r["blocks"])
            if pp > 1:
                assert r["boundary"] == split, where  # the first stage's output: the p2p message
            names = {n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n in r["marked"]}
            assert r["marked"], where
            expect = {"norm1.weight", "norm2.weight"}
            if family.startswith("gpt2"):
                expect |= {"o.bias", "norm1.bias", "norm2.bias"} | ({"experts.b_proj"} if "moe" in family
                                                                   else {"proj.bias"})
            if family in ("mixtral", "gpt2-moe"):
                expect |= {"router.weight", "experts.w_down" if family == "mixtral" else "experts.w_proj"}
            assert expect <= names or not r["blocks"], (where, names)  # a rank with blocks has their marks
            assert all(".q." not in n and ".fc." not in n and "wte" not in n for n in r["marked"]), where
            if family.startswith("gpt2") and any(n.startswith("tied.") for n in r["marked"]):
                assert "tied.embed.wpe.weight" in r["marked"], where


def test_sequence_parallel_off_or_at_tp_1_changes_nothing():
    cfg = get_model("llama", "tiny", **MODELS["llama"])
    x = torch.zeros(2, 6, dtype=torch.long)
    plain = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=SEED)
    with sequence_parallel(True):  # one process: tp=1, nothing to split
        also = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), seed=SEED)
    assert not any(is_sequence_parallel(p) for p in also.parameters())
    assert torch.equal(plain(x), also(x))
    assert not pipekit.Topology(sequence_parallel=True).sequence_parallel
    with pytest.raises(TypeError, match="sequence_parallel must be True or False, got 'yes'"):
        pipekit.Topology(sequence_parallel="yes")  # type: ignore[arg-type]


def test_sequence_collectives_give_shapes_on_meta_and_refusals():
    group = FakeGroup(4, 1)
    x = torch.empty(2, 8, 16, device="meta", requires_grad=True)
    assert reduce_scatter_sequence(x, group).shape == (2, 2, 16)
    assert gather_sequence(x, group).shape == (2, 32, 16)
    with pytest.raises(ValueError, match=r"size of dim 1=6 is not divisible by the tensor-parallel size 4"):
        reduce_scatter_sequence(torch.empty(2, 6, 16, device="meta"), group)
    cfg = get_model("mixtral", "tiny", vocab_size=32, max_seq_len=16, n_layers=1, dim=16, n_heads=4,
                    n_kv_heads=4, hidden=8, n_experts=4)
    with tensor_parallel(group), sequence_parallel(True), expert_tensor_parallel(group):
        with pytest.raises(ValueError, match=r"sequence parallelism at tp=4 does not support expert tensor "
                                             r"parallelism yet"):
            model_specs(cfg)[1].build(seed=SEED, index=1, device="meta")


def test_sequence_parallel_linears_save_only_the_slice_on_meta():
    """Sequence-parallel q/k/v, fc and gate/up keep their input's (B, T/tp, D) slice for backward,
    never the all-gathered (B, T, D) input (no other tensor of that shape is saved at these widths),
    and backward gives every gradient its tensor's shape (meta: shapes only, no communication)."""
    from pipekit.layers import CausalSelfAttention, ColumnParallelLinear
    from pipekit.layers.linear import column_parallel_linears
    from pipekit.layers.mlp import GeluMLP, SwiGLUMLP

    group, (b, t, d) = FakeGroup(2, 0), (2, 8, 16)
    with tensor_parallel(group), sequence_parallel(True), torch.device("meta"):
        parts = [CausalSelfAttention(d, 4, bias=True), GeluMLP(d, 48), SwiGLUMLP(d, 40)]
        plain = ColumnParallelLinear(d, 8, group=FakeGroup(2, 0))
    with tensor_parallel(group), torch.device("meta"):
        no_sp = ColumnParallelLinear(d, 8)
    for part in parts:
        x = torch.empty(b, t // 2, d, device="meta", requires_grad=True)
        saved: list[tuple] = []

        def pack(s: torch.Tensor, saved: list = saved) -> torch.Tensor:
            saved.append(tuple(s.shape))
            return s

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s):
            y = part(x)
        assert y.shape == x.shape, type(part).__name__
        assert (b, t // 2, d) in saved and (b, t, d) not in saved, (type(part).__name__, saved)
        y.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        for name, p in part.named_parameters():
            assert p.grad is not None and p.grad.shape == p.shape, (type(part).__name__, name)
    with pytest.raises(ValueError, match="one tp group and one sequence_parallel setting"):
        column_parallel_linears(torch.empty(b, t // 2, d, device="meta"), parts[0].q, plain)
    with pytest.raises(ValueError, match="one tp group and one sequence_parallel setting"):
        column_parallel_linears(torch.empty(b, t // 2, d, device="meta"), parts[0].q, no_sp)


def test_sequence_parallel_config_switch_and_its_refusals():
    from pipekit.config import ConfigError, load_config

    cfg = load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=64"])
    assert cfg.parallel.sequence_parallel is True
    assert load_config(None, []).parallel.sequence_parallel is False
    load_config(None, ["parallel.sequence_parallel=true", "train.seq_len=63"])  # tp=1: a no-op, accepted
    with pytest.raises(ConfigError, match=r"train.seq_len=63 is not divisible by parallel.tp=2, over which "
                                          r"parallel.sequence_parallel=true splits the sequence"):
        load_config(None, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=63"])
    moe = ["model.family=mixtral", "parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=64"]
    assert load_config(None, moe).parallel.sequence_parallel is True  # each tp rank routes its own slice
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel=true does not support "
                                          r"parallel.expert_tp=true yet"):
        load_config(None, [*moe, "parallel.expert_tp=true"])
    with pytest.raises(ConfigError, match="sequence_parallel"):
        load_config(None, ["parallel.sequence_parallel=maybe"])
