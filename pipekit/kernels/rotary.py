"""Rotary embedding applied to q and k: Llama's convention (Hugging Face `rotate_half`).

Each row x of q or k (head_dim D, even) is two halves [x1, x2]; with the tables
cos, sin (T, D) of `pipekit.layers.rotary_cos_sin`, the row at position t becomes

    y = x * cos[t] + rotate_half(x) * sin[t],   rotate_half([x1, x2]) = [-x2, x1]
    y1 = x1 * c1 - x2 * s1,   y2 = x2 * c2 + x1 * s2     (c = [c1, c2], s = [s1, s2])

Backward is the transpose of that rotation, i.e. the inverse rotation (rotate by
-sin): dx = g * cos - rotate_half(g * sin), dx1 = g1 * c1 + g2 * s2,
dx2 = g2 * c2 - g1 * s1. The tables are constants here (no gradient reaches them).

`apply_rotary_reference` is the layer's math as it always was (bitwise); the Triton
side reads q and k in place through their strides (the attention layer's
`b h t d` views of `b t (h d)` need no copy), computes in float32, writes contiguous
outputs, and handles q and k with different head counts (grouped-query attention).
The Triton side takes tables of shape (T, D) (leading 1s allowed) matching q's and k's
last two dims, in q's and k's dtype, that do not require grad; any other tables
(per-batch positions, learned tables, mixed dtypes, which the reference promotes)
take the reference.
"""

from __future__ import annotations

import torch

from .dispatch import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without triton; only the Triton side needs it
    triton = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k, each (..., T, head_dim), by tables (T, head_dim) (broadcast). Plain PyTorch."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k, each (..., T, head_dim), by tables (T, head_dim); q and k may have
    different head counts. Triton or the reference by `use_triton` (see the module docstring)."""
    if use_triton(q, k, cos, sin) and _tables_fit(q, k, cos, sin):
        return _Rotary.apply(q, k, cos, sin)
    return apply_rotary_reference(q, k, cos, sin)


def _tables_fit(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the Triton side covers these tables: (T, D) up to leading 1s, constants."""
    if cos.requires_grad or sin.requires_grad or cos.shape != sin.shape or q.dim() < 2 or k.dim() < 2:
        return False
    if len({q.dtype, k.dtype, cos.dtype, sin.dtype}) > 1:  # the reference would promote
        return False
    if q.shape[-2:] != k.shape[-2:] or q.shape[-1] % 2:
        return False
    return cos.dim() >= 2 and cos.shape[-2:] == q.shape[-2:] and all(n == 1 for n in cos.shape[:-2])


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    """x (..., T, D) as (A, H, T, D), a view when the strides allow (the `b h t d` case)."""
    if x.dim() == 4:
        return x
    if x.dim() < 4:
        return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))
    return x.reshape(-1, *x.shape[-3:])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """One Triton launch: x (..., T, D) rotated (inverse: by -sin, the backward), contiguous."""
    assert triton is not None
    x4 = _as_4d(x)
    A, H, T, D = x4.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cos2, sin2 = cos.reshape(T, D), sin.reshape(T, D)
    n_rows = A * H * T
    if n_rows == 0:
        return out
    half = D // 2
    block_half = triton.next_power_of_2(half)
    block_rows = max(1, min(triton.next_power_of_2(n_rows), 4096 // block_half))  # ~4k elements a program
    grid = (triton.cdiv(n_rows, block_rows),)
    _rotary_kernel[grid](
        x4, cos2, sin2, out, n_rows, H, T, half,
        *x4.stride(), *cos2.stride(), *sin2.stride(),
        INVERSE=inverse, BLOCK_ROWS=block_rows, BLOCK_HALF=block_half,
    )
    return out


class _Rotary(torch.autograd.Function):
    """q, k rotated by Triton; backward rotates the gradients back (by -sin), also Triton."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(q, cos, sin, inverse=False), _rotate(k, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        dq = _rotate(grad_q, cos, sin, inverse=True) if ctx.needs_input_grad[0] else None
        dk = _rotate(grad_k, cos, sin, inverse=True) if ctx.needs_input_grad[1] else None
        return dq, dk, None, None


if triton is not None:

    @triton.jit
    def _rotary_kernel(X, COS, SIN, Y, n_rows, H, T, half,
                       sxa, sxh, sxt, sxd, sct, scd, sst, ssd,
                       INVERSE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_HALF: tl.constexpr):
        """Rows r = (a*H + h)*T + t of X (A, H, T, D) strided; Y (A, H, T, D) contiguous."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # int64 offsets
        cols = tl.arange(0, BLOCK_HALF)
        row_ok = rows < n_rows
        t = rows % T
        ah = rows // T
        x_row = (ah // H) * sxa + (ah % H) * sxh + t * sxt
        mask = row_ok[:, None] & (cols < half)[None, :]
        x1_at = X + x_row[:, None] + cols[None, :] * sxd
        x1 = tl.load(x1_at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x1_at + half * sxd, mask=mask, other=0.0).to(tl.float32)
        c_at = COS + t[:, None] * sct + cols[None, :] * scd
        s_at = SIN + t[:, None] * sst + cols[None, :] * ssd
        c1 = tl.load(c_at, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(c_at + half * scd, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(s_at, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(s_at + half * ssd, mask=mask, other=0.0).to(tl.float32)
        if INVERSE:  # the transpose: dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:  # y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        y_at = Y + rows[:, None] * (2 * half) + cols[None, :]
        tl.store(y_at, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(y_at + half, y2.to(Y.dtype.element_ty), mask=mask)
