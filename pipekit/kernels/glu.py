"""Gated linear unit activations, SwiGLU and GeGLU: act(gate) * up, elementwise.

    swiglu(gate, up) = silu(gate) * up,                 silu(g) = g * sigmoid(g)
    geglu(gate, up)  = gelu_tanh(gate) * up,            gelu_tanh(g) = 0.5 g (1 + tanh(z)),
                                                         z = sqrt(2/pi) (g + 0.044715 g^3)

GeGLU uses the tanh approximation of GELU (`F.gelu(approximate="tanh")`, GPT-2's and
Gemma's), not the erf form. The references are exactly `F.silu(gate) * up` (what
SwiGLUMLP and the MoE experts compute) and `F.gelu(gate, approximate="tanh") * up`.

The Triton side reads gate and up, computes in float32 and writes one output in
their dtype; backward recomputes the activation from the saved gate and up (nothing
else is kept) and writes both gradients in one pass:

    d up   = dy * act(g)
    d gate = dy * up * act'(g)
    silu'(g)      = s (1 + g (1 - s)),                  s = sigmoid(g)
    gelu_tanh'(g) = s + 2 g s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 g^2),  s = sigmoid(2z)

(the kernels write 0.5 (1 + tanh(z)) as sigmoid(2z), which has no cancellation for
negative z, and build sigmoid from exp(-|x|), which never overflows).

gate and up must have the same shape (no broadcasting on the Triton side; shapes that
differ take the reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without triton; only the Triton side needs it
    triton = None

BLOCK = 4096  # elements a program: few programs in the interpreter, a plain elementwise tile on a GPU
# 0.7978845608028654 in the kernels below is sqrt(2 / pi) (a jit function reads no plain globals)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, plain PyTorch."""
    return F.silu(gate) * up


def geglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, plain PyTorch."""
    return F.gelu(gate, approximate="tanh") * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; Triton or the reference by `use_triton`."""
    if use_triton(gate, up) and gate.shape == up.shape and gate.dtype == up.dtype:
        return _GLU.apply(gate, up, False)
    return swiglu_reference(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (tanh-approximated GELU); Triton or the reference by `use_triton`."""
    if use_triton(gate, up) and gate.shape == up.shape and gate.dtype == up.dtype:
        return _GLU.apply(gate, up, True)
    return geglu_reference(gate, up)


class _GLU(torch.autograd.Function):
    """act(gate) * up by Triton, forward and backward; `gelu` picks the activation."""

    @staticmethod
    def forward(ctx, gate, up, gelu):
        assert triton is not None
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _glu_forward[(triton.cdiv(n, BLOCK),)](gate, up, out, n, GELU=gelu, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        ctx.gelu = gelu
        return out

    @staticmethod
    def backward(ctx, grad_out):
        assert triton is not None
        gate, up = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _glu_backward[(triton.cdiv(n, BLOCK),)](gate, up, grad_out, d_gate, d_up, n,
                                                    GELU=ctx.gelu, BLOCK=BLOCK)
        return d_gate, d_up, None


if triton is not None:

    @triton.jit
    def _sigmoid(x):
        """sigmoid(x) and 1 - sigmoid(x) = sigmoid(-x), both from e = exp(-|x|) in (0, 1]:
        nothing overflows, and 1 - sigmoid(x) keeps its digits where sigmoid(x) rounds to 1."""
        e = tl.exp(-tl.abs(x))
        big, small = 1.0 / (1.0 + e), e / (1.0 + e)
        return tl.where(x >= 0, big, small), tl.where(x >= 0, small, big)

    @triton.jit
    def _glu_forward(GATE, UP, OUT, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: past 2^31 elements
        ok = at < n
        g = tl.load(GATE + at, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(UP + at, mask=ok, other=0.0).to(tl.float32)
        if GELU:
            s, _ = _sigmoid(2.0 * 0.7978845608028654 * (g + 0.044715 * g * g * g))  # (1 + tanh(z)) / 2
            act = g * s
        else:
            s, _ = _sigmoid(g)
            act = g * s
        tl.store(OUT + at, (act * u).to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _glu_backward(GATE, UP, DOUT, DGATE, DUP, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: past 2^31 elements
        ok = at < n
        g = tl.load(GATE + at, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(UP + at, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DOUT + at, mask=ok, other=0.0).to(tl.float32)
        if GELU:
            s, s_neg = _sigmoid(2.0 * 0.7978845608028654 * (g + 0.044715 * g * g * g))  # (1 + tanh(z)) / 2, 1 - it
            act = g * s
            d_act = s + 2.0 * g * s * s_neg * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
        else:
            s, s_neg = _sigmoid(g)  # sigmoid(g), 1 - sigmoid(g)
            act = g * s
            d_act = s * (1.0 + g * s_neg)
        tl.store(DUP + at, (dy * act).to(DUP.dtype.element_ty), mask=ok)
        tl.store(DGATE + at, (dy * u * d_act).to(DGATE.dtype.element_ty), mask=ok)
