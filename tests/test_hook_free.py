"""dp=1, ZeRO stage < 2, gradients in the parameters' dtype: no post-accumulate-grad hook is
armed (`Reducer.free`), and who got a gradient is read once per step; the run equals, bitwise,
one with the hooks forced on (`reducer.HOOK_FREE = False`)."""

import torch

from pipekit.optim import reducer
from pipekit.optim.zero import ZeroOptimizer


def make():
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))


def loss(m, x, step, micro):
    y = m[0](x)
    if step != 1 and micro == 1:
        y = m[1](y)  # m[1] gets no gradient in step 1 (an expert given no tokens); m[2] never
    return y.square().mean()


def run(stage):
    m = make()
    opt = ZeroOptimizer(m, "adamw", stage=stage, lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(3):
        opt.zero_grad()
        for micro in range(2):
            out = loss(m, torch.randn(2, 4, generator=gen), step, micro)
            out.backward()
            losses.append(out.detach())
        opt.step()
    return opt, torch.stack(losses), [p.detach().clone() for p in m.parameters()]


def test_hook_free_arms_no_hook_and_matches_hooks_bitwise(monkeypatch):
    for stage in (0, 1):
        opt, losses, weights = run(stage)
        assert not opt._reducer.hooks, f"stage {stage}: hooks armed"
        assert opt._reducer.touched == {id(p) for p in opt.module[0].parameters()} | {
            id(p) for p in opt.module[1].parameters()}
        monkeypatch.setattr(reducer, "HOOK_FREE", False)
        ref_opt, ref_losses, ref_weights = run(stage)
        monkeypatch.setattr(reducer, "HOOK_FREE", True)
        assert ref_opt._reducer.hooks
        assert torch.equal(losses, ref_losses)
        for a, b in zip(weights, ref_weights):
            assert torch.equal(a, b), f"stage {stage}"
        assert torch.equal(weights[-2], make()[2].weight.detach())  # never touched: never stepped


def test_hook_free_refuses_a_backward_after_step_without_zero_grad():
    opt, _, _ = run(0)
    opt.module[0](torch.ones(2, 4)).sum().backward()
    try:
        opt.step()
    except RuntimeError as e:
        assert "after its bucket was reduced" in str(e)
    else:
        raise AssertionError("not refused")
