"""The fused norms (pipekit/kernels/norm.py): the Triton programs, run on CPU tensors in
Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py), against the references —
outputs and every gradient (x, weight, bias, residual) — over awkward shapes; "auto" on
CPU is bitwise the layers' old code; float64 always takes the reference; a Llama and a
GPT-2 block give the same numbers with kernels("triton") as with kernels("torch").

Tolerance, float32: atol = rtol = 1e-5. The Triton programs sum in another order than
torch's reductions (rows of 100 elements, weight gradients over 130 rows summed per
program and then across programs) and keep `dy * weight` in float32 where the reference's
autograd rounds it to x's dtype (the same in float32); the differences seen are ~1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipekit.kernels import kernels, layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from pipekit.kernels import norm as norm_kernel
from pipekit.layers import LayerNorm, RMSNorm, TransformerBlock
from pipekit.models.gpt2 import gpt2_block_parts
from pipekit.models.llama import llama_block_parts

TOL = dict(atol=1e-5, rtol=1e-5)
SHAPES = [(1, 1, 7), (3, 5, 33), (2, 17, 64), (130, 100)]
KINDS = ["rms", "layer", "layer_no_bias"]


def old_rms_norm(x, weight, eps):
    """RMSNorm.forward before the kernels, verbatim."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def make(shape, kind, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x, residual = (torch.randn(shape, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    weight = (1 + 0.5 * torch.randn(n, generator=g, dtype=dtype)).requires_grad_()
    bias = (0.5 * torch.randn(n, generator=g, dtype=dtype)).requires_grad_() if kind == "layer" else None
    return x, residual, weight, bias


def run(mode, kind, x, weight, bias, residual, eps=1e-5):
    """Outputs and the gradients of x, residual, weight, bias (None where not an input) of a
    loss that weighs every output element by a fixed random number."""
    for t in (x, residual, weight, bias):
        if t is not None:
            t.grad = None
    with kernels(mode):
        out = (rms_norm(x, weight, eps, residual=residual) if kind == "rms"
               else layer_norm(x, weight, bias, eps, residual=residual))
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(1)
    sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs).backward()
    return [o.detach() for o in outs], [None if t is None else t.grad for t in (x, residual, weight, bias)]


def assert_same(a, b, **tol):
    (outs_a, grads_a), (outs_b, grads_b) = a, b
    assert len(outs_a) == len(outs_b)
    for p, q in zip(outs_a, outs_b):
        assert p.dtype == q.dtype and p.shape == q.shape
        torch.testing.assert_close(p, q, **tol)
    for name, p, q in zip(("x", "residual", "weight", "bias"), grads_a, grads_b):
        assert (p is None) == (q is None), name
        if p is not None:
            torch.testing.assert_close(p, q, **tol, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_reference_outputs_and_every_gradient(shape, kind, fused):
    x, residual, weight, bias = make(shape, kind)
    residual = residual if fused else None
    assert_same(run("triton", kind, x, weight, bias, residual), run("torch", kind, x, weight, bias, residual), **TOL)


def test_triton_runs_the_autograd_function_when_forced():
    x, residual, weight, _ = make((3, 5, 33), "rms")
    with kernels("triton"):
        y, s = rms_norm(x, weight, 1e-6, residual=residual)
        ln = LayerNorm(33)(x)
        rms = RMSNorm(33)(x)
    assert all(type(t.grad_fn).__name__ == "_NormFnBackward" for t in (y, s, ln, rms))
    with kernels("torch"):
        assert type(RMSNorm(33)(x).grad_fn).__name__ != "_NormFnBackward"


def test_a_gradient_only_through_the_sum_or_only_through_the_norm():
    for used in (0, 1):
        grads = {}
        for mode in ("triton", "torch"):
            x, residual, weight, _ = make((4, 9, 20), "rms", seed=2)
            with kernels(mode):
                out = rms_norm(x, weight, 1e-6, residual=residual)
            (out[used] * torch.linspace(-1, 1, 20)).sum().backward()
            grads[mode] = [x.grad, residual.grad, weight.grad]
        for p, q in zip(grads["triton"], grads["torch"]):  # only s used: the reference leaves weight.grad
            torch.testing.assert_close(p, torch.zeros_like(p) if q is None else q, **TOL)  # None, Triton zeros


def test_non_contiguous_inputs_and_mixed_dtypes_follow_the_reference():
    x, residual, weight, bias = make((6, 40), "layer")
    xt = x.detach().t().contiguous().t().requires_grad_()  # same values, column-major strides
    assert not xt.is_contiguous()
    assert_same(run("triton", "layer", xt, weight, bias, None), run("torch", "layer", xt, weight, bias, None), **TOL)
    # an fp16 input with fp32 weights: the output has the dtype of weight * x (float32), the
    # normalised value rounded to fp16 first (tolerance: one fp16 rounding of the sum's operands)
    x16, r16 = (t.detach().half().requires_grad_() for t in (x, residual))
    a = run("triton", "rms", x16, weight, None, r16)
    assert a[0][0].dtype == torch.float32 and a[0][1].dtype == torch.float16
    assert_same(a, run("torch", "rms", x16, weight, None, r16), atol=2e-3, rtol=2e-3)


def test_auto_on_cpu_is_bitwise_the_old_layers():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = torch.randn(3, 7, 48, dtype=dtype, requires_grad=True)
        rms = RMSNorm(48, eps=1e-5).to(dtype)
        ln = LayerNorm(48).to(dtype)
        with torch.no_grad():
            for p in (rms.weight, ln.weight, ln.bias):
                p.uniform_(-2, 2)
        with kernels("auto"):
            y, z = rms(x), ln(x)
        gy = torch.autograd.grad(y.sum() + z.sum(), [x, rms.weight, ln.weight, ln.bias])
        y_old = old_rms_norm(x, rms.weight, 1e-5)
        z_old = F.layer_norm(x, (48,), ln.weight, ln.bias, 1e-5)
        g_old = torch.autograd.grad(y_old.sum() + z_old.sum(), [x, rms.weight, ln.weight, ln.bias])
        assert torch.equal(y, y_old) and torch.equal(z, z_old) and y.dtype == dtype
        assert all(torch.equal(a, b) for a, b in zip(gy, g_old))


def test_float64_takes_the_reference_even_when_triton_is_forced(monkeypatch):
    def refuse(*args):
        raise AssertionError("the Triton Function ran on float64")

    monkeypatch.setattr(norm_kernel._NormFn, "apply", refuse)
    x, residual, weight, bias = make((5, 24), "layer", dtype=torch.float64)
    with kernels("triton"):
        y, s = rms_norm(x, weight, 1e-6, residual=residual)
        z = layer_norm(x, weight, bias, 1e-5)
    assert torch.equal(y, old_rms_norm(x + residual, weight, 1e-6)) and torch.equal(s, x + residual)
    assert torch.equal(z, F.layer_norm(x, (24,), weight, bias, 1e-5))
    assert torch.equal(y, rms_norm_reference(x + residual, weight, 1e-6))
    assert torch.equal(z, layer_norm_reference(x, weight, bias, 1e-5))


def test_a_hidden_dim_wider_than_one_block_says_what_to_do():
    with kernels("triton"), pytest.raises(ValueError, match="kernels='torch'"):
        rms_norm(torch.ones(1, norm_kernel.MAX_N + 1), torch.ones(norm_kernel.MAX_N + 1))


def test_empty_input_takes_the_reference():
    with kernels("triton"):
        assert rms_norm(torch.ones(0, 8), torch.ones(8)).shape == (0, 8)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_block_gives_the_same_numbers_with_triton_norms(family):
    """A Llama block (RMSNorm) and a GPT-2 block (LayerNorm), float32, forward and every
    parameter's gradient: kernels("triton") against kernels("torch") within atol = rtol =
    1e-5 (only the norms differ, by reduction order, ~1e-6; the rest is the same torch code)."""
    torch.manual_seed(0)
    parts = llama_block_parts(4, 2, 96, 1e-5, 10000.0) if family == "llama" else gpt2_block_parts(4, 96, 1e-5)
    block = TransformerBlock(64, **parts)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))  # not the init's ones and zeros
    x = torch.randn(2, 9, 64)
    results = {}
    for mode in ("triton", "torch"):
        block.zero_grad()
        with kernels(mode):
            y = block(x)
            (y * torch.linspace(-1, 1, 64)).sum().backward()
        results[mode] = y.detach(), {n: p.grad.clone() for n, p in block.named_parameters()}
    torch.testing.assert_close(results["triton"][0], results["torch"][0], **TOL)
    for name, grad in results["triton"][1].items():
        torch.testing.assert_close(grad, results["torch"][1][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_block_fuses_its_second_residual_add_bitwise(family, monkeypatch):
    """TransformerBlock hands its second residual add to norm2 (`residual=`); on the reference
    side that is bitwise the plain add then the norm (float32, output and every gradient)."""
    torch.manual_seed(1)
    parts = llama_block_parts(4, 2, 96, 1e-5, 10000.0) if family == "llama" else gpt2_block_parts(4, 96, 1e-5)
    block = TransformerBlock(64, **parts)
    x = torch.randn(2, 5, 64)
    fused_calls = []
    forward = type(block.norm2).forward

    def spy(self, h, residual=None):
        fused_calls.append(residual is not None)
        return forward(self, h, residual)

    monkeypatch.setattr(type(block.norm2), "forward", spy)

    def plain(blk, x):
        x = x + blk.attn(blk.norm1(x))
        return x + blk.mlp(blk.norm2(x))

    results = []
    for fn in (block, lambda x: plain(block, x)):
        block.zero_grad()
        with kernels("torch"):
            y = fn(x)
            (y * torch.linspace(-1, 1, 64)).sum().backward()
        results.append((y.detach(), [p.grad.clone() for p in block.parameters()]))
    assert fused_calls[:2] == [False, True]  # the block: norm1 plain, norm2 with the residual
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
