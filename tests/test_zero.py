"""ZeRO stages 0-2 with fp32 master weights: every layout trains the one-process model.

Each layout trains a tiny GPT-2 (tied embedding/head, float64) for 5 AdamW
steps with global-norm clipping through `ZeroOptimizer`, and every rank
checks every local weight (a tp shard against its slice) and the clipping
norm against `torch.optim.AdamW` + `clip_grad_norm_` on one plain
`nn.Sequential`, within 1e-10. Buckets are made tiny so that every stage has
several and stage 2's in-order, during-backward reduce-scatters are exercised.
A toy model whose second of four pipeline stages is a lone parameterless
function checks that a rank with nothing to optimise still joins the norm.
At dp=2, fused AdamW (`fused=True`: pipekit.kernels.adamw, whose float64 side is its
reference) trains the same model, and equals the unfused optimizer bit for bit with an
fp16-style overflow on one rank only (tests/test_kernels_adamw.py has its one-rank checks).
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_adamw import fused_equals_unfused_at_dp

import pipekit
from pipekit.models import get_model, model_loss, model_specs
from pipekit.models.toy import ToyConfig, lm_loss, toy_lm
from pipekit.optim import LossScaler, ZeroOptimizer, reducer
from pipekit.spec import LayerSpec
from pipekit.testing import Reference, in_float64, run_distributed

TOL = 1e-10
SEED, STEPS, BATCH, SEQ, CLIP, LR, WD = 7, 5, 8, 6, 0.3, 2e-2, 0.1
GPT = dict(vocab_size=32, max_seq_len=16, n_layers=3, dim=16, n_heads=4)
TINY_BUCKETS = 0.002  # MB: a few hundred float64 elements per bucket

# (pp, dp, tp, zero stage, microbatches[, chunks per rank: interleaved 1F1B])
LAYOUTS = {
    2: [(1, 2, 1, 0, 2), (1, 2, 1, 1, 2), (1, 2, 1, 2, 2),
        (1, 2, 1, 0, 2, 2), (1, 2, 1, 1, 2, 2)],  # pp=1 x 2 chunks: the tied pair in two stages of one rank
    4: [(1, 4, 1, 1, 2), (1, 4, 1, 2, 2), (2, 2, 1, 1, 4), (2, 2, 1, 2, 4), (1, 2, 2, 1, 2), (1, 2, 2, 2, 2),
        (2, 2, 1, 1, 4, 2)],
    8: [(2, 4, 1, 2, 2), (2, 2, 2, 1, 2), (2, 2, 2, 2, 2)],
}


def _gpt_batches():
    gen = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        ids = torch.randint(0, GPT["vocab_size"], (BATCH, SEQ + 1), generator=gen)
        yield ids[:, :-1], ids[:, 1:]


def _decay_groups(params):
    params = list(params)
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


@in_float64
def train_and_compare(specs, loss, ref_loss_fn, batches, *, pp, dp, tp, stage, microbatches, chunks=1,
                      optimizer="adamw", partition="parameters", fused=False, **hyper) -> dict:
    """Train `specs` at a layout with ZeroOptimizer and the reference with the torch optimizer."""
    topo = pipekit.Topology(pp=pp, dp=dp, tp=tp)
    module = pipekit.PipelineModule(specs, loss_fn=loss, topology=topo, seed=SEED, partition=partition,
                                    schedule="interleaved_1f1b" if chunks > 1 else "1f1b", microbatches=microbatches,
                                    chunks_per_rank=chunks)
    opt = ZeroOptimizer(_decay_groups(module.parameters()), optimizer, module=module, stage=stage,
                        bucket_mb=TINY_BUCKETS, lr=LR, fused=fused, **hyper)
    engine = pipekit.PipelineEngine(module, optimizer=opt, clip_grad_norm=CLIP)
    torch_opt = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    ref = Reference(specs, ref_loss_fn, lambda params: torch_opt(_decay_groups(params), lr=LR, **hyper), seed=SEED,
                    clip=CLIP)
    for batch in batches():
        ref.train_beside(engine, batch)
    ref.compare(module, topo, grads=False)
    return ref.worst


def gpt_layout(pp, dp, tp, stage, microbatches, chunks=1) -> dict:
    cfg = get_model("gpt2", "tiny", **GPT)
    return train_and_compare(model_specs(cfg), model_loss(cfg), model_loss(cfg).build(), _gpt_batches,
                             pp=pp, dp=dp, tp=tp, stage=stage, microbatches=microbatches, chunks=chunks)


def _toy_batches():
    gen = torch.Generator().manual_seed(9)
    for _ in range(STEPS):
        x = torch.randint(0, 24, (BATCH, SEQ), generator=gen)
        yield x, (5 * x + 3) % 24


def toy_parameterless_stage(stage) -> dict:
    """pp=4 with stage 1 = the lone `drop_positions` function: no parameters on rank 1."""
    specs = toy_lm(ToyConfig(vocab=24, dim=8, wide_dim=12, blocks=2))
    return train_and_compare(specs, lm_loss, lm_loss, _toy_batches, pp=4, dp=1, tp=1, stage=stage, microbatches=4,
                             partition=[0, 8, 9, 10, 11])


def sgd_layout(stage) -> dict:
    cfg = get_model("gpt2", "tiny", **GPT)
    return train_and_compare(model_specs(cfg), model_loss(cfg), model_loss(cfg).build(), _gpt_batches,
                             pp=1, dp=2, tp=1, stage=stage, microbatches=2, optimizer="sgd", momentum=0.9)


def nccl_collectives_layout(stage) -> dict:
    """The NCCL branch of the collectives (reduce_scatter_tensor, all_gather_into_tensor), which
    gloo also implements, run here by making the optimizer believe its group is not gloo."""
    from pipekit.optim import zero

    real = zero._is_gloo
    zero._is_gloo = lambda group: False
    try:
        return gpt_layout(1, 2, 1, stage, 2)
    finally:
        zero._is_gloo = real


class EmbedKeepIds(torch.nn.Module):
    """ids -> (hidden, ids): the ids travel on to `Sometimes`."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, dim) * 0.1)

    def forward(self, ids):
        return self.table[ids], ids


class Sometimes(torch.nn.Module):
    """`rare` is used only when token 0 occurs (else it gets no gradient), `never` never."""

    def __init__(self, dim: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(dim, dim) * 0.1)
        self.rare = torch.nn.Parameter(torch.ones(dim, dim))
        self.never = torch.nn.Parameter(torch.ones(dim, dim))

    def forward(self, x):
        h, ids = x
        h = torch.tanh(h @ self.w)
        hit = ids == 0
        if h.is_meta or hit.any():  # (the engine's shape run is on the meta device: no values)
            h = h + hit[..., None] * (h @ self.rare)
        return h


def _sometimes_batches():
    """Token 0 nowhere in step 1, only in dp rank 1's rows in step 2, only in rank 0's in step 3."""
    gen = torch.Generator().manual_seed(3)
    for hit_rows in ([], [6], [1], [], [2, 5]):
        x = torch.randint(1, 12, (BATCH, SEQ), generator=gen)
        for r in hit_rows:
            x[r, 2] = 0
        yield x, (5 * x + 3) % 12


def fused_layout(stage) -> dict:
    """Fused AdamW (pipekit.kernels.adamw; float64 takes its reference) at dp=2."""
    cfg = get_model("gpt2", "tiny", **GPT)
    return train_and_compare(model_specs(cfg), model_loss(cfg), model_loss(cfg).build(), _gpt_batches,
                             pp=1, dp=2, tp=1, stage=stage, microbatches=2, fused=True)


def untouched_parameters_layout(stage, fused=False) -> dict:
    """A parameter that gets no gradient anywhere (`never`; `rare` in steps 1 and 4) is left
    alone by the step, weight decay, moments and step count included, as torch's AdamW leaves
    a parameter whose .grad is None; one used on one dp rank only is updated on both."""
    specs = [LayerSpec(EmbedKeepIds, 12, 8), LayerSpec(Sometimes, 8), LayerSpec(torch.nn.Linear, 8, 12)]
    return train_and_compare(specs, lm_loss, lm_loss, _sometimes_batches, pp=1, dp=2, tp=1, stage=stage,
                             microbatches=2, fused=fused)


def run_world(world: int) -> list:
    out = [gpt_layout(*layout) for layout in LAYOUTS[world]]
    if world == 2:
        out += [sgd_layout(1), sgd_layout(2), nccl_collectives_layout(1), nccl_collectives_layout(2)]
        out += [untouched_parameters_layout(stage) for stage in (0, 1, 2)]
        out += [fused_layout(1), fused_layout(2), untouched_parameters_layout(2, fused=True)]
        out += [fused_equals_unfused_at_dp(1), fused_equals_unfused_at_dp(2)]
    if world == 4:
        out += [toy_parameterless_stage(1), toy_parameterless_stage(2)]
    return out


def _names(world: int) -> list[str]:
    names = [f"(pp, dp, tp)={layout[:3]} ZeRO-{layout[3]} chunks={layout[5] if len(layout) > 5 else 1}"
             for layout in LAYOUTS[world]]
    if world == 2:
        names += ["SGD ZeRO-1", "SGD ZeRO-2", "NCCL-branch collectives ZeRO-1", "NCCL-branch collectives ZeRO-2"]
        names += [f"untouched parameters ZeRO-{stage}" for stage in (0, 1, 2)]
        names += ["fused AdamW ZeRO-1", "fused AdamW ZeRO-2", "fused AdamW, untouched parameters ZeRO-2"]
        names += ["fused vs unfused, fp16 overflow on rank 1, ZeRO-1", "fused vs unfused, ... ZeRO-2"]
    if world == 4:
        names += ["parameterless stage ZeRO-1", "parameterless stage ZeRO-2"]
    return names


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_zero_stages_train_the_single_process_model(world):
    for rank, results in enumerate(run_distributed(run_world, world, world, timeout=600)):
        for name, worst in zip(_names(world), results):
            for what, diff in worst.items():
                assert diff <= TOL, f"rank {rank}, {name}: {what} differs by {diff:.3g}"


def test_one_rank_zero_is_plain_adamw_in_a_plain_loop():
    """No pipeline, no process group: ZeroOptimizer over an nn.Module in a hand-written loop."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
    ref.load_state_dict(model.state_dict())
    for stage in (0, 1, 2):
        m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
        m.load_state_dict(model.state_dict())
        r = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
        r.load_state_dict(model.state_dict())
        opt = ZeroOptimizer(m, "adamw", stage=stage, lr=0.1, weight_decay=0.3, clip_grad_norm=0.5)
        ref_opt = torch.optim.AdamW(r.parameters(), lr=0.1, weight_decay=0.3)
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(4, 6, generator=gen, dtype=torch.float64)
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
            ref_opt.zero_grad()
            r(x).square().mean().backward()
            norm = torch.nn.utils.clip_grad_norm_(r.parameters(), 0.5).item()
            ref_opt.step()
            assert abs(opt.last_grad_norm - norm) <= TOL
        for a, b in zip(m.parameters(), r.parameters()):
            assert (a - b).abs().max().item() <= TOL, f"stage {stage}"
        assert opt.master_dtype == torch.float64  # float64 models keep float64 masters: no precision lost


def test_accumulation_hooks_once_per_step_and_skips_untouched(monkeypatch):
    """Gradient accumulation in a plain loop (3 backward calls per step): a parameter used only in
    the last microbatch counts as touched, one never used is skipped (as torch skips grad None),
    weights equal torch's AdamW; at stages 0/1 (gradients accumulate in the bucket in place) each
    parameter's hook runs once per step, not per microbatch; a backward after step() without
    zero_grad() is still refused by the re-armed hook. This is the hooks path: with no dp group,
    stages 0/1 arm none by default (`reducer.HOOK_FREE`; tests/test_hook_free.py)."""
    monkeypatch.setattr(reducer, "HOOK_FREE", False)
    calls = []
    on_grad = ZeroOptimizer._on_grad

    def counted(self, p):
        calls.append(id(p))
        on_grad(self, p)

    monkeypatch.setattr(ZeroOptimizer, "_on_grad", counted)

    def make():
        torch.manual_seed(0)
        return torch.nn.ModuleList(torch.nn.Linear(4, 4).double() for _ in range(3))

    def loss(m, x, micro):
        y = m[0](x)
        if micro == 2:
            y = m[1](y)  # m[1] only in the last microbatch; m[2] never
        return y.square().mean()

    gen = torch.Generator().manual_seed(1)
    batches = [[torch.randn(2, 4, generator=gen, dtype=torch.float64) for _ in range(3)] for _ in range(3)]
    ref = make()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    for xs in batches:
        ref_opt.zero_grad()
        for i, x in enumerate(xs):
            loss(ref, x, i).backward()
        ref_opt.step()
    for stage in (0, 1, 2):
        m = make()
        opt = ZeroOptimizer(m, "adamw", stage=stage, lr=0.1)
        for xs in batches:
            opt.zero_grad()
            calls.clear()
            for i, x in enumerate(xs):
                loss(m, x, i).backward()
            used = 4 if stage < 2 else 2 * 3 + 2  # m[0]'s two tensors every microbatch, m[1]'s once
            assert len(calls) == used, f"stage {stage}: {len(calls)} hook calls"
            opt.step()
        for a, b in zip(m.parameters(), ref.parameters()):
            assert (a - b).abs().max().item() <= TOL, f"stage {stage}"
        if stage < 2:
            with pytest.raises(RuntimeError, match="after its bucket was reduced"):
                loss(m, batches[0][0], 0).backward()


def test_master_weights_are_float32_for_a_bf16_model():
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = ZeroOptimizer(model, "adamw", stage=0, lr=1e-3)
    assert model.weight.dtype == torch.bfloat16
    assert all(b.master.dtype == torch.float32 for b in opt.buckets)
    mem = opt.memory_bytes()
    n = 8 * 4 + 4
    assert mem["params"] == 2 * n and mem["master"] == 4 * n and mem["grads"] == 4 * n


def test_loss_scaler_follows_deepspeed_hysteresis_and_window():
    s = LossScaler(initial_scale_power=4, scale_window=3, hysteresis=2, min_scale=2.0)
    s.update(True)
    assert s.scale == 16  # the first overflow uses up the tolerance
    s.update(True)
    assert s.scale == 8
    s.update(True)
    assert s.scale == 4
    for _ in range(3):
        s.update(False)
    assert s.scale == 4  # DeepSpeed's window: 3 clean steps in a row, then it doubles on the next clean one
    s.update(False)
    assert s.scale == 8 and s.tolerance == 2
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0  # never below min_loss_scale
    assert s.skipped_steps == 8
    assert LossScaler(static_scale=128.0).scale == 128.0
    with pytest.raises(ValueError, match="hysteresis must be >= 1, got 0"):
        LossScaler(hysteresis=0)


def test_bad_stage_and_optimizer_are_named():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"ZeRO stage must be 0, 1, 2 or 3 \(an int\), got 4"):
        ZeroOptimizer(model, stage=4)
    with pytest.raises(ValueError, match="ZeRO stage 3 shards the layers of a PipelineModule"):
        ZeroOptimizer(model, stage=3)
    with pytest.raises(ValueError, match="'lamb' is not one of"):
        ZeroOptimizer(model, "lamb")
    # the checks torch's optimizers make on their arguments, made on every param group
    with pytest.raises(ValueError, match="lr=-1 must be a finite number >= 0"):
        ZeroOptimizer(model, lr=-1)
    with pytest.raises(ValueError, match=r"lr=nan \(param group 1\) must be a finite number >= 0"):
        ZeroOptimizer([{"params": [model.weight]}, {"params": [model.bias], "lr": float("nan")}], module=model)
    with pytest.raises(ValueError, match=r"betas=\(0.9, 1.0\) must each be in \[0, 1\)"):
        ZeroOptimizer(model, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="weight_decay=-0.1 must be a finite number >= 0"):
        ZeroOptimizer(model, weight_decay=-0.1)
