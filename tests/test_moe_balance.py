"""MoE balancing that does not depend on the layout, device-limited routing, token-drop policies.

Global-batch balancing (`model.global_balance`) under `pipekit train`, float64,
3 AdamW steps of a Mixtral-style model with a strong load-balancing loss and
the aux-free bias on: the loss curve at (micro_batch, dp) = (4, 1), (2, 2),
(1, 4) is the same to 1e-10 (the (2, 2) one at pp=2, the (1, 4) one at ep=2:
the pre-pass runs through the pipeline and the all-to-all), and without
global balancing the (4, 1) and (1, 4) curves differ (the per-microbatch loss
depends on the split). The multi-rank layouts share one spawned 4-rank
group; the (4, 1) ones run in this process.

The routing and drop checks use hand-made scores and routings.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from pipekit import auxloss
from pipekit.config import ConfigError, load_config
from pipekit.moe import MoEMLP, Router, plan_dispatch
from pipekit.run.loop import train
from pipekit.testing import run_distributed

BASE = ["model.family=mixtral", "model.n_layers=2", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2",
        "model.hidden=16", "model.n_experts=8", "model.top_k=2", "model.vocab_size=64", "model.aux_loss_coef=0.5",
        "model.bias_update_rate=0.01", "train.seq_len=8", "train.dtype=float64", "train.steps=3",
        "data.source=synthetic", "data.val_every=0", "logging.progress=false", "logging.tensorboard=false",
        "logging.log_every=1", "logging.peak_tflops=1", "optimizer.warmup_steps=1", "optimizer.lr=1e-2",
        "checkpoint.at_end=false", "schedule.microbatches=2"]
GLOBAL = ["model.global_balance=true"]
SPAWNED = {  # name: (micro_batch, dp) and the rest of the layout, on 4 ranks
    "global_2x2": GLOBAL + ["train.micro_batch=2", "parallel.dp=2", "parallel.pp=2"],
    "global_1x4": GLOBAL + ["train.micro_batch=1", "parallel.dp=4", "parallel.ep=2"],
    "local_1x4": ["train.micro_batch=1", "parallel.dp=4", "parallel.ep=2"],
}
IN_PROCESS = {"global_4x1": GLOBAL + ["train.micro_batch=4"], "local_4x1": ["train.micro_batch=4"]}


def _losses(out: str) -> list[float]:
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl")) if '"step"' in line]


def _train(tmp: str, runs: dict) -> dict:
    """{name: loss curve} of each run, read where rank 0 wrote it (elsewhere: {})."""
    for name, layout in runs.items():
        train(load_config(None, [*BASE, *layout, f"logging.out_dir={tmp}/{name}"]))
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return {name: _losses(f"{tmp}/{name}") for name in runs}


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("balance"))
    return {**run_distributed(_train, 4, tmp, SPAWNED, timeout=300)[0], **_train(tmp, IN_PROCESS)}


def test_global_balance_gives_the_same_loss_curve_at_any_micro_batch_and_dp(curves):
    want = curves["global_4x1"]
    assert len(want) == 3
    for name in ("global_2x2", "global_1x4"):
        assert curves[name] == pytest.approx(want, abs=1e-10), name


def test_per_microbatch_balance_depends_on_the_split(curves):
    assert curves["local_1x4"][0] == pytest.approx(curves["local_4x1"][0], abs=1e-10)  # same start
    assert abs(curves["local_1x4"][-1] - curves["local_4x1"][-1]) > 1e-6


def test_balance_settings_are_checked_before_launch():
    mixtral = ["model.family=mixtral"]
    for bad, match in [
        (["model.n_groups=3", "model.topk_groups=1"], r"n_groups=3 must be a positive int dividing n_experts=8"),
        (["model.n_groups=4"], r"n_groups=4 and topk_groups=None go together"),
        (["model.n_groups=8", "model.topk_groups=1"], r"top_k=2 exceeds the 1 experts of topk_groups=1"),
        (["model.token_drop_policy=score"], r"token_drop_policy='score' is not one of \['position', 'probs'\]"),
        (["model.pad_expert_input_to_capacity=true"], r"capacity_factor is None \(dropless\)"),
        (["model.bias_update_rate=-1"], r"bias_update_rate must be a finite number >= 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, [*mixtral, *bad])


def test_a_layer_refuses_what_global_balance_cannot_go_with():
    with pytest.raises(ValueError, match=r"global_balance=True .* jitter=0.1 draws new noise"):
        MoEMLP(8, 8, 4, 2, global_balance=True, jitter=0.1)
    with pytest.raises(ValueError, match=r"global_balance=True .* use bias_update='step'"):
        MoEMLP(8, 8, 4, 2, global_balance=True, bias_update_rate=0.1)
    with pytest.raises(ValueError, match=r"pad_to_capacity=True .* capacity_factor=None"):
        MoEMLP(8, 8, 4, 2, pad_to_capacity=True)
    assert MoEMLP(8, 8, 4, 2, global_balance=True).needs_prepass
    assert not MoEMLP(8, 8, 4, 2, global_balance=True, aux_loss_coef=0.0).needs_prepass  # nothing to balance


def test_global_balance_takes_f_from_the_step_and_p_from_the_call():
    """Two halves of a batch, each a call after the pre-pass (each weighted 1/2, as the engine
    weighs microbatches): their mean loss and its gradient are those of the whole batch in one
    call, and differ from the halves' own per-call losses."""
    torch.manual_seed(0)
    layer = MoEMLP(6, 4, 4, 2, global_balance=True, aux_loss_coef=1.0, init_std=0.5).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    whole = layer.router(x.reshape(-1, 6))
    whole.aux_loss.backward()
    want = layer.router.weight.grad.clone()
    layer.zero_grad()
    with torch.no_grad(), auxloss.prepass([layer], None):
        for half in x:
            layer(half)
    assert torch.equal(layer.step_load, whole.counts_E)
    assert auxloss.metrics.pop() == {}  # the pre-pass records nothing
    for half in x:
        with auxloss.scaled_backward(0.5):
            (layer(half) * 0).sum().backward()  # only the aux loss reaches the router
    aux_sum, calls = auxloss.metrics.pop()["moe/aux_loss"]
    assert calls == 2 and aux_sum.item() / 2 == pytest.approx(whole.aux_loss.item(), abs=1e-6)  # recorded in fp32
    torch.testing.assert_close(layer.router.weight.grad, want, atol=1e-14, rtol=0)
    own = [layer.router(half).aux_loss.item() for half in x]  # per call: another loss
    assert abs(sum(own) / 2 - whole.aux_loss.item()) > 1e-4
    layer.end_step(None)
    assert not layer._step_load_ready


# ---- device-limited routing ------------------------------------------------------------
def _routers(E: int, K: int, n_groups: int, topk_groups: int, score: str = "softmax") -> tuple[Router, Router]:
    limited = Router(E, E, K, score, n_groups=n_groups, topk_groups=topk_groups).double()
    plain = Router(E, E, K, score).double()
    with torch.no_grad():
        limited.weight.copy_(torch.eye(E))
        plain.weight.copy_(torch.eye(E))  # identity: a token's logits are its features
    return limited, plain


def test_group_limited_routing_picks_groups_by_their_top_two_scores():
    """Sigmoid scores of [3, -5, 2, 2]: expert 0 is the best (0.95), but group {2, 3} (0.88 + 0.88)
    beats group {0, 1} (0.95 + 0.01), so one group of two gives experts 2 and 3."""
    limited, plain = _routers(4, 2, n_groups=2, topk_groups=1, score="sigmoid")
    x = torch.tensor([[3.0, -5.0, 2.0, 2.0], [3.0, 2.0, -5.0, 2.0]], dtype=torch.float64)
    assert sorted(plain(x).experts_TK[0].tolist()) != [2, 3]
    got = limited(x)
    assert sorted(got.experts_TK[0].tolist()) == [2, 3] and sorted(got.experts_TK[1].tolist()) == [0, 1]
    torch.testing.assert_close(got.weights_TK[0], torch.full((2,), 0.5, dtype=torch.float64))  # renormalised


def test_group_limited_routing_never_reaches_more_than_topk_groups():
    E, K, G, M = 16, 6, 8, 3
    limited, plain = _routers(E, K, G, M)
    x = torch.randn(256, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 3
    groups_T = [len(set(row)) for row in (limited(x).experts_TK // (E // G)).tolist()]
    assert max(groups_T) <= M
    assert max(len(set(row)) for row in (plain(x).experts_TK // (E // G)).tolist()) > M  # the limit binds
    assert (limited(x).counts_E.sum() == 256 * K).item()


def test_group_limited_routing_with_every_group_is_plain_top_k():
    limited, plain = _routers(16, 4, n_groups=4, topk_groups=4)
    x = torch.randn(64, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    a, b = limited(x), plain(x)
    assert torch.equal(a.experts_TK, b.experts_TK)
    torch.testing.assert_close(a.weights_TK, b.weights_TK, atol=0, rtol=0)
    torch.testing.assert_close(a.aux_loss, b.aux_loss, atol=0, rtol=0)


# ---- token-drop policies -------------------------------------------------------------
# Five tokens, top-2, 3 experts: capacity = ceil(0.6 * 5 * 2 / 3) = 2 slots per expert.
#   slot (t, k): expert, weight
#   t0: (0, .6) (1, .4)    t1: (0, .7) (2, .3)    t2: (1, .5) (0, .5)
#   t3: (0, .9) (2, .1)    t4: (2, .8) (1, .2)
# expert 0 holds t0 .6, t1 .7, t2 .5, t3 .9: position keeps t0, t1; probs keeps t3, t1.
# expert 1 holds t0 .4, t2 .5, t4 .2: position keeps t0, t2; probs keeps t2, t0.
# expert 2 holds t1 .3, t3 .1, t4 .8: position keeps t1, t3; probs keeps t4, t1.
EXPERTS_TK = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 2], [2, 1]])
WEIGHTS_TK = torch.tensor([[.6, .4], [.7, .3], [.5, .5], [.9, .1], [.8, .2]], dtype=torch.float64)
KEPT = {"position": [[0, 1], [0, 2], [1, 3]], "probs": [[3, 1], [2, 0], [4, 1]]}  # tokens kept, by expert


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_each_drop_policy_keeps_the_slots_it_names(policy):
    plan = plan_dispatch(EXPERTS_TK, WEIGHTS_TK, 3, capacity_factor=0.6, drop_policy=policy)
    assert plan.counts_E.tolist() == [2, 2, 2] and plan.dropped.item() == 4
    assert plan.token_N.tolist() == [t for kept in KEPT[policy] for t in kept]  # by expert, in the policy's order
    want = {(t, e): w for t, (es, ws) in enumerate(zip(EXPERTS_TK.tolist(), WEIGHTS_TK.tolist()))
            for e, w in zip(es, ws)}
    assert plan.weight_N.tolist() == [want[t, e] for e, kept in enumerate(KEPT[policy]) for t in kept]


def test_padding_to_capacity_fills_each_expert_with_zero_weight_rows():
    experts_TK = torch.tensor([[0, 1], [0, 1], [0, 2]])  # capacity ceil(1.0 * 3 * 2 / 3) = 2
    weights_TK = torch.tensor([[.6, .4], [.7, .3], [.9, .1]], dtype=torch.float64)
    plan = plan_dispatch(experts_TK, weights_TK, 3, capacity_factor=1.0, drop_policy="probs", pad_to_capacity=True)
    assert plan.sizes() == [2, 2, 2] and plan.dropped.item() == 1  # expert 0: t0 dropped
    assert plan.counts_E.tolist() == [2, 2, 1]  # the kept slots per expert
    assert plan.token_N.tolist()[:5] == [2, 1, 0, 1, 2]  # expert 2's second row is padding (some token) ...
    assert plan.weight_N.tolist() == [.9, .7, .4, .3, .1, 0.0]  # ... of weight 0


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_padding_to_capacity_changes_no_output_or_gradient(policy):
    def run(pad: bool):
        torch.manual_seed(0)
        layer = MoEMLP(6, 5, 4, 2, capacity_factor=1.0, drop_policy=policy, pad_to_capacity=pad,
                       init_std=0.5).double()
        x = torch.randn(3, 7, 6, dtype=torch.float64, requires_grad=True)
        out = layer(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
        return out.detach(), x.grad, [p.grad for p in layer.parameters()], auxloss.metrics.pop()

    out, dx, grads, recorded = run(False)
    out_p, dx_p, grads_p, recorded_p = run(True)
    assert recorded["moe/dropped"][0].item() > 0  # capacity binds
    torch.testing.assert_close(out_p, out, atol=1e-14, rtol=0)
    torch.testing.assert_close(dx_p, dx, atol=1e-14, rtol=0)
    for a, b in zip(grads_p, grads):
        torch.testing.assert_close(a, b, atol=1e-14, rtol=0)
