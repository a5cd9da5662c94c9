"""linear_cross_entropy (pipekit/kernels/linear_cross_entropy.py): the chunked reference
against the eager oracle (logits materialised, autograd), the Triton side (in the
interpreter, TRITON_INTERPRET=1 from conftest) against the reference, and tp=2 against
tp=1. Every case checks the loss, dh and dw."""

import importlib

import pytest
import torch
import torch.distributed as dist

from pipekit.kernels import (
    kernels,
    linear_cross_entropy,
    linear_cross_entropy_eager,
    linear_cross_entropy_reference,
)
from pipekit.kernels.linear_cross_entropy import default_chunk_tokens
from pipekit.testing import run_distributed

IGNORE = -100


def _inputs(n, d, v, dtype, *, vocab_size=None, ignored_every=4, seed=0, shape=None):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(v, d, generator=g, dtype=torch.float64) * d ** -0.5 * 2
    labels = torch.randint(0, vocab_size or v, (n,), generator=g)
    if ignored_every:
        labels[::ignored_every] = IGNORE
    weights = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    if shape is not None:
        h, labels, weights = h.view(*shape, d), labels.view(shape), weights.view(shape)
    return h.to(dtype), w.to(dtype), labels, weights.to(dtype)


def _run(fn, h, w, labels, grad_out=1.7, **kw):
    """(loss, dh, dw) of fn, with an incoming gradient that is not 1 (backward scales by it)."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(h, w, labels, **kw)
    (loss * grad_out).backward()
    return loss.detach(), h.grad, w.grad


def _close(got, want, tol):
    for name, a, b in zip(("loss", "dh", "dw"), got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


# (n, d, v, chunk, options): awkward shapes, every option
CASES = {
    "v77-n37-chunk8": (37, 16, 77, 8, {}),
    "sum": (37, 16, 77, 8, {"reduction": "sum"}),
    "weights": (37, 16, 77, 10, {"weights": True}),
    "weights-sum": (37, 16, 77, 64, {"weights": True, "reduction": "sum"}),
    "one-token": (1, 16, 77, 8, {}),
    "padded-vocab": (23, 8, 80, 7, {"vocab_size": 77}),
    "batch-by-time": (12, 8, 77, 5, {"shape": (3, 4)}),
    "default-chunk": (37, 16, 77, None, {}),
    "v50257": (6, 8, 50257, 4, {"weights": True}),
}


def _case(name, dtype):
    n, d, v, chunk, opts = CASES[name]
    opts = dict(opts)
    h, w, labels, weights = _inputs(n, d, v, dtype, vocab_size=opts.get("vocab_size"),
                                    ignored_every=4 if n > 1 else 0, shape=opts.pop("shape", None))
    if opts.pop("weights", False):
        opts["weights_N"] = weights
    return h, w, labels, chunk, opts


@pytest.mark.parametrize("name", list(CASES))
def test_chunked_reference_equals_the_eager_loss_in_float64(name):
    h, w, labels, chunk, opts = _case(name, torch.float64)
    want = _run(linear_cross_entropy_eager, h, w, labels, **opts)
    got = _run(linear_cross_entropy_reference, h, w, labels, chunk_tokens=chunk, **opts)
    _close(got, want, 1e-10)  # the same float64 math in another summation order


@pytest.mark.parametrize("name", ["v77-n37-chunk8", "weights-sum", "padded-vocab", "v50257"])
def test_chunked_reference_equals_the_eager_loss_in_float32(name):
    h, w, labels, chunk, opts = _case(name, torch.float32)
    want = _run(linear_cross_entropy_eager, h, w, labels, **opts)
    got = _run(linear_cross_entropy_reference, h, w, labels, chunk_tokens=chunk, **opts)
    _close(got, want, 1e-5)  # float32 rounding of sums over up to 50k vocabulary entries and 37 tokens


@pytest.mark.parametrize("name", list(CASES))
def test_triton_side_equals_the_reference_in_float32(name):
    h, w, labels, chunk, opts = _case(name, torch.float32)
    want = _run(linear_cross_entropy_reference, h, w, labels, chunk_tokens=chunk, **opts)
    with kernels("triton"):
        got = _run(linear_cross_entropy, h, w, labels, chunk_tokens=chunk, **opts)
    # same matmuls; the softmax step differs only in its order of summation (online max and
    # sum over vocabulary tiles vs torch's reductions): float32 rounding, relative ~1e-6
    _close(got, want, 1e-5)


@pytest.mark.parametrize("name", ["v77-n37-chunk8", "weights-sum", "padded-vocab", "default-chunk"])
def test_bf16_weight_gradient_comes_from_a_bf16_matmul_as_close_as_eager_bf16(name):
    """bf16 h and w: dw is made in bf16 (each chunk's share by a bf16 matmul, added in one
    addmm), with no float32 (V, D) buffer; against the float64 truth its error is within twice
    that of the eager bf16 loss (logits materialised) plus a bf16 rounding step. float32 and
    float64 keep their float32 / float64 dw."""
    lce = importlib.import_module("pipekit.kernels.linear_cross_entropy")  # the package exports a function so named
    h, w, labels, chunk, opts = _case(name, torch.float64)
    truth = _run(linear_cross_entropy_eager, h, w, labels, **opts)
    eager = _run(linear_cross_entropy_eager, h.bfloat16(), w.bfloat16(), labels, **opts)
    got = _run(linear_cross_entropy_reference, h.bfloat16(), w.bfloat16(), labels, chunk_tokens=chunk, **opts)
    for what, g, e, t in zip(("loss", "dh", "dw"), got, eager, truth):
        scale = t.abs().max()
        err, eager_err = ((x.double() - t).abs().max() / scale for x in (g, e))
        assert err <= 2 * eager_err + 2**-8, f"{name} {what}: {err:.3g} against eager bf16's {eager_err:.3g}"
    weights = opts.get("weights_N")
    for dtype, dw_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                            (torch.float64, torch.float64)):
        hd, wd = h.to(dtype), w.to(dtype)
        _, dh, dw = lce._chunked(hd, wd, labels, None if weights is None else weights.to(dtype), IGNORE,
                                 opts.get("reduction", "mean"), chunk or 64, opts.get("vocab_size") or w.shape[0],
                                 0, None, False, True, True)
        assert (dh.dtype, dw.dtype) == (dtype, dw_dtype)


@pytest.mark.parametrize("side", ["torch", "triton"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_tokens_ignored_gives_loss_zero_and_zero_gradients(side, reduction):
    h, w, labels, _ = _inputs(9, 8, 77, torch.float32, ignored_every=0)
    labels[:] = IGNORE
    with kernels(side):
        loss, dh, dw = _run(linear_cross_entropy, h, w, labels, chunk_tokens=4, reduction=reduction)
    assert loss.item() == 0.0  # "mean" divides by max(count, 1): 0, not NaN
    assert not dh.any() and not dw.any()


def test_auto_on_cpu_is_the_reference_bit_for_bit_and_float64_never_goes_to_triton():
    h, w, labels, _ = _inputs(37, 16, 77, torch.float32)
    want = _run(linear_cross_entropy_reference, h, w, labels, chunk_tokens=8)
    with kernels("auto"):
        got = _run(linear_cross_entropy, h, w, labels, chunk_tokens=8)
    _close(got, want, 0.0)
    h, w, labels, _ = _inputs(37, 16, 77, torch.float64)
    want = _run(linear_cross_entropy_reference, h, w, labels, chunk_tokens=8)
    with kernels("triton"):
        got = _run(linear_cross_entropy, h, w, labels, chunk_tokens=8)
    _close(got, want, 0.0)


def test_without_gradients_only_the_loss_is_made():
    h, w, labels, _ = _inputs(37, 16, 77, torch.float64)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, labels, chunk_tokens=8)
    torch.testing.assert_close(loss, linear_cross_entropy_eager(h, w, labels), rtol=1e-12, atol=1e-12)


def test_a_second_backward_says_why_it_cannot_run():
    h, w, labels, _ = _inputs(5, 8, 77, torch.float64)
    h.requires_grad_()
    loss = linear_cross_entropy(h, w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward pass"):
        loss.backward()


def test_bad_arguments_are_named():
    h, w, labels, _ = _inputs(5, 8, 77, torch.float64)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, labels, reduction="none")
    with pytest.raises(ValueError, match="disagree"):
        linear_cross_entropy(h, w, labels[:4])


def test_default_chunk_makes_the_chunk_logits_about_as_large_as_h_but_at_least_64_tokens():
    assert default_chunk_tokens(8192, 128256, 4096) == 256  # 8192 / ceil(128256 / 4096) = 256
    assert default_chunk_tokens(1, 50257, 8) == 1  # never more than N
    assert default_chunk_tokens(1024, 128256, 256) == 64  # the rule's 4 tokens, raised to MIN_CHUNK_TOKENS
    assert default_chunk_tokens(100, 77, 16) == 64


# ---- tp = 2 ---------------------------------------------------------------------------------
# (n, d, v_padded, vocab_size, chunk, reduction, weights, all ignored, dtype)
TP_CASES = [
    (37, 16, 80, 77, 8, "mean", False, False, torch.float64),  # rank 1's shard ends in padding
    (9, 8, 8, 3, 4, "mean", False, False, torch.float64),  # rank 1's shard is all padding
    (37, 16, 78, None, 10, "sum", True, False, torch.float64),
    (7, 8, 78, None, 4, "mean", False, True, torch.float64),
    (37, 16, 80, 77, 8, "mean", True, False, torch.float32),  # the Triton side, interpreted
]


def _tp_worker(cases):
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    out = []
    for n, d, v, vocab_size, chunk, reduction, use_weights, all_ignored, dtype in cases:
        h, w, labels, weights = _inputs(n, d, v, dtype, vocab_size=vocab_size)
        if all_ignored:
            labels[:] = IGNORE
        kw = dict(chunk_tokens=chunk, reduction=reduction, vocab_size=vocab_size,
                  weights_N=weights if use_weights else None)
        side = "torch" if dtype == torch.float64 else "triton"
        with kernels(side):
            whole = _run(linear_cross_entropy, h, w, labels, **kw)
            v_local = v // world
            rows = slice(rank * v_local, (rank + 1) * v_local)
            loss, dh, dw = _run(linear_cross_entropy, h, w[rows], labels, tp_group=group,
                                vocab_start=rank * v_local, **kw)
        out.append(((loss, dh, dw), (whole[0], whole[1], whole[2][rows])))
    return out


def test_tp2_equals_tp1_for_the_loss_the_whole_dh_and_each_ranks_dw():
    for rank, results in enumerate(run_distributed(_tp_worker, 2, TP_CASES, timeout=240)):
        for case, (got, want) in zip(TP_CASES, results):
            # float64: the same math, sums split over two ranks; float32: that and the
            # Triton tiles' order of summation
            tol = 1e-10 if case[-1] == torch.float64 else 1e-5
            try:
                _close(got, want, tol)
            except AssertionError as e:
                raise AssertionError(f"rank {rank}, case {case}: {e}") from None
