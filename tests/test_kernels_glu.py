"""The SwiGLU / GeGLU kernels (pipekit/kernels/glu.py): their Triton programs, run on CPU
tensors in Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py), against the
references, the output and the gradients of gate and up; "auto" on CPU is SwiGLUMLP's
and the MoE experts' old math bit for bit; float64 takes the reference.

Tolerance for the Triton side in float32, 1e-5 relative and absolute: the kernels build
sigmoid and tanh from exp (torch uses its own vectorised formulas), and compute the
backward from the closed-form derivative where autograd chains the ops, so single
elements differ by a few ulps (measured with gate values up to |16|: at most 5.5e-6, in
GeGLU's gate gradient, where the Triton side is the one nearer float64; see
test_triton_is_at_least_as_near_float64_as_torch).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipekit.kernels import glu as glu_kernels
from pipekit.kernels import kernels
from pipekit.kernels.glu import geglu, geglu_reference, swiglu, swiglu_reference
from pipekit.layers.mlp import SwiGLUMLP
from pipekit.moe.experts import Experts

TOL = {"rtol": 1e-5, "atol": 1e-5}  # see the module docstring
KERNELS = {"swiglu": (swiglu, swiglu_reference), "geglu": (geglu, geglu_reference)}


def gate_up(shape, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gate = (4 * torch.randn(shape, generator=gen, dtype=dtype)).requires_grad_()  # the tails of silu/gelu too
    up = torch.randn(shape, generator=gen, dtype=dtype).requires_grad_()
    return gate, up


def output_and_grads(fn, gate, up, seed: int = 1):
    y = fn(gate, up)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    return [y, *torch.autograd.grad(y, (gate, up), dy)]


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("shape", [
    (1, 1, 37),  # one token
    (3, 7, 1001),  # 21,021 elements: six programs of 4,096, the last partly masked
    (4097,),  # one element past a block
    (2, 0, 5),  # empty
])
def test_triton_matches_the_reference_output_and_grads(name, shape):
    fn, reference = KERNELS[name]
    gate, up = gate_up(shape)
    with kernels("triton"):
        got = output_and_grads(fn, gate, up)
    want = output_and_grads(reference, gate, up)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("name", KERNELS)
def test_triton_is_at_least_as_near_float64_as_torch(name):
    """Against the float64 reference, the Triton side's float32 error is no larger than
    torch's own float32 error (sigmoid and 1 - sigmoid from one exp, no cancellation)."""
    fn, reference = KERNELS[name]
    gate, up = gate_up((3, 7, 1001))
    with kernels("triton"):
        got = output_and_grads(fn, gate, up)
    torch32 = output_and_grads(reference, gate, up)
    gate64, up64 = (t.detach().double().requires_grad_() for t in (gate, up))
    truth = output_and_grads(reference, gate64, up64)
    for g, t32, t64 in zip(got, torch32, truth):
        assert (g.double() - t64).abs().max() <= (t32.double() - t64).abs().max() + 1e-7


@pytest.mark.parametrize("name", KERNELS)
def test_triton_takes_strided_inputs_and_extreme_values(name):
    fn, reference = KERNELS[name]
    gate = torch.tensor([[-1e4, -90.0, -20.0, -1e-8, 0.0, 1e-8, 20.0, 90.0, 1e4]] * 2).T  # (9, 2) transposed
    gate.requires_grad_()
    up = torch.ones(9, 2, requires_grad=True)
    with kernels("triton"):
        got = output_and_grads(fn, gate, up)
    want = output_and_grads(reference, gate, up)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("name", KERNELS)
def test_broadcast_shapes_take_the_reference(name):
    fn, reference = KERNELS[name]
    gate, up = torch.randn(3, 5), torch.randn(5)
    with kernels("triton"):
        assert torch.equal(fn(gate, up), reference(gate, up))


@pytest.mark.parametrize("name", KERNELS)
def test_float64_takes_the_reference_even_when_triton_is_forced(name):
    fn, reference = KERNELS[name]
    gate, up = gate_up((3, 11), dtype=torch.float64)
    with kernels("triton"):
        got = output_and_grads(fn, gate, up)
    want = output_and_grads(reference, gate, up)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_the_references_are_the_old_formulas():
    gate, up = gate_up((4, 9))
    assert torch.equal(swiglu_reference(gate, up), F.silu(gate) * up)
    assert torch.equal(geglu_reference(gate, up), F.gelu(gate, approximate="tanh") * up)


def test_swiglu_mlp_in_auto_on_cpu_is_the_old_layer_bitwise():
    torch.manual_seed(0)
    mlp = SwiGLUMLP(16, 44)
    x = torch.randn(2, 5, 16, requires_grad=True)
    with kernels("auto"):
        y = mlp(x)
    old = mlp.down(F.silu(mlp.gate(x)) * mlp.up(x))  # SwiGLUMLP.forward before the kernel
    assert torch.equal(y, old)
    params = [x, *mlp.parameters()]
    new_grads = torch.autograd.grad(y.sum(), params)
    old_grads = torch.autograd.grad(old.sum(), params)
    assert all(torch.equal(a, b) for a, b in zip(new_grads, old_grads))


def test_swiglu_mlp_and_experts_call_the_kernel(monkeypatch):
    """The layers dispatch through `swiglu` (forced Triton: the kernel's Function runs)."""
    calls = []
    original = glu_kernels._GLU.apply
    monkeypatch.setattr(glu_kernels._GLU, "apply", lambda *a: calls.append(a[2]) or original(*a))
    torch.manual_seed(0)
    mlp, experts = SwiGLUMLP(16, 24), Experts(16, 24, n_experts=3)
    x = torch.randn(7, 16)
    with kernels("triton"):
        torch.testing.assert_close(mlp(x), mlp.down(F.silu(mlp.gate(x)) * mlp.up(x)), **TOL)
        y = experts(x, [3, 0, 4])  # an expert that receives no tokens
    with kernels("torch"):
        torch.testing.assert_close(y, experts(x, [3, 0, 4]), **TOL)
    assert calls == [False, False]  # swiglu both times, not geglu
