"""MoE permute / unpermute: token rows into expert order, and back combining the top-k weights.

    moe_permute(x_TD, token_N)                           x_MD[n] = x_TD[token_N[n]]
    moe_unpermute(y_ND, token_N, weight_N, T, dtype)     out_TD[t] = sum over slots n of t of
                                                                     weight_N[n] * y_ND[n]

`token_N` (int64, on the device) names the token behind each expert-sorted slot (a token
appears at most top_k times, possibly never: dropped or unrouted; an expert may receive
no slot at all). The unpermute accumulates in `dtype` (the routing dtype) and returns
y's dtype. The references are exactly what pipekit/moe/dispatch.py's `permute` and
`combine` computed before they called this file (`x_TD[token_N]`, and an `index_add`
of the weighted rows into zeros), so "auto" on CPU and float64 are bitwise the old path.

The Triton side, by `use_triton` (pipekit/kernels/dispatch.py):
- a row gather, one program per BLOCK_R slots, looping over D in BLOCK_D chunks: the
  permute's forward, and the unpermute's backward (d y[n] = weight[n] * d out[token[n]],
  with d weight[n] = <d out[token[n]], y[n]> reduced in the same pass);
- a per-token sum over its slots, one program per BLOCK_T tokens, reading the slots of
  each token through a CSR built on the device (a stable sort of token_N and
  `searchsorted` bounds; no host sync, no atomics, a fixed order: slots in increasing n,
  as `index_add` adds them): the unpermute's forward (weighted), and the permute's
  backward (unweighted, d x[t] = sum of d x_MD over t's slots).
Sums are in float32 (the product weight * y rounded to float32 before it is added, as
the reference's); float64 takes the reference.
"""

from __future__ import annotations

import torch

from .dispatch import interpreting, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without triton; only the Triton side needs it
    triton = None


def moe_permute_reference(x_TD: torch.Tensor, token_N: torch.Tensor) -> torch.Tensor:
    """x_TD[token_N]: bitwise dispatch.py's old `permute`."""
    return x_TD[token_N]


def moe_unpermute_reference(y_ND: torch.Tensor, token_N: torch.Tensor, weight_N: torch.Tensor, tokens: int,
                            dtype: torch.dtype) -> torch.Tensor:
    """index_add of weight * y into zeros, in `dtype`, back to y's dtype: bitwise dispatch.py's old `combine`."""
    weighted_ND = y_ND.to(dtype) * weight_N.to(dtype).unsqueeze(-1)
    out_TD = torch.zeros(tokens, y_ND.shape[-1], dtype=dtype, device=y_ND.device)
    return out_TD.index_add(0, token_N, weighted_ND).to(y_ND.dtype)


def moe_permute(x_TD: torch.Tensor, token_N: torch.Tensor) -> torch.Tensor:
    """x_TD[token_N], (N, D); Triton or the reference by `use_triton`."""
    if use_triton(x_TD) and x_TD.dim() == 2:
        return _Permute.apply(x_TD, token_N)
    return moe_permute_reference(x_TD, token_N)


def moe_unpermute(y_ND: torch.Tensor, token_N: torch.Tensor, weight_N: torch.Tensor, tokens: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """(tokens, D) in y's dtype: each token's slots' rows times their weights, summed in `dtype`."""
    if (use_triton(y_ND, weight_N) and dtype in (torch.float32, torch.float16, torch.bfloat16)
            and y_ND.dim() == 2):
        return _Unpermute.apply(y_ND, token_N, weight_N, tokens, dtype)
    return moe_unpermute_reference(y_ND, token_N, weight_N, tokens, dtype)


def _blocks(d: int) -> tuple[int, int]:
    """(rows a program, BLOCK_D): many rows a program in the interpreter."""
    block_d = min(triton.next_power_of_2(max(d, 1)), 256 if interpreting() else 128)
    return (64 if interpreting() else 16), block_d


def _csr(token_N: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_N, bounds (tokens + 1,)): token t's slots are order_N[bounds[t]:bounds[t + 1]], increasing."""
    sorted_N, order_N = torch.sort(token_N, stable=True)
    bounds = torch.searchsorted(sorted_N, torch.arange(tokens + 1, device=token_N.device, dtype=sorted_N.dtype))
    return order_N, bounds


def _gather(src_TD: torch.Tensor, token_N: torch.Tensor, out_dtype: torch.dtype, weight_N=None,
            y_ND=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """out[n] = (weight[n] *) src[token[n]]; with y, also dw[n] = <src[token[n]], y[n]> (float32)."""
    assert triton is not None
    n, d = token_N.numel(), src_TD.shape[1]
    out = torch.empty(n, d, dtype=out_dtype, device=src_TD.device)
    dw = torch.empty(n, dtype=torch.float32, device=src_TD.device) if y_ND is not None else None
    if n:
        block_r, block_d = _blocks(d)
        _gather_rows[(triton.cdiv(n, block_r),)](
            src_TD, token_N, out, weight_N if weight_N is not None else out, y_ND if y_ND is not None else out,
            dw if dw is not None else out, n, d, src_TD.stride(0), out.stride(0),
            y_ND.stride(0) if y_ND is not None else 0,
            HAS_W=weight_N is not None, WANT_DW=y_ND is not None, BLOCK_R=block_r, BLOCK_D=block_d)
    return out, dw


def _sum_slots(src_ND: torch.Tensor, token_N: torch.Tensor, tokens: int, out_dtype: torch.dtype,
               weight_N=None) -> torch.Tensor:
    """out[t] = sum over t's slots n of (weight[n] *) src[n], in float32, stored in out_dtype."""
    assert triton is not None
    d = src_ND.shape[1]
    out = torch.empty(tokens, d, dtype=out_dtype, device=src_ND.device)
    if tokens and d:
        order_N, bounds = _csr(token_N, tokens)
        block_t, block_d = _blocks(d)
        _sum_rows[(triton.cdiv(tokens, block_t),)](
            src_ND, weight_N if weight_N is not None else src_ND, order_N, bounds, out, tokens, d,
            src_ND.stride(0), out.stride(0), HAS_W=weight_N is not None, BLOCK_T=block_t, BLOCK_D=block_d)
    return out


class _Permute(torch.autograd.Function):
    """x_TD[token_N] by Triton; backward: the per-token sum of the slots' gradients."""

    @staticmethod
    def forward(ctx, x_TD, token_N):
        x_TD = x_TD.contiguous()
        ctx.save_for_backward(token_N)
        ctx.tokens = x_TD.shape[0]
        return _gather(x_TD, token_N, x_TD.dtype)[0]

    @staticmethod
    def backward(ctx, dx_ND):
        (token_N,) = ctx.saved_tensors
        return _sum_slots(dx_ND.contiguous(), token_N, ctx.tokens, dx_ND.dtype), None


class _Unpermute(torch.autograd.Function):
    """sum of weight * y over each token's slots by Triton; backward: dy and dweight in one gather."""

    @staticmethod
    def forward(ctx, y_ND, token_N, weight_N, tokens, dtype):
        y_ND, weight_N = y_ND.contiguous(), weight_N.contiguous()
        ctx.save_for_backward(y_ND, token_N, weight_N)
        return _sum_slots(y_ND, token_N, tokens, y_ND.dtype, weight_N)

    @staticmethod
    def backward(ctx, dout_TD):
        y_ND, token_N, weight_N = ctx.saved_tensors
        dy, dw = _gather(dout_TD.contiguous(), token_N, y_ND.dtype, weight_N, y_ND)
        assert dw is not None
        return dy, None, dw.to(weight_N.dtype), None, None


if triton is not None:

    @triton.jit
    def _gather_rows(SRC, IDX, OUT, W, Y, DW, n, D, s_src, s_out, s_y,
                     HAS_W: tl.constexpr, WANT_DW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = rows < n
        src_rows = tl.load(IDX + rows, mask=ok, other=0).to(tl.int64)
        if HAS_W:
            w = tl.load(W + rows, mask=ok, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            m = ok[:, None] & (cols < D)[None, :]
            v = tl.load(SRC + src_rows[:, None] * s_src + cols[None, :], mask=m, other=0.0).to(tl.float32)
            if WANT_DW:
                y = tl.load(Y + rows[:, None] * s_y + cols[None, :], mask=m, other=0.0).to(tl.float32)
                dw += tl.sum(v * y, axis=1)
            if HAS_W:
                v = v * w[:, None]
            tl.store(OUT + rows[:, None] * s_out + cols[None, :], v.to(OUT.dtype.element_ty), mask=m)
        if WANT_DW:
            tl.store(DW + rows, dw, mask=ok)

    @triton.jit
    def _sum_rows(SRC, W, ORDER, BOUNDS, OUT, T, D, s_src, s_out,
                  HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        ok = tokens < T
        lo = tl.load(BOUNDS + tokens, mask=ok, other=0)
        count = tl.load(BOUNDS + tokens + 1, mask=ok, other=0) - lo
        most = tl.max(count, axis=0)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            col_ok = cols < D
            acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            for j in range(0, most):
                has = j < count
                slot = tl.load(ORDER + lo + j, mask=has, other=0).to(tl.int64)
                v = tl.load(SRC + slot[:, None] * s_src + cols[None, :], mask=has[:, None] & col_ok[None, :],
                            other=0.0).to(tl.float32)
                if HAS_W:
                    v = v * tl.load(W + slot, mask=has, other=0.0).to(tl.float32)[:, None]
                acc += v
            tl.store(OUT + tokens[:, None] * s_out + cols[None, :], acc.to(OUT.dtype.element_ty),
                     mask=ok[:, None] & col_ok[None, :])
