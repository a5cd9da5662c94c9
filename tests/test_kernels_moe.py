"""The MoE kernels, their Triton programs run on CPU tensors in Triton's interpreter
(TRITON_INTERPRET=1, tests/conftest.py) against the references: the grouped GEMM
(pipekit/kernels/grouped_gemm.py, the MoE gemm "triton") against `loop_mm`, the output,
dx and dw, and the MoE layer with gemm="triton" against gemm="loop"; the permute /
unpermute (pipekit/kernels/moe_permute.py) against dispatch.py's old gather and
index_add. "auto" on CPU and float64 take the references. A whole Mixtral with every
kernel (these included): tests/test_kernels_models.py.

Grouped GEMM tolerance in float32, 1e-5 relative and absolute: `tl.dot` in ieee float32 sums each
product over 64-wide k tiles in its own order, torch's CPU matmul in another; over the
reductions here (k up to 130 inputs, up to 50 rows for dw, values ~N(0, 1)) the largest
difference measured is 1.5e-5 absolute on outputs of size ~10 (about 1 ulp of them).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from pipekit.kernels import kernels
from pipekit.kernels.grouped_gemm import grouped_gemm
from pipekit.kernels.moe_permute import moe_permute, moe_permute_reference, moe_unpermute, moe_unpermute_reference
from pipekit.moe import MoEMLP
from pipekit.moe.grouped import GEMMS, loop_mm

# the module itself: the attribute pipekit.kernels.grouped_gemm is the function
gg = importlib.import_module("pipekit.kernels.grouped_gemm")
mp = importlib.import_module("pipekit.kernels.moe_permute")
TOL = {"rtol": 1e-5, "atol": 1e-5}  # see the module docstring


def operands(sizes, n_in, n_out, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), n_in, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(len(sizes), n_in, n_out, generator=gen, dtype=dtype).requires_grad_()
    dy = torch.randn(sum(sizes), n_out, generator=gen, dtype=dtype)
    return x, w, dy


def output_and_grads(fn, x, w, sizes, dy):
    y = fn(x, w, sizes)
    return [y, *torch.autograd.grad(y, (x, w), dy)]


@pytest.mark.parametrize("sizes, n_in, n_out", [
    ([0, 5, 1, 0, 37], 24, 40),  # empty groups, a one-row group, 43 rows: no multiple of the 64-row tile
    ([7], 24, 40),  # E = 1
    ([0, 0, 50, 0], 70, 130),  # every row in one expert; I and O past one tile, no multiple of it
    ([3, 65, 1], 16, 8),  # a group past one row tile, the next tile starting mid-group
])
def test_triton_matches_loop_mm_output_and_grads(sizes, n_in, n_out):
    x, w, dy = operands(sizes, n_in, n_out)
    with kernels("triton"):
        got = output_and_grads(grouped_gemm, x, w, sizes, dy)
    want = output_and_grads(loop_mm, x, w, sizes, dy)
    for g, r in zip(got, want):
        assert g.shape == r.shape and g.dtype == r.dtype
        torch.testing.assert_close(g, r, **TOL)
    empty = [e for e, s in enumerate(sizes) if s == 0]
    assert got[2][empty].abs().sum() == 0  # an empty group's weight gradient is exactly zero


def test_sizes_as_a_device_tensor_and_no_rows_at_all():
    x, w, dy = operands([4, 0, 9], 24, 40)
    with kernels("triton"):
        got = output_and_grads(grouped_gemm, x, w, torch.tensor([4, 0, 9]), dy)
    for g, r in zip(got, output_and_grads(loop_mm, x, w, [4, 0, 9], dy)):
        torch.testing.assert_close(g, r, **TOL)
    x, w, dy = operands([0, 0], 8, 8)
    with kernels("triton"):
        y, dx, dw = output_and_grads(grouped_gemm, x, w, [0, 0], dy)
    assert y.shape == (0, 8) and dx.shape == (0, 8) and torch.equal(dw, torch.zeros(2, 8, 8))


def test_strided_weight_and_expanded_gradient():
    """w as a transposed view (no copy is made of it) and the expanded gradient of a .sum()."""
    sizes = [2, 0, 11]
    x, w, _ = operands(sizes, 24, 40)
    w_t = w.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # strides (., 1, 24)
    with kernels("triton"):
        y = grouped_gemm(x, w_t, sizes)
        got = [y, *torch.autograd.grad(y.sum(), (x, w_t))]
    y = loop_mm(x, w_t, sizes)
    for g, r in zip(got, [y, *torch.autograd.grad(y.sum(), (x, w_t))]):
        torch.testing.assert_close(g, r, **TOL)


def test_triton_under_cpu_autocast_takes_autocast_dtype_operands():
    """Autocast does not cover a Triton program: the gemm casts x and w (fp32 here) to bf16 itself."""
    x, w, _ = operands([3, 0, 5], 16, 24)
    with kernels("triton"), torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_gemm(x, w, [3, 0, 5])
    assert y.dtype == torch.bfloat16
    want = loop_mm(x.detach().bfloat16(), w.detach().bfloat16(), [3, 0, 5])
    torch.testing.assert_close(y.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_registered_as_the_triton_gemm():
    assert GEMMS["triton"] is grouped_gemm


def test_auto_on_cpu_and_float64_take_the_reference(monkeypatch):
    def refuse(*args):
        raise AssertionError("the Triton side ran")

    monkeypatch.setattr(gg._GroupedGemm, "apply", refuse)
    sizes = [0, 5, 1, 0, 37]
    x, w, dy = operands(sizes, 24, 40)
    with kernels("auto"):  # CPU: the reference, bitwise loop_mm
        got = output_and_grads(grouped_gemm, x, w, sizes, dy)
    for g, r in zip(got, output_and_grads(loop_mm, x, w, sizes, dy)):
        assert torch.equal(g, r)
    x, w, dy = operands(sizes, 24, 40, dtype=torch.float64)
    with kernels("triton"):
        got = output_and_grads(grouped_gemm, x, w, sizes, dy)
    for g, r in zip(got, output_and_grads(loop_mm, x, w, sizes, dy)):
        assert torch.equal(g, r)


def moe_run(gemm, mode, activation="swiglu"):
    torch.manual_seed(0)
    layer = MoEMLP(24, 40, 6, 2, activation=activation, bias=activation == "gelu", gemm=gemm)
    x = torch.randn(2, 9, 24, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(2, 9, 24, generator=torch.Generator().manual_seed(2))
    with kernels(mode):
        out = layer(x)
        grads = torch.autograd.grad(out, [x, *layer.parameters()], g)
    return [out, *grads]


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_moe_layer_with_triton_gemm_matches_the_loop(activation):
    """A whole MoEMLP, forced Triton (grouped gemm, SwiGLU, permute / unpermute) against gemm="loop" under
    kernels="torch": 1e-5 as above (three chained gemms and the Triton SwiGLU; measured at most
    6e-8, the experts' values being small at init std 0.02)."""
    got = moe_run("triton", "triton", activation)
    want = moe_run("loop", "torch", activation)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, **TOL)


def test_moe_layer_auto_on_cpu_is_bitwise_the_loop():
    for g, r in zip(moe_run("triton", "auto"), moe_run("loop", "auto")):
        assert torch.equal(g, r)


# ---- permute / unpermute (pipekit/kernels/moe_permute.py) -----------------------------------
def routed(tokens=13, d=300, seed=0):
    """token_N with tokens routed twice, once and never (6, 9, 10, 11), in a shuffled slot order;
    D = 300: two D chunks of 256 in the interpreter, the second partly masked."""
    gen = torch.Generator().manual_seed(seed)
    token_N = torch.tensor([0, 0, 1, 3, 3, 5, 7, 7, 8, 12, 2, 2, 4])
    token_N = token_N[torch.randperm(token_N.numel(), generator=gen)]
    x = torch.randn(tokens, d, generator=gen).requires_grad_()
    y = torch.randn(token_N.numel(), d, generator=gen).requires_grad_()
    weight = torch.rand(token_N.numel(), generator=gen).requires_grad_()
    return token_N, x, y, weight


def grads_of(out, inputs, seed=3):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return [out, *torch.autograd.grad(out, inputs, dout)]


def test_permute_matches_the_reference_bitwise():
    """A gather, and its backward a per-token sum over its slots in slot order, as index_add's."""
    token_N, x, _, _ = routed()
    with kernels("triton"):
        got = grads_of(moe_permute(x, token_N), [x])
    for g, r in zip(got, grads_of(moe_permute_reference(x, token_N), [x])):
        assert torch.equal(g, r)


def test_unpermute_matches_the_reference():
    """Output and dy bitwise (the same products, summed in slot order); the weights' gradient is a
    dot product over D, summed in another order: 1e-5 (measured 6e-6 over D = 300)."""
    token_N, _, y, weight = routed()
    with kernels("triton"):
        got = grads_of(moe_unpermute(y, token_N, weight, 13, torch.float32), [y, weight])
    want = grads_of(moe_unpermute_reference(y, token_N, weight, 13, torch.float32), [y, weight])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], **TOL)


def test_permute_and_unpermute_with_no_slots():
    token_N, x, y, weight = routed()
    none = token_N[:0]
    with kernels("triton"):
        assert moe_permute(x, none).shape == (0, 300)
        out = moe_unpermute(y[:0], none, weight[:0], 13, torch.float32)
        assert torch.equal(out, torch.zeros(13, 300))


def test_permute_kernels_in_auto_on_cpu_and_float64_take_the_reference(monkeypatch):
    def refuse(*args):
        raise AssertionError("the Triton side ran")

    monkeypatch.setattr(mp._Permute, "apply", refuse)
    monkeypatch.setattr(mp._Unpermute, "apply", refuse)
    token_N, x, y, weight = routed()
    moe_permute(x, token_N), moe_unpermute(y, token_N, weight, 13, torch.float32)
    with kernels("triton"):
        moe_permute(x.double(), token_N), moe_unpermute(y.double(), token_N, weight.double(), 13, torch.float64)


# ---- a whole tiny Mixtral ---------------------------------------------------------------------
