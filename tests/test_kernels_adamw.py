"""Fused AdamW (pipekit/kernels/adamw.py): its Triton programs, run on CPU tensors in Triton's
interpreter (TRITON_INTERPRET=1, tests/conftest.py), and its reference, against
torch.optim.AdamW; then ZeroOptimizer with fused=True against fused=False, at one rank and at
dp=2 (stages 1 and 2, in tests/test_zero.py's spawned group: `fused_equals_unfused_at_dp`), and
checkpoints moved between the two.

Tolerance for the Triton side in float32, 2e-6 relative and absolute after a few steps of
lr 0.1: the program evaluates torch's ops in torch's order in float32 registers, but the
compiler may contract a multiply and an add into one fused multiply-add (one rounding where
torch has two), so single elements differ by an ulp or so (measured: at most 2.4e-7 absolute
over 10,000 elements and 4 steps). The reference side is torch's ops on the flat run: equal to
torch.optim.AdamW bit for bit, in float32 as in float64.
"""

from __future__ import annotations

import pytest
import torch

from pipekit.kernels import adamw as adamw_kernels
from pipekit.kernels import kernels
from pipekit.kernels.adamw import FusedAdamW, adamw_step_, unscale_and_check_
from pipekit.optim import LossScaler, ZeroOptimizer

TOL = {"rtol": 2e-6, "atol": 2e-6}  # see the module docstring
SIZES = [3000, 4097, 1, 2902]  # 10,000 elements: three programs of 4,096, the last partly masked
SIDES = {"triton": TOL, "torch": {"rtol": 0, "atol": 0}}


def flat_pieces(dtype=torch.float32, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    flat = torch.randn(sum(SIZES), generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return flat, list(flat.split(SIZES))


def groups(pieces, weight_decay: float, maximize: bool = False) -> list[dict]:
    """Two param groups with different learning rates (and weight decay in the first only)."""
    return [{"params": pieces[:2], "lr": 0.1, "weight_decay": weight_decay, "maximize": maximize},
            {"params": pieces[2:], "lr": 0.03, "weight_decay": 0.0, "maximize": maximize}]


def step_both(opt, ref, pieces, ref_pieces, grad_flat, skip: set[int], mode: str) -> None:
    """Give both optimizers the same gradients (views of one flat gradient on the fused side;
    None for the pieces in `skip`) and step them."""
    for i, (p, r, g) in enumerate(zip(pieces, ref_pieces, grad_flat.split(SIZES))):
        p.grad = None if i in skip else g
        r.grad = None if i in skip else g.clone()
    with kernels(mode):
        opt.step()
    ref.step()


@pytest.mark.parametrize("side", sorted(SIDES))
@pytest.mark.parametrize("weight_decay, maximize", [(0.1, False), (0.0, True)])
def test_fused_adamw_steps_as_torch_adamw(side, weight_decay, maximize):
    """Four steps, two param groups, a piece without a gradient at step 3 (its step count
    stays behind, so the run splits around it), and the learning rate changed between steps."""
    _, pieces = flat_pieces()
    ref_pieces = [p.clone() for p in pieces]
    opt = FusedAdamW(groups(pieces, weight_decay, maximize), betas=(0.9, 0.95))
    ref = torch.optim.AdamW(groups(ref_pieces, weight_decay, maximize), betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(1)
    for s in range(4):
        step_both(opt, ref, pieces, ref_pieces, torch.randn(sum(SIZES), generator=gen), {1} if s == 2 else set(),
                  side)
        for o in (opt, ref):
            o.param_groups[0]["lr"] *= 0.5  # as an LR scheduler does
    for p, r in zip(pieces, ref_pieces):
        torch.testing.assert_close(p, r, **SIDES[side])
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref.state[r][key], **SIDES[side])
        assert opt.state[p]["step"].dtype == ref.state[r]["step"].dtype
        assert opt.state[p]["step"].item() == ref.state[r]["step"].item()
    assert opt.state[pieces[1]]["step"].item() == 3


def test_one_call_per_run_of_contiguous_pieces_with_equal_steps(monkeypatch):
    calls: list[int] = []
    real = adamw_kernels.adamw_step_

    def counted(param, *args, **kwargs):
        calls.append(param.numel())
        return real(param, *args, **kwargs)

    monkeypatch.setattr(adamw_kernels, "adamw_step_", counted)
    flat, pieces = flat_pieces()
    opt = FusedAdamW([{"params": pieces}])
    grad = torch.ones_like(flat)
    for skip in (set(), {1}, set()):
        for i, (p, g) in enumerate(zip(pieces, grad.split(SIZES))):
            p.grad = None if i in skip else g
        opt.step()
    # all in one run; piece 1 skipped (runs on either side); piece 1 a step behind (a run of its own)
    assert calls == [10000, 3000, 2903, 3000, 4097, 2903]


def test_a_run_never_spans_two_storages(monkeypatch):
    """Two parameters adjacent in memory but in two storages (two tensors over one buffer) are
    two runs: a flat tensor over both would be a view of the first storage beyond its end."""
    calls: list[int] = []
    real = adamw_kernels.adamw_step_
    monkeypatch.setattr(adamw_kernels, "adamw_step_", lambda param, *a, **k: (calls.append(param.numel()),
                                                                                real(param, *a, **k)))
    buf = bytearray(64)
    first, second = (torch.frombuffer(buf, dtype=torch.float32, count=8, offset=o) for o in (0, 32))
    assert first.data_ptr() + 32 == second.data_ptr()
    grad = torch.ones(16)
    first.grad, second.grad = grad[:8], grad[8:]
    FusedAdamW([first, second]).step()
    assert calls == [8, 8] and torch.equal(first, second)


def test_found_inf_skips_the_step_on_the_device():
    for side in SIDES:
        flat, pieces = flat_pieces()
        grads = torch.randn_like(flat)
        before = flat.clone()
        m, v = torch.zeros_like(flat), torch.zeros_like(flat)
        hyper = dict(step=1, lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
        with kernels(side):
            adamw_step_(flat, grads, m, v, found_inf=torch.ones(()), **hyper)
            assert torch.equal(flat, before) and not m.any() and not v.any(), side
            adamw_step_(flat, grads, m, v, found_inf=torch.zeros(()), grad_scale=torch.tensor(0.5), **hyper)
        flat2, m2, v2 = before.clone(), torch.zeros_like(flat), torch.zeros_like(flat)
        with kernels(side):
            adamw_step_(flat2, grads * 0.5, m2, v2, **hyper)
        assert torch.equal(flat, flat2) and torch.equal(m, m2) and torch.equal(v, v2), side
        opt = FusedAdamW([{"params": pieces}])
        for p, g in zip(pieces, grads.split(SIZES)):
            p.grad = g
        with kernels(side):
            opt.step(found_inf=torch.ones(()))
        assert torch.equal(flat, flat2), side
        assert all(opt.state[p]["step"].item() == 0 and not opt.state[p]["exp_avg"].any() for p in pieces), side


@pytest.mark.parametrize("side", sorted(SIDES))
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), None])
def test_unscale_and_check_sets_the_flag_on_inf_and_nan(side, bad):
    grad = torch.randn(10000, generator=torch.Generator().manual_seed(0))
    if bad is not None:
        grad[9999] = bad  # in the last, partly masked program
    for in_place in (False, True):
        g, found = grad.clone(), torch.zeros(())
        with kernels(side):
            unscale_and_check_(g, 0.25, found, in_place=in_place)
        assert found.item() == (bad is not None), (in_place, found)
        torch.testing.assert_close(g, grad * 0.25 if in_place else grad, equal_nan=True, rtol=0, atol=0)
    found = torch.zeros(())
    with kernels(side):  # finite, but not once unscaled: the check is of the unscaled value
        unscale_and_check_(torch.full((5,), 3e38), 2.0, found, in_place=False)
    assert found.item() == 1


def test_state_dicts_move_between_fused_and_torch_adamw():
    """Two steps in one, its state_dict loaded into the other, a third step: as three steps in
    either (the reference side: bit for bit)."""
    grads = torch.randn(3, sum(SIZES), generator=torch.Generator().manual_seed(2))
    results = []
    for first, second in ((FusedAdamW, torch.optim.AdamW), (torch.optim.AdamW, FusedAdamW), (FusedAdamW, FusedAdamW)):
        flat, pieces = flat_pieces()
        opt = first(groups(pieces, 0.1))
        for s in range(3):
            if s == 2:
                saved = opt.state_dict()
                opt = second(groups(pieces, 0.1))
                opt.load_state_dict(saved)
            for p, g in zip(pieces, grads[s].split(SIZES)):
                p.grad = g
            opt.step()
        results.append(flat)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_amsgrad_is_refused_by_name():
    with pytest.raises(ValueError, match="FusedAdamW has no amsgrad"):
        FusedAdamW([torch.zeros(3, requires_grad=True)], amsgrad=True)


# ---- ZeroOptimizer -------------------------------------------------------------------------------

class Branchy(torch.nn.Module):
    """Two linears; the second one only when asked (so that it gets no gradient in some steps)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(7, 9), torch.nn.Linear(9, 3)

    def forward(self, x, use_b: bool = True):
        h = torch.tanh(self.a(x))
        return self.b(h) if use_b else h


def train_zero(dtype, fused: bool, stage: int, mode: str, *, dp_group=None, rank: int = 0, steps: int = 5,
               state=None, clip: float | None = 0.5, scaler: bool = True):
    """Train Branchy with ZeroOptimizer; step 2 overflows on rank 1 (with a scaler: every rank
    skips it), step 3 leaves `b` without a gradient; each rank's own data. Returns (model, optimizer)."""
    torch.manual_seed(0)
    model = Branchy().to(dtype)
    scaler_ = LossScaler(initial_scale_power=3) if scaler else None
    opt = ZeroOptimizer(model, "adamw", stage=stage, dp_group=dp_group, lr=0.05, weight_decay=0.1,
                        clip_grad_norm=clip, fused=fused, bucket_mb=0.0005, loss_scaler=scaler_)
    if state is not None:
        opt.load_param_state({p: state[name] for name, p in model.named_parameters()})
    gen = torch.Generator().manual_seed(1 + rank)
    for s in range(steps):
        x = torch.randn(4, 7, generator=gen, dtype=dtype)
        if s == 2 and scaler and rank == (1 if dp_group is not None else 0):
            x[0, 0] = float("inf")
        opt.zero_grad()
        opt.scale_loss(model(x, use_b=s != 3).square().mean()).backward()
        with kernels(mode):
            opt.step()
    return model, opt


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("clip, scaler", [(None, False), (0.5, True), (None, True)])
def test_zero_fused_equals_unfused_at_one_rank(stage, clip, scaler):
    """float64 takes the reference: bit for bit the unfused optimizer; float32 in the Triton
    interpreter: within TOL. The overflowed step is skipped by both (the loss scale follows)."""
    for dtype, mode, tol in ((torch.float64, "auto", 0.0), (torch.float32, "triton", TOL["atol"])):
        fused, fused_opt = train_zero(dtype, True, stage, mode, clip=clip, scaler=scaler)
        plain, plain_opt = train_zero(dtype, False, stage, mode, clip=clip, scaler=scaler)
        assert isinstance(fused_opt.inner, FusedAdamW) and not isinstance(plain_opt.inner, FusedAdamW)
        assert max_diff(fused, plain) <= tol, (dtype, max_diff(fused, plain))
        assert fused_opt.loss_scale == plain_opt.loss_scale
        assert fused_opt.last_step_skipped == plain_opt.last_step_skipped is False
        if clip is not None:
            assert fused_opt.last_grad_norm == pytest.approx(plain_opt.last_grad_norm, rel=1e-6)


def test_param_state_moves_between_fused_and_unfused():
    """float64, stage 1: after 3 steps the fused and unfused optimizers' param_state are equal
    (the same keys, dtypes and values), and either loaded into either resumes alike, bit for
    bit (4 more steps: an overflow and a parameter without a gradient after the load)."""
    saved = {}
    for fused in (True, False):
        _, opt = train_zero(torch.float64, fused, 1, "auto", steps=3)
        saved[fused] = {name: opt.param_state()[p] for name, p in opt.module.named_parameters()}
    for name, entries in saved[True].items():
        assert set(entries) == {"step", "exp_avg", "exp_avg_sq"} == set(saved[False][name])
        for key, value in entries.items():
            other = saved[False][name][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (name, key)
    resumed = [train_zero(torch.float64, fused, 1, "auto", steps=4, state=saved[loaded])[0]
               for fused in (True, False) for loaded in (True, False)]
    assert all(max_diff(resumed[0], other) == 0.0 for other in resumed[1:])


def fused_equals_unfused_at_dp(stage: int) -> dict[str, float]:
    """In a spawned group (tests/test_zero.py's, dp = its world): the fused and unfused
    optimizers' weights in float64 (the reference kernels: equal bit for bit) after
    `train_zero`, whose overflow is on rank 1 only."""
    import torch.distributed as dist

    fused, _ = train_zero(torch.float64, True, stage, "auto", dp_group=dist.group.WORLD, rank=dist.get_rank())
    plain, _ = train_zero(torch.float64, False, stage, "auto", dp_group=dist.group.WORLD, rank=dist.get_rank())
    return {"fused vs unfused weight": max_diff(fused, plain)}


def test_fused_auto_is_off_on_the_cpu_and_true_needs_adamw():
    assert not ZeroOptimizer(torch.nn.Linear(2, 2), "adamw", fused="auto").fused  # CPU masters
    with pytest.raises(ValueError, match="fused=True steps AdamW only"):
        ZeroOptimizer(torch.nn.Linear(2, 2), "sgd", fused=True, lr=0.1)
    with pytest.raises(ValueError, match="fused='yes' is not one of"):
        ZeroOptimizer(torch.nn.Linear(2, 2), "adamw", fused="yes")


def test_fused_auto_picks_the_kernel_only_for_adamw_fp32_masters_on_cuda():
    """The CUDA branch of fused="auto", decided without a GPU (the rule takes the device type)."""
    from pipekit.optim.zero import fused_by_default

    assert fused_by_default(torch.optim.AdamW, torch.float32, "cuda")
    assert not fused_by_default(torch.optim.AdamW, torch.float32, "cpu")
    assert not fused_by_default(torch.optim.AdamW, torch.float64, "cuda")
    assert not fused_by_default(torch.optim.SGD, torch.float32, "cuda")
