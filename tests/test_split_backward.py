"""The split backward (`pipekit.split_backward`) against a full backward, without processes.

For small stages of every shape the engine meets (an MLP, a GPT block, a weight used
twice along one path, a weight tied at two places, a checkpointed block, an output
that depends on no input, a custom autograd Function, a matmul whose output feeds
two paths, a gradient hook on an activation, a scalar loss), `I` then `W` must give
the input grads and every parameter's `.grad` of one `torch.autograd.backward`, bit
for bit, with each post-accumulate-grad hook firing once per parameter and only in
`W`. The plan worked out for a graph's shape must
serve the next microbatch of that shape unchanged, and a graph of another shape must
get its own.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipekit import split_backward
from pipekit.models import get_model, model_specs
from pipekit.split_backward import backward_input, backward_weight

DIM = 8


class Twice(nn.Module):
    """One weight used twice along one path: lin(tanh(lin(x)))."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class Tied(nn.Module):
    """A matrix at two places, in and out: (gelu(x E^T) + b) E."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Parameter(torch.randn(12, DIM) / 3)
        self.bias = nn.Parameter(torch.randn(12) / 3)

    def forward(self, x):
        return (nn.functional.gelu(x @ self.emb.t()) + self.bias) @ self.emb


class Checkpointed(nn.Module):
    """An MLP whose middle is recomputed (non-reentrant checkpointing, as PipelineModule uses)."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM), nn.LayerNorm(DIM)

    def forward(self, x):
        h = checkpoint(lambda t: self.down(nn.functional.gelu(self.up(t))), self.norm(x), use_reentrant=False)
        return x + h


class Constant(nn.Module):
    """Two outputs: one depends on the input, one only on a parameter."""

    def __init__(self):
        super().__init__()
        self.lin, self.table = nn.Linear(DIM, DIM), nn.Parameter(torch.randn(3, DIM))

    def forward(self, x):
        return self.lin(x), self.table * 2


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, (g * x).sum(dim=(0, 1))


class Custom(nn.Module):
    """A custom autograd Function on the boundary of its weight."""

    def __init__(self):
        super().__init__()
        self.w, self.lin = nn.Parameter(torch.randn(DIM)), nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.lin(_Scale.apply(x, self.w))


class SharedMatmul(nn.Module):
    """A matmul whose output feeds its bias add and another path: one engine call holds
    both groups and replaces what reaches the matmul with what it got in I."""

    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(DIM, DIM) / 3), nn.Parameter(torch.randn(DIM))

    def forward(self, x):
        y = x @ self.w
        return (y + self.b) + 0.5 * y


class Branchy(nn.Module):
    """A different graph for a different input: the second layer only on positive sums."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) + h if x.sum() > 0 else h


def gpt_blocks(n: int = 2) -> nn.Module:
    cfg = get_model("gpt2", "tiny", dim=DIM * 4, n_layers=n, n_heads=4, max_seq_len=16)
    blocks = nn.Sequential(*[spec.build(seed=0, index=i, device="cpu") for i, spec in enumerate(model_specs(cfg))
                             if 1 <= i <= n])
    blocks.width = DIM * 4
    return blocks


def llama_variant_blocks(n: int = 2) -> nn.Module:
    """Llama blocks with every Hugging Face variant on: a sliding window shorter than the input
    (an explicit mask into SDPA), q/k/v biases, q/k head norms, wide heads, the scaled rope."""
    cfg = get_model("llama", "tiny", dim=DIM * 4, n_layers=n, n_heads=4, n_kv_heads=2, hidden=DIM * 6, max_seq_len=16,
                    sliding_window=3, qkv_bias=True, qk_norm=True, head_dim=DIM * 2,
                    rope_scaling={"rope_type": "linear", "factor": 2.0})
    blocks = nn.Sequential(*[spec.build(seed=0, index=i, device="cpu") for i, spec in enumerate(model_specs(cfg))
                             if 1 <= i <= n])
    blocks.width = DIM * 4
    return blocks


def mlp() -> nn.Module:
    return nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 3 * DIM), nn.GELU(), nn.Linear(3 * DIM, DIM))


MODULES = {"mlp": mlp, "gpt blocks": gpt_blocks, "llama blocks, every HF variant": llama_variant_blocks,
           "weight used twice": Twice, "tied at two places": Tied,
           "checkpointed": Checkpointed, "an output without the input": Constant, "custom Function": Custom,
           "matmul under its bias add and another path": SharedMatmul}


def _outputs(module, x):
    out = module(x)
    return list(out) if isinstance(out, tuple) else [out]


def _inputs(module, seq=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, seq, getattr(module, "width", DIM), generator=g)


def full(module, x, grads=None):
    """(input grad, param grads) of one torch.autograd.backward; grads None: a scalar loss (the sum)."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    outs = _outputs(module, x)
    if grads is None:
        torch.autograd.backward([sum(o.sum() for o in outs)])
    else:
        torch.autograd.backward(outs, grads)
    return x.grad, [p.grad for p in module.parameters()]


def split(module, x, grads=None):
    """(input grad, param grads) of backward_input then backward_weight."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    outs = _outputs(module, x)
    if grads is None:
        outs, grads = [sum(o.sum() for o in outs)], [None]
    params = list(module.parameters())
    (gx,), work = backward_input(outs, grads, [x], params)
    assert all(p.grad is None for p in params), "the input pass touched a weight grad"
    backward_weight(work)
    return gx, [p.grad for p in params]


def output_grads(module, x, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g) for o in _outputs(module, x)]


def assert_same(got, want):
    gx, gp = got
    wx, wp = want
    assert torch.equal(gx, wx)
    assert len(gp) == len(wp)
    for i, (a, b) in enumerate(zip(gp, wp)):
        assert (a is None) == (b is None), f"parameter {i}: grad {a is not None} vs {b is not None}"
        assert a is None or torch.equal(a, b), f"parameter {i} differs by {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("name", list(MODULES))
def test_split_gives_a_full_backwards_grads_bit_for_bit(name):
    torch.manual_seed(0)
    module = MODULES[name]()
    x = _inputs(module)
    grads = output_grads(module, x)
    assert_same(split(module, x, grads), full(module, x, grads))


@pytest.mark.parametrize("name", ["mlp", "gpt blocks", "tied at two places"])
def test_scalar_loss_last_stage(name):
    torch.manual_seed(0)
    module = MODULES[name]()
    x = _inputs(module)
    assert_same(split(module, x), full(module, x))


def test_a_gradient_hook_on_an_activation_counts_once_in_the_weight_grads():
    """A tensor hook on a boundary node's output (here: doubling) runs in both passes, on
    what arrived each time, so the first layer's weight grads see it once, as in B."""
    torch.manual_seed(0)
    module = mlp()

    class Hooked(nn.Module):
        def forward(self, x):
            h = module[1](module[0](x.flatten(0, 1)))  # 2-d: h's grad_fn is the boundary (addmm) itself
            h.register_hook(lambda g: g * 2)
            return module[3](module[2](h))

    hooked = Hooked()
    hooked.register_module("inner", module)
    x = _inputs(module)
    grads = output_grads(hooked, x)
    assert_same(split(hooked, x, grads), full(hooked, x, grads))


def test_first_stage_input_needs_no_grad_and_w_does_everything():
    torch.manual_seed(0)
    emb, body = nn.Embedding(16, DIM), mlp()
    module = nn.Sequential(emb, body)
    ids = torch.randint(0, 16, (2, 5))
    out = module(ids)
    g = torch.randn_like(out)
    torch.autograd.backward([out], [g])
    want = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    out = module(ids)
    input_grads, work = backward_input([out], [g], [], list(module.parameters()))
    assert input_grads == [] and all(p.grad is None for p in module.parameters())
    assert work.plan.slots == ()  # nothing to capture: W starts from the output
    backward_weight(work)
    assert all(torch.equal(p.grad, w) for p, w in zip(module.parameters(), want))


def test_an_input_the_outputs_do_not_use_gets_zeros():
    torch.manual_seed(0)
    module = mlp()
    x, unused = torch.randn(2, 5, DIM, requires_grad=True), torch.randn(3, requires_grad=True)
    out = module(x)
    (gx, gu), work = backward_input([out], [torch.ones_like(out)], [x, unused], list(module.parameters()))
    backward_weight(work)
    assert gx.shape == x.shape and torch.equal(gu, torch.zeros(3))


def test_grads_accumulate_over_microbatches_as_two_full_backwards():
    torch.manual_seed(0)
    module = gpt_blocks()
    xs = [_inputs(module, seed=s) for s in (0, 1)]
    gs = [output_grads(module, x, seed=s + 2) for s, x in enumerate(xs)]
    module.zero_grad(set_to_none=True)
    for x, g in zip(xs, gs):
        torch.autograd.backward(_outputs(module, x.clone().requires_grad_()), g)
    want = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    works = []
    for x, g in zip(xs, gs):  # both I passes first, as a zero-bubble schedule may run them
        x = x.clone().requires_grad_()
        works.append(backward_input(_outputs(module, x), g, [x], list(module.parameters()))[1])
    for work in works:
        backward_weight(work)
    assert all(torch.equal(p.grad, w) for p, w in zip(module.parameters(), want))


def test_each_post_accumulate_grad_hook_fires_once_per_parameter_in_w():
    torch.manual_seed(0)
    module = gpt_blocks()
    fired, phase = [], ["I"]
    for i, p in enumerate(module.parameters()):
        p.register_post_accumulate_grad_hook(lambda p, i=i: fired.append((phase[0], i)))
    x = _inputs(module).requires_grad_()
    out = module(x)
    _, work = backward_input([out], [torch.ones_like(out)], [x], list(module.parameters()))
    phase[0] = "W"
    backward_weight(work)
    n = len(list(module.parameters()))
    assert sorted(fired) == [("W", i) for i in range(n)]


def test_a_bias_add_shares_its_matmuls_engine_call():
    """A GPT block: ten parameter groups (2 norms, q, k, v, fc; proj and fc2 as matmul +
    bias add) in six engine calls: the matmul under its bias add is derived, not
    captured; q, k and v share one call."""
    torch.manual_seed(0)
    module = gpt_blocks(1)
    x = _inputs(module).requires_grad_()
    out = module(x)
    _, work = backward_input([out], [torch.ones_like(out)], [x], list(module.parameters()))
    groups = [g for call in work.plan.calls for g in call.groups]
    assert (len(groups), len(work.plan.calls), len(work.plan.slots)) == (10, 6, 8)
    assert all(call.clamps == () for call in work.plan.calls)
    backward_weight(work)


def test_the_plan_serves_the_next_microbatch_of_a_shape(monkeypatch):
    torch.manual_seed(0)
    module = gpt_blocks()
    made = []
    monkeypatch.setattr(split_backward, "_plans", {})
    real = split_backward._plan
    monkeypatch.setattr(split_backward, "_plan", lambda *key: made.append(key) or real(*key))
    for seed, seq in [(0, 5), (1, 5), (2, 7)]:  # another sequence length: the same graph shape
        x = _inputs(module, seq=seq, seed=seed)
        grads = output_grads(module, x, seed=seed + 5)
        assert_same(split(module, x, grads), full(module, x, grads))
    assert len(made) == 1


def test_a_graph_of_another_shape_gets_its_own_plan(monkeypatch):
    torch.manual_seed(0)
    module = Branchy()
    monkeypatch.setattr(split_backward, "_plans", {})
    x_pos, x_neg = torch.rand(2, 5, DIM), -torch.rand(2, 5, DIM)
    for x in (x_pos, x_neg, x_pos, x_neg):
        grads = output_grads(module, x)
        assert_same(split(module, x, grads), full(module, x, grads))
    assert len(split_backward._plans) == 2


def test_the_plan_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(split_backward, "_plans", {})
    monkeypatch.setattr(split_backward, "_CACHE_SIZE", 3)
    lin = nn.Linear(DIM, DIM)
    for depth in range(1, 6):  # five shapes: lin applied 1..5 times
        x = torch.randn(2, DIM, requires_grad=True)
        h = x
        for _ in range(depth):
            h = lin(h)
        _, work = backward_input([h], [torch.ones_like(h)], [x], list(lin.parameters()))
        backward_weight(work)
    assert len(split_backward._plans) == 3


def test_a_grad_of_the_wrong_shape_is_refused():
    lin = nn.Linear(DIM, DIM)
    x = torch.randn(2, DIM, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"grad_output\[0\] has a shape of torch.Size\(\[2\]\)"):
        backward_input([lin(x)], [torch.ones(2)], [x], list(lin.parameters()))


def test_weight_work_runs_once():
    torch.manual_seed(0)
    module = mlp()
    x = _inputs(module).requires_grad_()
    out = module(x)
    _, work = backward_input([out], [torch.ones_like(out)], [x], list(module.parameters()))
    backward_weight(work)
    once = [p.grad.clone() for p in module.parameters()]
    backward_weight(work)
    assert all(torch.equal(p.grad, o) for p, o in zip(module.parameters(), once))
