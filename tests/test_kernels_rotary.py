"""The rotary kernel (pipekit/kernels/rotary.py): its Triton program, run on CPU tensors in
Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py), against the reference,
outputs and the gradients of q and k; "auto" on CPU is the layer's old math bit for bit;
float64 takes the reference. Whole models with every kernel: tests/test_kernels_models.py.

Tolerance for the Triton side in float32: each output element is two products and one
sum of float32 values computed in float32, as in the reference; the interpreter is in
fact bit-identical, but a GPU may fuse a multiply-add (one rounding fewer), so 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from pipekit.kernels import kernels
from pipekit.kernels.rotary import apply_rotary, apply_rotary_reference
from pipekit.layers import apply_rotary as layer_apply_rotary
from pipekit.layers import rotary_cos_sin

TOL = {"rtol": 1e-6, "atol": 1e-6}  # see the module docstring


def old_apply_rotary(q, k, cos, sin):
    """pipekit/layers/rotary.py's apply_rotary before the kernel, verbatim."""
    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def qk(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, dtype=torch.float32, seed: int = 0):
    """q, k as the attention layer makes them: `b h t d` views of `b t (h d)` (strided), leaves."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads * head_dim, generator=gen, dtype=dtype)
    k = torch.randn(batch, seq, kv_heads * head_dim, generator=gen, dtype=dtype)
    q = q.requires_grad_().view(batch, seq, heads, head_dim).transpose(1, 2)
    k = k.requires_grad_().view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    return q, k


def outputs_and_grads(fn, q, k, cos, sin, seed: int = 1):
    """fn's (q, k) outputs and the gradients of q's and k's leaves under random output grads."""
    rq, rk = fn(q, k, cos, sin)
    gen = torch.Generator().manual_seed(seed)
    gq, gk = torch.randn(rq.shape, generator=gen, dtype=rq.dtype), torch.randn(rk.shape, generator=gen, dtype=rk.dtype)
    leaves = [q._base if q._base is not None else q, k._base if k._base is not None else k]
    grads = torch.autograd.grad((rq * gq).sum() + (rk * gk).sum(), leaves)
    return [rq, rk, *grads]


@pytest.mark.parametrize(("head_dim", "theta", "heads", "kv_heads", "seq"), [
    (6, 10000.0, 4, 2, 9),  # the smallest useful head dim, grouped-query
    (10, 500000.0, 3, 3, 1),  # one token, Llama-3's theta
    (80, 1e6, 4, 1, 9),  # 72 q rows: two programs of 64 rows, the second partly masked
    (96, 10000.0, 2, 2, 5),
    (112, 1e4, 4, 2, 3),  # half = 56: a block of 64 columns, 8 masked
])
def test_triton_matches_the_reference_outputs_and_grads(head_dim, theta, heads, kv_heads, seq):
    q, k = qk(2, heads, kv_heads, seq, head_dim)
    cos, sin = rotary_cos_sin(seq, head_dim, theta)
    with kernels("triton"):
        got = outputs_and_grads(apply_rotary, q, k, cos, sin)
    want = outputs_and_grads(apply_rotary_reference, q, k, cos, sin)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, **TOL)


def test_triton_takes_contiguous_inputs_of_other_ranks():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 7, 10, generator=gen, requires_grad=True)  # five dims
    k = torch.randn(7, 10, generator=gen, requires_grad=True)  # (T, D)
    cos, sin = rotary_cos_sin(7, 10, 10000.0)
    with kernels("triton"):
        got = outputs_and_grads(apply_rotary, q, k, cos[None, None], sin[None, None])  # leading 1s allowed
    want = outputs_and_grads(apply_rotary_reference, q, k, cos, sin)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_backward_is_the_inverse_rotation():
    """The gradient of a rotation is the rotation by -sin: rotating q forward then feeding
    the result as the output gradient gives q back."""
    q, k = qk(1, 2, 2, 6, 8)
    cos, sin = rotary_cos_sin(6, 8, 10000.0)
    with kernels("triton"):
        rq, rk = apply_rotary(q, k, cos, sin)
        dq, dk = torch.autograd.grad((rq, rk), (q, k), (rq.detach(), rk.detach()))
    torch.testing.assert_close(dq, q.detach(), rtol=1e-5, atol=1e-6)  # cos^2 + sin^2 = 1 in float32
    torch.testing.assert_close(dk, k.detach(), rtol=1e-5, atol=1e-6)


def test_tables_the_triton_side_does_not_cover_take_the_reference():
    q, k = qk(2, 2, 2, 4, 6)
    cos, sin = rotary_cos_sin(4, 6, 10000.0)
    per_batch = cos.expand(2, 1, 4, 6), sin.expand(2, 1, 4, 6)  # per-batch positions
    learned = cos.clone().requires_grad_(), sin.clone().requires_grad_()  # tables that take a gradient
    half = cos.half(), sin.half()  # another dtype than q's: the reference promotes
    with kernels("triton"):
        for c, s in (per_batch, learned, half):
            got = apply_rotary(q, k, c, s)
            assert all(torch.equal(g, w) for g, w in zip(got, old_apply_rotary(q, k, c, s)))
        grad = torch.autograd.grad(apply_rotary(q, k, *learned)[0].sum(), learned[1])[0]
    assert grad.abs().sum() > 0


def test_auto_on_cpu_is_the_old_layer_bitwise():
    q, k = qk(2, 4, 2, 9, 10)
    cos, sin = rotary_cos_sin(9, 10, 10000.0)
    with kernels("auto"):
        got = outputs_and_grads(layer_apply_rotary, q, k, cos, sin)
    want = outputs_and_grads(old_apply_rotary, q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_float64_takes_the_reference_even_when_triton_is_forced():
    q, k = qk(2, 4, 2, 9, 10, dtype=torch.float64)
    cos, sin = rotary_cos_sin(9, 10, 10000.0, dtype=torch.float64)
    with kernels("triton"):
        got = outputs_and_grads(layer_apply_rotary, q, k, cos, sin)
    want = outputs_and_grads(old_apply_rotary, q, k, cos, sin)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_odd_head_dims_are_still_refused():
    with pytest.raises(ValueError, match="even head_dim, got head_dim=7"):
        rotary_cos_sin(4, 7)
