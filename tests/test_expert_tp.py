"""Expert tensor parallelism: each expert's hidden dim split over tp, equal to one process.

On 4 gloo ranks, float64: a Mixtral-style model and GPT-2 with MoE blocks
(16 experts, top-1, 4 tokens per microbatch and rank, so every microbatch
leaves most experts without a token on a rank, and each step some expert
without one anywhere) train 3 AdamW steps with global-norm clipping at
tp=2 (dp=2), tp=2 x ep=2 and (Mixtral) pp=2 x tp=2, `Topology(expert_tp=True)`. Every
rank checks its loss, the clipping norm, every local gradient and weight (an
expert shard against its (ep, tp) slice of the one-process tensor) within
1e-10. The aux and z losses are off: they are per-rank statistics, which
dp changes (tests/test_moe_model.py).

Checkpoints: the tp=2 x ep=2 expert-TP model's `full_state_dict` is the
one-process model's, and a DCP checkpoint it saves (weights and AdamW
state) is read back whole in one process, and resumed at tp=2 without
expert-TP, where one more step gives the weights the saving run gets.
"""

from __future__ import annotations

import copy

import pytest
import torch

import pipekit
from pipekit import LayerSpec
from pipekit.checkpoint import full_state_dict, load_checkpoint, load_full_weights, save_checkpoint
from pipekit.layers.parallel import expert_tensor_parallel
from pipekit.models import get_model, model_loss, model_specs
from pipekit.moe import MoEMLP, Router
from pipekit.testing import FakeGroup, Reference, in_float64, run_distributed

TOL = 1e-10
SEED = 7
BATCH, SEQ, STEPS, CLIP = 4, 4, 3, 0.05
MOE = dict(n_experts=16, top_k=1, aux_loss_coef=0.0, z_loss_coef=0.0)
MODELS = {
    "mixtral": dict(vocab_size=32, max_seq_len=16, n_layers=2, dim=16, n_heads=4, n_kv_heads=2, hidden=8, **MOE),
    "gpt2": dict(vocab_size=32, max_seq_len=16, n_layers=2, dim=16, n_heads=4, **MOE),
}
LAYOUTS = [(1, 2, 2, 1), (1, 2, 2, 2), (2, 1, 2, 1)]  # (pp, dp, tp, ep), all with expert_tp
CASES = [("mixtral", layout) for layout in LAYOUTS] + [("gpt2", layout) for layout in LAYOUTS[:2]]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _batches():
    gen = torch.Generator().manual_seed(5)
    while True:
        ids = torch.randint(0, 32, (BATCH, SEQ + 1), generator=gen)
        yield ids[:, :-1], ids[:, 1:]


def _engine(cfg, pp, dp, tp, ep, expert_tp=True):
    topo = pipekit.Topology(pp=pp, dp=dp, tp=tp, ep=ep, expert_tp=expert_tp)
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), topology=topo, seed=SEED,
                                    schedule="1f1b", microbatches=2)
    return pipekit.PipelineEngine(module, optimizer=_adamw(module.parameters()), clip_grad_norm=CLIP)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _step(engine, x, y):
    return engine.train_batch(iter([Reference.rows((x, y), engine.module.topology)]), reduce_loss=True)


@in_float64
def run_layout(family: str, layout: tuple, ckpt: str | None) -> dict:
    cfg = get_model(family, "tiny", **MODELS[family])
    specs = model_specs(cfg)
    engine = _engine(cfg, *layout)
    module, topo = engine.module, engine.module.topology
    ref = Reference(specs, model_loss(cfg).build(), _adamw, seed=SEED, clip=CLIP)
    split = [n for n, p in module.named_parameters() if getattr(p, "expert_parallel", False)
             and getattr(p, "tp_shard_dim", None) is not None]
    ref.compare(module, topo, grads=False, what="start")
    counts: list[torch.Tensor] = []  # tokens per expert of each reference MoE call
    for m in ref.model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(lambda mod, args, out: counts.append(out.counts_E))
    data = _batches()
    dead_in_a_step = 0
    for _ in range(STEPS):
        counts.clear()
        ref.train_beside(engine, next(data))
        dead_in_a_step += sum(int((c == 0).sum()) for c in counts)  # experts of a layer no token reached
        ref.compare(module, topo)
    out = {"worst": ref.worst, "split": sorted(split), "dead": dead_in_a_step, "norm_clipped": ref.grad_norm > CLIP}
    if ckpt is not None:
        out.update(_checkpoint_checks(cfg, engine, ref, layout, ckpt, data))
    return out


def _checkpoint_checks(cfg, engine, ref, layout, ckpt, data) -> dict:
    """Gathered weights against one process; save, resume at the same tp without expert-TP,
    one more step each: the same weights."""
    full = full_state_dict(engine.module)
    gathered = ref.compare(full, what="gathered")
    save_checkpoint(ckpt, engine.module, engine.optimizer)
    other = _engine(cfg, 1, layout[1] * layout[0], layout[2], 1, expert_tp=False)
    load_checkpoint(ckpt, other.module, other.optimizer)
    loaded = max(_diff(t, full[n]) for n, t in full_state_dict(other.module).items())
    x, y = next(data)
    _step(engine, x, y)
    _step(other, x, y)
    after, resumed = full_state_dict(engine.module), full_state_dict(other.module)
    return {"gathered": gathered, "loaded": loaded, "shapes": {n: tuple(t.shape) for n, t in full.items()},
            "resumed": max(_diff(t, after[n]) for n, t in resumed.items())}


def check(ckpt: str) -> list:
    return [run_layout(f, layout, ckpt if (f, layout) == CASES[1] else None) for f, layout in CASES]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("etp") / "ckpt")
    return run_distributed(check, 4, ckpt, timeout=400), ckpt


def test_expert_tp_layouts_match_one_process_with_experts_no_token_reaches(results):
    per_rank, _ = results
    for rank, res in enumerate(per_rank):
        for (family, layout), r in zip(CASES, res):
            where = f"rank {rank}, {family} (pp, dp, tp, ep)={layout}"
            for what, diff in r["worst"].items():
                assert diff <= TOL, f"{where}: {what} differs by {diff:.3g}"
            assert r["dead"] > 0, f"{where}: every expert got a token in every step; the test lost its point"
            assert r["norm_clipped"], f"{where}: the clipping never acted"
            names = {"mixtral": ("w_gate", "w_up", "w_down"), "gpt2": ("w_fc", "w_proj", "b_fc")}[family]
            assert r["split"] and all(n.rsplit(".", 1)[1] in names for n in r["split"]), (where, r["split"])


def test_an_expert_tp_checkpoint_is_the_full_model_at_any_layout(results):
    per_rank, ckpt = results
    for rank, res in enumerate(per_rank):
        r = res[1]
        assert r["gathered"] <= TOL and r["loaded"] == 0.0, f"rank {rank}: {r['gathered']}, {r['loaded']}"
        assert r["resumed"] <= TOL, f"rank {rank}: resumed without expert-TP differs by {r['resumed']:.3g}"
    _, weights = load_full_weights(ckpt)  # one process, as tp=1 reads it
    shapes = per_rank[0][1]["shapes"]
    assert {n: tuple(t.shape) for n, t in weights.items()} == shapes
    assert weights["layers.1.mlp.experts.w_gate"].shape == (16, 16, 8)  # all experts, the whole hidden


def test_expert_tp_splits_hidden_and_refuses_an_indivisible_one():
    from pipekit.config import ConfigError, load_config
    from pipekit.moe import Experts

    with pytest.raises(ValueError, match=r"the experts' hidden=6 is not divisible by the tensor-parallel size 4"):
        Experts(8, 6, 4, tp_group=FakeGroup(4, 1))
    base = ["model.family=mixtral", "model.hidden=12", "parallel.tp=8", "parallel.expert_tp=true",
            "model.n_heads=8", "model.n_kv_heads=8", "model.dim=64"]
    with pytest.raises(ConfigError, match=r"model.hidden=12 \(each expert's width\) is not divisible by "
                                          r"parallel.tp=8"):
        load_config(None, base)
    with pytest.raises(ConfigError, match=r"parallel.expert_tp=true splits MoE experts over tp, but "
                                          r"model.family=gpt2 has none"):
        load_config(None, ["parallel.tp=2", "parallel.expert_tp=true"])


def test_expert_tp_shards_are_slices_of_the_one_process_experts():
    for act, bias, split in (("swiglu", False, {"w_gate": 2, "w_up": 2, "w_down": 1}),
                             ("gelu", True, {"w_fc": 2, "w_proj": 1, "b_fc": 1, "b_proj": None})):
        full = LayerSpec(MoEMLP, 12, 8, 8, 2, activation=act, bias=bias).build(seed=SEED, index=3)
        state = torch.get_rng_state()
        for tp, ep in ((2, 2), (4, 1)):
            for t in range(tp):
                with expert_tensor_parallel(FakeGroup(tp, t)):
                    part = LayerSpec(MoEMLP, 12, 8, 8, 2, activation=act, bias=bias,
                                     ep_group=FakeGroup(ep, ep - 1)).build(seed=SEED, index=3)
                n = 8 // ep
                for name, dim in split.items():
                    p = getattr(part.experts, name)
                    want = getattr(full.experts, name)[(ep - 1) * n:ep * n]
                    want = want if dim is None else want.chunk(tp, dim)[t]
                    assert torch.equal(p, want), (act, tp, t, name)
                    assert getattr(p, "tp_shard_dim", None) == dim and p.expert_parallel, (act, name)
                    assert getattr(getattr(copy.deepcopy(part).experts, name), "tp_shard_dim", None) == dim
                assert torch.equal(part.router.weight, full.router.weight)
                assert f"hidden split over tp={tp}" in repr(part.experts)
        assert torch.equal(torch.get_rng_state(), state)
