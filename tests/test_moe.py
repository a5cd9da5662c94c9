"""MoEMLP against a dense loop-over-experts oracle, capacity drops by hand, the router's
losses and bias, seeding per global expert, and expert parallelism over gloo.

The oracle (`reference_moe`) runs every expert on every token and masks by
the router's choice, litgpt's shape: it shares no code with the dispatch
(no sorting, no grouped matmul, no index_add). Comparisons run in float64 to
1e-10. The expert-parallel checks share ONE spawned group of 4 ranks: ep=2
(two groups of 2) and ep=4 against ep=1 on each rank's own tokens.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipekit import LayerSpec
from pipekit.auxloss import metrics, scaled_backward
from pipekit.layers import tensor_parallel
from pipekit.layers.parallel import expert_parallel
from pipekit.moe import (
    GEMMS,
    AllToAllDispatcher,
    Experts,
    LocalDispatcher,
    MoEMLP,
    apply_bias_updates,
    capacity,
    dispatch,
    register_dispatcher,
)
from pipekit.moe.grouped import grouped_mm_runs, megablocks_available
from pipekit.testing import FakeGroup, in_float64, run_distributed

SEED = 1234
TOL = dict(atol=1e-10, rtol=1e-10)


@pytest.fixture(autouse=True)
def float64_and_no_metrics(float64):
    """Every test here in float64 (conftest.py), without an earlier test's MoE metrics."""
    metrics.pop()


# ---- the oracle ------------------------------------------------------------------
def expert_forward(experts, e: int, x):
    """Global expert e (held at local index e - experts.first) on every row of x."""
    i = e - experts.first
    if experts.activation == "swiglu":
        return (F.silu(x @ experts.w_gate[i]) * (x @ experts.w_up[i])) @ experts.w_down[i]
    h = x @ experts.w_fc[i] + (experts.b_fc[i] if experts.bias else 0)
    return F.gelu(h, approximate="tanh") @ experts.w_proj[i] + (experts.b_proj[i] if experts.bias else 0)


def shared_forward(shared, x):
    if shared.activation == "swiglu":
        return (F.silu(x @ shared.gate.T) * (x @ shared.up.T)) @ shared.down.T
    h = x @ shared.fc.T + (shared.fc_bias if shared.bias else 0)
    return F.gelu(h, approximate="tanh") @ shared.proj.T + (shared.proj_bias if shared.bias else 0)


def reference_routing(router, x_TD):
    """(top experts (T, K), combine weights (T, K), logits (T, E), scores (T, E)), written out."""
    logits = x_TD @ router.weight.T
    scores = logits.softmax(-1) if router.score == "softmax" else logits.sigmoid()
    select = scores if router.expert_bias is None else scores + router.expert_bias.to(scores.dtype)
    top = select.topk(router.top_k, dim=-1).indices
    w = scores.gather(1, top)
    if router.renormalize:
        w = w / w.sum(-1, keepdim=True)
    return top, w, logits, scores


def reference_moe(layer, x, dropped: set[tuple[int, int]] = frozenset()):
    """Each token: sum over its top-k experts e, (t, e) not in `dropped`, of weight * expert_e(x_t)."""
    x_TD = x.reshape(-1, x.shape[-1])
    top, w, _, _ = reference_routing(layer.router, x_TD)
    keep = torch.tensor([[(t, int(e)) not in dropped for e in row] for t, row in enumerate(top)], dtype=w.dtype)
    w = w * keep
    out = torch.zeros_like(x_TD)
    for e in range(layer.router.n_experts):
        gate_T1 = (w * (top == e)).sum(-1, keepdim=True)
        out = out + gate_T1 * expert_forward(layer.experts, e, x_TD)
    if layer.shared is not None:
        out = out + shared_forward(layer.shared, x_TD)
    return out.view_as(x)


def reference_losses(router, x_TD):
    """Switch aux loss E * sum f_i P_i (f over token-slots) and the z-loss, by hand."""
    top, _, logits, scores = reference_routing(router, x_TD)
    T, K, E = top.shape[0], router.top_k, router.n_experts
    f = torch.stack([(top == e).sum() for e in range(E)]).to(scores.dtype) / (T * K)
    probs = scores if router.score == "softmax" else scores / scores.sum(-1, keepdim=True)
    aux = E * (f * probs.mean(0)).sum()
    z = (torch.log(torch.exp(logits).sum(-1)) ** 2).mean()
    return aux, z


# ---- helpers ---------------------------------------------------------------------
def build(dim=12, hidden=8, n_experts=16, top_k=4, index=3, router_std=1.0, **kw):
    """An MoEMLP built as a pipeline builds it, with a router wide enough that no top-k is near a tie."""
    kw.setdefault("aux_loss_coef", 0.0)
    layer = LayerSpec(MoEMLP, dim, hidden, n_experts, top_k, **kw).build(seed=SEED, index=index)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, router_std, generator=torch.Generator().manual_seed(7))
    return layer


def run(layer, x, g):
    """Output and gradients of sum(layer(x) * g) (parameter grads by name)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = layer(x)
    (out * g).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def run_reference(layer, x, g, **kw):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = reference_moe(layer, x, **kw)
    (out * g).sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def assert_same(got, want):
    out, xg, grads = got
    out_r, xg_r, grads_r = want
    torch.testing.assert_close(out, out_r, **TOL)
    torch.testing.assert_close(xg, xg_r, **TOL)
    assert sorted(grads) == sorted(grads_r)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_r[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def inputs(shape=(2, 9, 12), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)


# ---- dropless against the oracle -------------------------------------------------
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_dropless_matches_dense_loop_reference(score, renormalize, activation):
    shared = dict(n_shared_experts=2) if activation == "swiglu" else dict(n_shared_experts=1, shared_hidden=6)
    layer = build(score=score, renormalize=renormalize, activation=activation, bias=activation == "gelu",
                  **shared)  # fine-grained: E=16, top_k=4, hidden=8
    x, g = inputs()
    got, want = run(layer, x, g), run_reference(layer, x, g)
    assert_same(got, want)
    assert {"router.weight", "experts.w_gate" if activation == "swiglu" else "experts.w_fc"} <= set(got[2])
    if activation == "gelu":  # zero-initialised biases still get their gradients
        assert got[2]["experts.b_proj"].abs().sum() > 0


@pytest.mark.parametrize("kw", [dict(n_experts=4, top_k=1), dict(n_experts=8, top_k=2, dim=16, hidden=24),
                                dict(n_experts=3, top_k=3)], ids=["switch_top1", "mixtral_like", "all_experts"])
def test_dropless_other_shapes_match_reference(kw):
    layer = build(**kw)
    x, g = inputs((3, 4, kw.get("dim", 12)))
    assert_same(run(layer, x, g), run_reference(layer, x, g))
    assert layer.router.renormalize == (kw["top_k"] > 1)


def test_half_precision_routes_in_float32():
    layer = build().to(torch.bfloat16)
    x = torch.randn(2, 9, 12).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    routing = layer.router(x.reshape(-1, 12))
    assert routing.weights_TK.dtype == torch.float32 and routing.aux_loss.dtype == torch.float32
    ref = reference_moe(build(), x.double())
    torch.testing.assert_close(out.double(), ref, atol=0.05, rtol=0.05)


# ---- capacity ----------------------------------------------------------------------
# Router = identity (dim = E = 4), so each token's logits are its own first 4 features.
# Expert 0 is every token's choice; capacity = ceil(1.0 * 4 tokens * 2 / 4) = 2.
#   t0 [4, 3, 0, 0] -> {0, 1}   p0 = 0.71
#   t1 [3, 0, 4, 0] -> {2, 0}   p0 = 0.26
#   t2 [5, 0, 0, 1] -> {0, 3}   p0 = 0.96
#   t3 [1, 0, 0, 3] -> {3, 0}   p0 = 0.11
# position keeps (t0, 0) and (t1, 0); probs keeps (t2, 0) and (t0, 0). Expert 3 holds 2: nothing dropped there.
CAPACITY_LOGITS = [[4.0, 3.0, 0.0, 0.0], [3.0, 0.0, 4.0, 0.0], [5.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 3.0]]
DROPPED = {"position": {(2, 0), (3, 0)}, "probs": {(1, 0), (3, 0)}}


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_capacity_drops_exactly_the_slots_its_policy_names(policy):
    layer = build(dim=4, hidden=6, n_experts=4, top_k=2, capacity_factor=1.0, drop_policy=policy,
                  renormalize=False)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4))
    x = torch.tensor(CAPACITY_LOGITS).unsqueeze(0)  # (1, 4 tokens, dim 4)
    g = torch.randn(1, 4, 4, generator=torch.Generator().manual_seed(3))
    assert capacity(1.0, 4, 2, 4) == 2
    got = run(layer, x, g)
    assert_same(got, run_reference(layer, x, g, dropped=DROPPED[policy]))
    assert not torch.allclose(got[0], reference_moe(layer, x))  # the drops matter
    assert metrics.pop()["moe/dropped"][0].item() == 2


def test_capacity_drops_nothing_when_it_suffices_and_counts_rounding():
    assert capacity(1.25, 10, 2, 4) == 7 and capacity(0.1, 3, 1, 8) == 1
    x, g = inputs()
    layer = build(capacity_factor=16.0)  # capacity = T*K: never reached
    assert_same(run(layer, x, g), run_reference(layer, x, g))
    assert metrics.pop()["moe/dropped"][0].item() == 0


def test_capacity_plan_pads_every_expert_to_capacity_with_zero_weights():
    # E=4, T=4, K=2, capacity ceil(1.0 * 4 * 2 / 4) = 2: expert 0 has 4 slots (2 dropped), 2 and 3 one each
    experts_TK = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    weights_TK = torch.rand(4, 2, generator=torch.Generator().manual_seed(0))
    plan = dispatch.plan_dispatch(experts_TK, weights_TK, 4, capacity_factor=1.0, pad_to_capacity=True)
    assert plan.capacity == 2 and plan.sizes() == [2, 2, 2, 2] and plan.token_N.shape == (8,)
    assert plan.dropped == 2 and plan.counts_E.tolist() == [2, 2, 1, 1]
    real = [0, 1, 2, 3, 4, 6]  # rows of expert e are 2e, 2e+1; rows 5 and 7 are padding
    assert plan.token_N[real].tolist() == [0, 1, 0, 2, 1, 3]  # by position: earlier tokens win
    assert torch.equal(plan.weight_N[real], weights_TK[[0, 1, 0, 2, 1, 3], [0, 0, 1, 1, 1, 0]])
    assert plan.weight_N[[5, 7]].tolist() == [0.0, 0.0] and ((plan.token_N >= 0) & (plan.token_N < 4)).all()
    dropless = dispatch.plan_dispatch(experts_TK, weights_TK, 4)  # device counts, no padding
    assert dropless.capacity is None and dropless.sizes() is dropless.counts_E
    assert torch.equal(dropless.counts_E, torch.bincount(experts_TK.flatten(), minlength=4))


def test_a_token_with_every_slot_dropped_outputs_zero():
    layer = build(dim=4, hidden=6, n_experts=4, top_k=1, capacity_factor=0.5)  # capacity 1 of 4 tokens
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4))
    x = torch.tensor([[[5.0, 0, 0, 0], [4.0, 0, 0, 0], [0, 5.0, 0, 0], [3.0, 0, 0, 0]]])
    out = layer(x)
    assert out[0, 1].abs().max() == 0 and out[0, 3].abs().max() == 0
    assert out[0, 0].abs().max() > 0 and out[0, 2].abs().max() > 0
    assert metrics.pop()["moe/dropped"][0].item() == 2


# ---- the router's losses -----------------------------------------------------------
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_and_z_loss_values_equal_the_formulas(score):
    layer = build(score=score, router_std=0.3)
    x, _ = inputs()
    routing = layer.router(x.reshape(-1, 12))
    aux, z = reference_losses(layer.router, x.reshape(-1, 12))
    torch.testing.assert_close(routing.aux_loss, aux, **TOL)
    torch.testing.assert_close(routing.z_loss, z, **TOL)
    layer(x)
    recorded = metrics.pop()
    torch.testing.assert_close(recorded["moe/aux_loss"][0], aux.float())
    torch.testing.assert_close(recorded["moe/z_loss"][0], z.float())


def test_balanced_routing_gives_aux_one():
    """f_i = P_i = 1/E gives E * E * (1/E)^2 = 1, at any top_k."""
    router = build(dim=4, n_experts=4, top_k=2).router
    aux = router._aux(torch.full((8, 4), 0.25), torch.full((4,), 4))
    assert math.isclose(aux.item(), 1.0)


def test_hf_mixtral_aux_loss_is_top_k_times_ours():
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    layer = build(n_experts=8, top_k=2, router_std=0.3)
    x, _ = inputs()
    x_TD = x.reshape(-1, 12)
    ours = layer.router(x_TD).aux_loss
    theirs = mixtral.load_balancing_loss_func((x_TD @ layer.router.weight.T,), 8, top_k=2)
    torch.testing.assert_close(theirs.double(), 2 * ours, atol=1e-6, rtol=1e-6)  # HF counts in float32


@pytest.mark.parametrize("coefs", [(0.0, 0.0), (0.1, 0.0), (0.0, 0.01), (0.3, 0.05)])
def test_aux_gradients_arrive_through_attach(coefs):
    aux_coef, z_coef = coefs
    layer = build(aux_loss_coef=aux_coef, z_loss_coef=z_coef, router_std=0.3)
    x, g = inputs()
    run(layer, x, g)
    got = layer.router.weight.grad.clone()
    layer.zero_grad(set_to_none=True)  # the explicit sum, through the oracle
    xr = x.clone().requires_grad_(True)
    aux, z = reference_losses(layer.router, xr.reshape(-1, 12))
    ((reference_moe(layer, xr) * g).sum() + aux_coef * aux + z_coef * z).backward()
    torch.testing.assert_close(got, layer.router.weight.grad, **TOL)
    if coefs == (0.0, 0.0):
        return
    layer.zero_grad(set_to_none=True)  # the engine's scale reaches the aux term as the main loss's
    with scaled_backward(0.25):
        (layer(x) * g * 0.25).sum().backward()
    torch.testing.assert_close(layer.router.weight.grad, 0.25 * got, **TOL)


# ---- aux-loss-free balancing -------------------------------------------------------
def test_aux_free_bias_moves_toward_underloaded_experts():
    layer = build(n_experts=8, top_k=2, bias_update_rate=0.1)
    x, g = inputs()
    counts = torch.bincount(reference_routing(layer.router, x.reshape(-1, 12))[0].flatten(), minlength=8)
    assert counts.min() < counts.float().mean() < counts.max()
    layer.eval()
    layer(x)
    assert layer.router.expert_bias.abs().sum() == 0  # eval: no update
    layer.train()
    layer(x)
    want = 0.1 * torch.sign(counts.float().mean() - counts.float())
    torch.testing.assert_close(layer.router.expert_bias, want.float())
    assert (layer.router.expert_bias[counts < counts.float().mean()] > 0).all()
    assert (layer.router.expert_bias[counts > counts.float().mean()] < 0).all()


def test_aux_free_bias_changes_selection_not_combine_weights():
    layer = build(n_experts=8, top_k=2, bias_update_rate=0.1)
    layer.eval()
    x, g = inputs()
    before = reference_routing(layer.router, x.reshape(-1, 12))[0]
    with torch.no_grad():
        layer.router.expert_bias[5] = 10.0  # every token now selects expert 5 ...
    top, w, _, scores = reference_routing(layer.router, x.reshape(-1, 12))
    assert (top == 5).any(-1).all() and not (before == 5).any(-1).all()
    assert_same(run(layer, x, g), run_reference(layer, x, g))  # ... with its bias-free weight
    assert (w < 1).all()
    routing = layer.router(x.reshape(-1, 12))
    torch.testing.assert_close(routing.weights_TK, w, **TOL)


def test_bias_stays_float32_through_a_bf16_cast():
    layer = build(n_experts=8, top_k=2, bias_update_rate=0.01).to(torch.bfloat16)
    assert layer.router.expert_bias.dtype == torch.float32
    assert "router.expert_bias" in layer.state_dict() and "pending_load" not in layer.state_dict()
    layer(torch.randn(2, 9, 12, dtype=torch.bfloat16))
    assert layer.router.expert_bias.abs().min() == 0.01  # every expert moved by exactly the rate


def test_step_bias_update_goes_with_activation_checkpointing():
    layer = build(n_experts=8, top_k=2, bias_update_rate=0.1, bias_update="step")
    x, g = inputs()
    counts = torch.bincount(reference_routing(layer.router, x.reshape(-1, 12))[0].flatten(), minlength=8)
    for _ in range(2):  # two microbatches, each checkpointed: recomputation routes as the forward did
        xr = x.clone().requires_grad_(True)
        (torch.utils.checkpoint.checkpoint(layer, xr, use_reentrant=False) * g).sum().backward()
    assert layer.router.expert_bias.abs().sum() == 0 and torch.equal(layer.pending_load, 2 * counts)
    apply_bias_updates(torch.nn.Sequential(layer))  # once, after the optimizer step
    torch.testing.assert_close(layer.router.expert_bias, 0.1 * torch.sign(counts.float().mean() - counts.float()))
    assert layer.pending_load.sum() == 0


def test_forward_bias_update_under_checkpointing_is_a_clear_error():
    layer = build(n_experts=8, top_k=2, bias_update_rate=0.1, layer_index=4)
    x = torch.randn(2, 9, 12, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match=r"moe/4: bias_update='forward' .* use bias_update='step'"):
        out.sum().backward()


def test_jitter_only_in_training():
    layer = build(jitter=0.2)
    x, _ = inputs()
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    assert_same(run(layer, x, x), run_reference(layer, x, x))
    layer.train()
    torch.manual_seed(0)
    assert not torch.equal(layer(x), layer(x))


# ---- grouped matmuls (gemm) -------------------------------------------------------
def test_loop_and_grouped_mm_paths_agree():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    x = torch.randn(2, 9, 16, dtype=torch.float32)
    g = torch.randn(2, 9, 16, dtype=torch.float32)
    probe = torch.randn(4, 16, dtype=torch.float32)
    if not grouped_mm_runs(probe, torch.randn(2, 16, 32, dtype=torch.float32)):
        pytest.skip("torch._grouped_mm does not run on CPU float32 here")
    try:
        torch._grouped_mm(probe, torch.randn(2, 16, 32, dtype=torch.float32),
                          offs=torch.tensor([1, 4], dtype=torch.int32))
    except RuntimeError as e:
        pytest.skip(f"torch._grouped_mm refuses CPU float32 here: {e}")
    results = {}
    for gemm in ("loop", "grouped_mm"):
        layer = build(dim=16, hidden=32, n_experts=8, top_k=2, gemm=gemm).float()
        results[gemm] = run(layer, x, g)
    (out_l, xg_l, gr_l), (out_g, xg_g, gr_g) = results["loop"], results["grouped_mm"]
    torch.testing.assert_close(out_g, out_l, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xg_g, xg_l, atol=1e-5, rtol=1e-5)
    for name in gr_l:
        torch.testing.assert_close(gr_g[name], gr_l[name], atol=1e-5, rtol=1e-5)


def test_empty_groups_in_every_gemm_keep_weight_gradients():
    x = torch.randn(5, 16, dtype=torch.float32, requires_grad=True)
    w = torch.randn(3, 16, 8, dtype=torch.float32, requires_grad=True)
    for name in ("loop", "grouped_mm", "auto"):
        for sizes in ([0, 5, 0], [5, 0, 0], torch.tensor([0, 5, 0])):  # host ints or device counts
            y = GEMMS[name](x, w, sizes)
            assert y.shape == (5, 8)
            gx, gw = torch.autograd.grad(y.sum(), (x, w))
            assert gw.shape == w.shape and gw[[i for i, s in enumerate(sizes) if s == 0]].abs().sum() == 0
            torch.testing.assert_close(y, GEMMS["loop"](x, w, [int(s) for s in sizes]))


def test_every_gemm_under_cpu_autocast_computes_in_its_dtype():
    """Autocast covers a matmul (the loop) but not torch._grouped_mm: grouped_mm and auto cast
    their operands themselves, so every gemm gives autocast's dtype and the bf16 loop's values."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 16, generator=gen, dtype=torch.float32)
    w = torch.randn(3, 16, 32, generator=gen, dtype=torch.float32)
    want = GEMMS["loop"](x.bfloat16(), w.bfloat16(), [2, 0, 7]).float()
    for name in ("loop", "grouped_mm", "auto"):
        for sizes in ([2, 0, 7], torch.tensor([2, 0, 7])):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = GEMMS[name](x, w, sizes)
            assert y.dtype == torch.bfloat16, (name, y.dtype)
            torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)
    x64 = x.double()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float64: autocast leaves it, so do the gemms
        assert GEMMS["grouped_mm"](x64, w.double(), [2, 0, 7]).dtype == torch.float64


@pytest.mark.skipif(megablocks_available(), reason="megablocks is installed here")
def test_megablocks_gemm_asked_for_but_missing_is_a_clear_error():
    with pytest.raises(ValueError, match=r"gemm='megablocks' needs the megablocks package"):
        MoEMLP(8, 8, 4, gemm="megablocks")


# ---- the dispatcher seam ------------------------------------------------------------
class RecordingDispatcher(LocalDispatcher):
    """The local dispatcher, logging each call: what a registered dispatcher sees."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = []

    def dispatch(self, x_TD, routing):
        x_MD, sizes, state = super().dispatch(x_TD, routing)
        self.calls.append(("dispatch", x_TD.shape[0], x_MD.shape[0], sum(sizes)))
        return x_MD, sizes, state

    def combine(self, y_MD, state):
        self.calls.append(("combine", y_MD.shape[0]))
        return super().combine(y_MD, state)


def test_a_registered_dispatcher_carries_every_row_once_per_forward(monkeypatch):
    monkeypatch.setattr(dispatch, "DISPATCHERS", dict(dispatch.DISPATCHERS))
    register_dispatcher("recording", RecordingDispatcher)
    layer = build(dispatcher="recording", n_shared_experts=1)  # 18 tokens, top_k=4: 72 rows, dropless
    x, g = inputs()
    assert_same(run(layer, x, g), run_reference(layer, x, g))
    assert layer.dispatcher.calls == [("dispatch", 18, 72, 72), ("combine", 72)]  # backward calls neither
    assert layer.dispatcher.n_experts == 16 and layer.dispatcher.capacity_factor is None


def test_auto_dispatcher_is_local_without_ep_and_alltoall_with_it():
    assert type(MoEMLP(12, 8, 8, 2).dispatcher) is LocalDispatcher
    assert type(MoEMLP(12, 8, 8, 2, ep_group=FakeGroup(1)).dispatcher) is LocalDispatcher
    layer = MoEMLP(12, 8, 8, 2, ep_group=FakeGroup(2, 1), capacity_factor=1.5, drop_policy="probs")
    assert type(layer.dispatcher) is AllToAllDispatcher and layer.dispatcher.group.size() == 2
    assert "AllToAllDispatcher(ep=2, capacity_factor=1.5, drop_policy='probs')" in repr(layer)
    assert copy.deepcopy(layer).dispatcher.group is layer.dispatcher.group  # shared, not copied


# ---- construction: seeding, marks, tp, meta --------------------------------------------
def test_experts_are_seeded_by_global_index_at_every_ep():
    full = LayerSpec(MoEMLP, 12, 8, 8, 2, n_shared_experts=1).build(seed=SEED, index=5)
    state = torch.get_rng_state()
    for ep in (2, 4, 8):
        for r in range(ep):
            part = LayerSpec(MoEMLP, 12, 8, 8, 2, n_shared_experts=1,
                             ep_group=FakeGroup(ep, r)).build(seed=SEED, index=5)
            n = 8 // ep
            for name, p in part.experts.named_parameters():
                assert torch.equal(p, getattr(full.experts, name)[r * n:(r + 1) * n]), (ep, r, name)
            assert torch.equal(part.router.weight, full.router.weight)
            assert torch.equal(part.shared.gate, full.shared.gate)
    assert torch.equal(torch.get_rng_state(), state)
    other = LayerSpec(MoEMLP, 12, 8, 8, 2).build(seed=SEED, index=6)
    assert not torch.equal(other.experts.w_gate, full.experts.w_gate)
    assert not torch.equal(full.experts.w_gate[0], full.experts.w_gate[1])


def test_ep_group_defaults_to_the_current_expert_parallel_group():
    with expert_parallel(FakeGroup(4, 2)):
        layer = MoEMLP(12, 8, 8, 2)
        plain = MoEMLP(12, 8, 8, 2, ep_group=FakeGroup(1))
    assert layer.ep_group.size() == 4 and layer.experts.first == 4 and layer.experts.w_up.shape[0] == 2
    assert plain.experts.first == 0 and plain.experts.w_up.shape[0] == 8
    assert MoEMLP(12, 8, 8, 2).ep_group is None


def test_expert_parameters_are_marked_and_none_is_tp_sharded():
    with tensor_parallel(FakeGroup(2, 1)):
        layer = LayerSpec(MoEMLP, 12, 8, 4, 2, activation="gelu", bias=True,
                          n_shared_experts=1).build(seed=SEED, index=1)
    plain = LayerSpec(MoEMLP, 12, 8, 4, 2, activation="gelu", bias=True, n_shared_experts=1).build(seed=SEED, index=1)
    for name, p in layer.named_parameters():
        assert not hasattr(p, "tp_shard_dim"), name
        is_expert = name.startswith("experts.")
        assert getattr(p, "expert_parallel", False) == is_expert, name
        assert getattr(p, "ep_shard_dim", None) == (0 if is_expert else None), name
        assert torch.equal(p, dict(plain.named_parameters())[name]), name  # replicated: the tp=1 tensors
    assert layer.experts.w_fc.shape == (4, 12, 8) and layer.experts.w_proj.shape == (4, 8, 12)
    assert copy.deepcopy(layer).experts.w_fc.expert_parallel


def test_meta_build_and_run_give_shapes_without_routing():
    layer = LayerSpec(MoEMLP, 12, 8, 4, 2).build(seed=SEED, index=1, device="meta")
    out = layer(torch.empty(2, 9, 12, device="meta"))
    assert out.shape == (2, 9, 12) and out.is_meta
    assert metrics.pop() == {}


def test_metrics_per_layer_name():
    layer = build(n_experts=8, top_k=2, layer_index=7)
    x, _ = inputs()
    layer(x)
    layer(x)
    got = metrics.pop()
    counts = torch.bincount(reference_routing(layer.router, x.reshape(-1, 12))[0].flatten(), minlength=8).float()
    total, n = got["moe/7/tokens_per_expert"]
    assert n == 2 and torch.equal(total, 2 * counts)
    assert got["moe/7/max_load"][0] == 2 * counts.max() and got["moe/7/mean_load"][0] == 2 * counts.mean()
    assert set(got) == {f"moe/7/{k}" for k in ("tokens_per_expert", "max_load", "mean_load", "dropped",
                                                 "aux_loss", "z_loss")}


# ---- bad input ------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=5), r"top_k=5 must be an int in \[1, n_experts=4\]"),
    (dict(top_k=0), r"top_k=0 must be an int in \[1, n_experts=4\]"),
    (dict(ep_group=FakeGroup(3)), r"n_experts=4 is not divisible by the expert-parallel size ep=3"),
    (dict(capacity_factor=0.0), r"capacity_factor=0.0 must be > 0"),
    (dict(capacity_factor=-1), r"capacity_factor=-1 must be > 0"),
    (dict(score="tanh"), r"score='tanh' is not one of \('softmax', 'sigmoid'\)"),
    (dict(drop_policy="random"), r"drop_policy='random' is not one of \('position', 'probs'\)"),
    (dict(activation="relu"), r"activation='relu' is not one of \('swiglu', 'gelu'\)"),
    (dict(gemm="cutlass"), r"gemm='cutlass' is not one of \[.*'loop'.*\]"),
    (dict(dispatcher="deepep"), r"dispatcher='deepep' is not one of \['auto', 'alltoall', 'local'.*\]"),
    (dict(dispatcher="local", ep_group=FakeGroup(2)), r"dispatcher='local' .* sharded over ep=2 ranks"),
    (dict(dispatcher="alltoall"), r"dispatcher='alltoall' needs an expert-parallel group"),
    (dict(n_shared_experts=-1), r"n_shared_experts=-1 must be an int >= 0"),
    (dict(jitter=1.5), r"jitter=1.5 must be in \[0, 1\)"),
    (dict(aux_loss_coef=-0.1), r"aux_loss_coef=-0.1 must be a finite number >= 0"),
    (dict(bias_update_rate=float("nan")), r"bias_update_rate=nan must be a finite number >= 0"),
    (dict(activation="swiglu", bias=True), r"bias=True is supported with activation='gelu' only"),
    (dict(bias_update="epoch"), r"bias_update='epoch' is not one of \('forward', 'step'\)"),
])
def test_bad_input_names_the_value(kwargs, match):
    args = dict(dim=8, hidden=8, n_experts=4, top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        MoEMLP(args.pop("dim"), args.pop("hidden"), args.pop("n_experts"), args.pop("top_k"), **args)


def test_experts_alone_check_divisibility():
    with pytest.raises(ValueError, match=r"n_experts=6 is not divisible by the expert-parallel size ep=4"):
        Experts(8, 8, 6, ep_size=4)


# ---- expert parallelism: one group of 4 ranks -------------------------------------------
# "dead": experts 6 and 7 never win (their router rows are very negative and tokens positive),
# so at ep=4 rank 3 receives no rows at all, and with 6 tokens per rank some living expert
# gets none on some rank. "capacity": GELU with biases, sigmoid scores, capacity drops and the
# aux-free bias (its loads summed over the ep group).
EP_CASES = {
    "dead": dict(n_shared_experts=1, aux_loss_coef=0.01, z_loss_coef=0.001),
    "capacity": dict(activation="gelu", bias=True, score="sigmoid", capacity_factor=1.0, bias_update_rate=0.01,
                     aux_loss_coef=0.02),
}
EP_DIM, EP_TOKENS = 8, (2, 3)


def _ep_build(kw, group):
    layer = LayerSpec(MoEMLP, EP_DIM, 6, 8, 2, ep_group=group, **kw).build(seed=SEED, index=2)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(11))
        layer.router.weight[6:] = -5.0
    return layer


def _ep_run(layer, x, g):
    metrics.pop()
    out, xg, grads = run(layer, x, g)
    bias = layer.router.expert_bias
    return {"dropped": metrics.pop()["moe/dropped"][0].item(), "out": out, "x_grad": xg, "grads": grads,
            "first": layer.experts.first,
            "params": {n: p.detach().clone() for n, p in layer.experts.named_parameters()},
            "bias": None if bias is None else bias.clone()}


@in_float64
def _ep_worker():
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group, in order
    groups = {2: pairs[rank // 2], 4: dist.group.WORLD}
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    x = torch.rand(*EP_TOKENS, EP_DIM, generator=gen) + 0.1
    g = torch.randn(*EP_TOKENS, EP_DIM, generator=gen)
    out = {}
    for name, kw in EP_CASES.items():
        ref = _ep_build(kw, None)
        out[name] = {1: _ep_run(ref, x, g), "counts": ref.router(x.reshape(-1, EP_DIM)).counts_E}
        for ep, group in groups.items():
            out[name][ep] = _ep_run(_ep_build(kw, group), x, g)
    return out


def test_expert_parallel_matches_ep1_on_each_ranks_tokens():
    per_rank = run_distributed(_ep_worker, 4, timeout=120)
    counts = torch.stack([r["dead"]["counts"] for r in per_rank])  # (rank, E) at ep=1
    assert counts[:, 6:].sum() == 0  # experts 6, 7 get nothing anywhere
    assert (counts[:, :6] == 0).any()  # some living expert gets nothing on some rank
    assert sum(r["capacity"][1]["dropped"] for r in per_rank) > 0  # capacity drops happen
    for name in EP_CASES:
        for ep in (2, 4):
            for r, res in enumerate(per_rank):
                one, many = res[name][1], res[name][ep]
                peers = range(r // ep * ep, r // ep * ep + ep)
                where = f"{name}, ep={ep}, rank {r}"
                torch.testing.assert_close(many["out"], one["out"], **TOL, msg=lambda m, w=where: f"{w}: {m}")
                torch.testing.assert_close(many["x_grad"], one["x_grad"], **TOL, msg=lambda m, w=where: f"{w}: {m}")
                assert many["dropped"] == one["dropped"], where
                n = 8 // ep
                local = slice(many["first"], many["first"] + n)
                assert many["first"] == (r % ep) * n
                for p, value in many["params"].items():  # bitwise the ep=1 experts
                    assert torch.equal(value, one["params"][p][local]), f"{where}: {p}"
                for p, grad in many["grads"].items():
                    if p.startswith("experts."):  # expert e's grad covers all ep peers' tokens
                        want = sum(per_rank[q][name][1]["grads"][p] for q in peers)[local]
                    else:  # router, shared expert: replicated, this rank's tokens only
                        want = one["grads"][p]
                    torch.testing.assert_close(grad, want, **TOL, msg=lambda m, w=where, p=p: f"{w}, {p}: {m}")
                assert sorted(many["grads"]) == sorted(one["grads"])
                if name == "capacity":  # aux-free bias from the loads summed over the ep group
                    load = sum(per_rank[q]["capacity"]["counts"] for q in peers).float()
                    torch.testing.assert_close(many["bias"], 0.01 * torch.sign(load.mean() - load))
    assert per_rank[3]["dead"][4]["grads"]["experts.w_gate"].abs().sum() == 0  # rank 3 received no rows
