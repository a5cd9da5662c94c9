"""RMSNorm and LayerNorm over the last dim, forward and backward (input, weight and bias
gradients), optionally fused with the residual add.

    y = rms_norm(x, weight, eps)                         weight * (x / sqrt(mean(x^2) + eps))
    y, s = rms_norm(x, weight, eps, residual=r)          s = x + r, y = rms_norm(s, weight, eps)
    y = layer_norm(x, weight, bias, eps)                 F.layer_norm(x, weight.shape, weight, bias, eps)
    y, s = layer_norm(x, weight, bias, eps, residual=r)  s = x + r, y = layer_norm(s, weight, bias, eps)

With a residual the sum `s` comes back beside the normalised output, as in vLLM's and
Liger's fused add + RMSNorm: in a pre-norm block `h, res = rms_norm(attn_out, w, eps,
residual=res)` both adds the branch to the stream (`res` is what the next residual add
takes) and normalises the sum in one pass over memory. Both outputs are differentiable;
the gradient reaching `s` is added to the one coming back through the norm, and x and
residual get that sum (cast to their dtypes). (When only `s` reaches the loss the
Triton side gives the weight a zero gradient where the reference leaves it None.)

The references (`rms_norm_reference`, `layer_norm_reference`) are exactly what
`pipekit.layers.norm` computed before it called this file: RMSNorm normalises in float32
(float64 stays float64) and casts back to x's dtype before the weight multiplies it (the
output has the dtype of `weight * x`), as Hugging Face's LlamaRMSNorm does; LayerNorm is
`F.layer_norm`. Which side runs is `use_triton`'s rule (pipekit/kernels/dispatch.py):
float64 and CPU tensors in "auto" take the reference, bitwise the old layer.

The Triton side (`_NormFn`):
- forward: one program per block of BLOCK_M rows, the whole hidden dim in one block
  (BLOCK_N = next power of two >= N, masked), statistics accumulated in float32. It
  stores the output, the per-row 1/rms (and mean, for LayerNorm) in float32 and, with a
  residual, the sum in the dtype of x + residual (rounded there before it is normalised,
  as the reference's add is).
- backward: a fixed number of programs (the SM count on CUDA, 4 in the interpreter), each
  walking a contiguous run of row blocks: dx per row from the saved statistics (the input
  is re-read, the normalised value recomputed), and the program's partial weight and bias
  gradients accumulated in float32 registers and written to a (programs, N) float32
  buffer, summed over programs afterwards in torch (a fixed order: deterministic, no
  atomics). dx is not rounded through x's dtype between the norm's terms (the reference's
  autograd rounds `dy * weight` to x's dtype first; the same in float32).
Limits: the hidden dim must fit one block (N <= 65536, else a ValueError naming
kernels='torch'); weight and bias have shape (N,) and the residual x's shape (no
broadcasting); empty inputs take the reference.
"""

from __future__ import annotations

from typing import Any, overload

import torch
import torch.nn.functional as F

from .dispatch import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the references need no triton
    triton = None

MAX_N = 65536  # the widest hidden dim one block holds
_TILE = 8192  # elements per forward/backward tile: BLOCK_M = _TILE // BLOCK_N rows (at least 1)
_INTERPRETER_PROGRAMS = 4  # backward programs off CUDA (each program instance is slow in the interpreter)


# ---------------------------------------------------------------------------------------------
# References: the layer's math before the kernels, differentiable by autograd.


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       residual: torch.Tensor | None = None) -> Any:
    """`rms_norm` in plain PyTorch (see the module docstring); bitwise the old RMSNorm layer."""
    if residual is not None:
        s = x + residual
        return rms_norm_reference(s, weight, eps), s
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         eps: float = 1e-5, residual: torch.Tensor | None = None) -> Any:
    """`layer_norm` in plain PyTorch: F.layer_norm, bitwise the old LayerNorm layer."""
    if residual is not None:
        s = x + residual
        return layer_norm_reference(s, weight, bias, eps), s
    return F.layer_norm(x, weight.shape, weight, bias, eps)


# ---------------------------------------------------------------------------------------------
# Public functions: the dispatch rule, then the Triton Function or the reference.


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = ..., residual: None = ...) -> torch.Tensor: ...
@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = ...,
             *, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None) -> Any:
    """RMSNorm over the last dim of x (weight: (N,)), Llama's: the output is
    `weight * (x / sqrt(mean(x^2) + eps))` with the normalisation in float32 and cast back to
    x's dtype before the weight. With `residual` (x's shape) returns `(y, s)`: `s = x +
    residual` and `y` its norm. Triton or the reference by `use_triton` (module docstring)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if use_triton(*tensors) and x.numel():
        return _NormFn.apply(x, residual, weight, None, eps, True)
    return rms_norm_reference(x, weight, eps, residual)


@overload
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = ..., eps: float = ...,
               residual: None = ...) -> torch.Tensor: ...
@overload
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = ..., eps: float = ...,
               *, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5,
               residual: torch.Tensor | None = None) -> Any:
    """LayerNorm over the last dim of x (weight and the optional bias: (N,)), the output in
    x's dtype, as `F.layer_norm(x, weight.shape, weight, bias, eps)`. With `residual` (x's
    shape) returns `(y, s)`: `s = x + residual` and `y` its norm. Triton or the reference by
    `use_triton` (module docstring)."""
    tensors = tuple(t for t in (x, weight, bias, residual) if t is not None)
    if use_triton(*tensors) and x.numel():
        return _NormFn.apply(x, residual, weight, bias, eps, False)
    return layer_norm_reference(x, weight, bias, eps, residual)


# ---------------------------------------------------------------------------------------------
# Triton programs.

if triton is not None:

    @triton.jit
    def _norm_fwd(X, R, S, W, B, Y, MEAN, RSTD, M, N, eps,
                  RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Rows [pid * BLOCK_M, +BLOCK_M) of the (M, N) input: Y, the statistics, and S = X + R."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_mask = rows < M
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]  # (BLOCK_M, BLOCK_N)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:  # round the sum to its dtype (S's) before normalising it, as the reference's add does
            s = (x + tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)).to(S.dtype.element_ty)
            tl.store(S + offs, s, mask=mask)
            x = s.to(tl.float32)
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        if RMS:
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
            # the layer casts the normalised value back to the input's dtype before the weight
            xhat = (x * rstd[:, None]).to(S.dtype.element_ty).to(tl.float32)
            y = xhat * w[None, :]
        else:
            mean = tl.sum(x, axis=1) / N
            tl.store(MEAN + rows, mean, mask=row_mask)
            xc = tl.where(mask, x - mean[:, None], 0.0)
            rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
            y = xc * rstd[:, None] * w[None, :]
            if HAS_BIAS:
                y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(RSTD + rows, rstd, mask=row_mask)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_bwd(DY, DS_OUT, S, W, MEAN, RSTD, DS, DW, DB, M, N, tiles_per_program,
                  RMS: tl.constexpr, HAS_DS_OUT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Row blocks [pid * tiles_per_program, +tiles_per_program): DS = d(loss)/d(normalised
        input) (+ DS_OUT, the gradient reaching the residual sum) per row, and this program's
        partial weight (and bias) gradients in row pid of DW (DB), (programs, N) float32."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
        db = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for i in range(tiles_per_program):
            rows = (pid * tiles_per_program + i) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            mask = row_mask[:, None] & col_mask[None, :]
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            x = tl.load(S + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            if RMS:
                xhat = x * rstd[:, None]
                dw += tl.sum(dy * xhat.to(S.dtype.element_ty).to(tl.float32), axis=0)
                g = dy * w[None, :]
                dx = rstd[:, None] * (g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None])
            else:
                mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
                dw += tl.sum(dy * xhat, axis=0)
                if HAS_BIAS:
                    db += tl.sum(dy, axis=0)
                g = dy * w[None, :]
                c1 = tl.sum(g * xhat, axis=1) / N
                c2 = tl.sum(g, axis=1) / N
                dx = rstd[:, None] * (g - xhat * c1[:, None] - c2[:, None])
            if HAS_DS_OUT:
                dx += tl.load(DS_OUT + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(DS + offs, dx.to(DS.dtype.element_ty), mask=mask)
        tl.store(DW + pid * N + cols, dw, mask=col_mask)
        if HAS_BIAS:
            tl.store(DB + pid * N + cols, db, mask=col_mask)


def _blocks(M: int, N: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for an (M, N) input."""
    if N > MAX_N:
        raise ValueError(f"the Triton norm holds the hidden dim in one block: N={N} > {MAX_N}; use kernels='torch'")
    block_n = triton.next_power_of_2(N)
    block_m = min(triton.next_power_of_2(M), max(1, _TILE // block_n))
    tile = block_m * block_n
    return block_m, block_n, 4 if tile <= 2048 else 8 if tile <= 8192 else 16


def _backward_programs(device: torch.device, tiles: int) -> tuple[int, int]:
    """(programs, row blocks per program) for the backward."""
    most = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
        else _INTERPRETER_PROGRAMS
    per = triton.cdiv(tiles, min(tiles, most))
    return triton.cdiv(tiles, per), per


class _NormFn(torch.autograd.Function):
    """RMSNorm (`rms=True`) or LayerNorm over the last dim, with the optional residual add;
    forward and backward are the Triton programs above. Returns y, or (y, x + residual)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                bias: torch.Tensor | None, eps: float, rms: bool) -> Any:
        N = x.shape[-1]
        if weight.shape != (N,) or (bias is not None and bias.shape != (N,)):
            raise ValueError(f"norm weight/bias must have shape ({N},), got {tuple(weight.shape)}")
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        x2 = x.reshape(-1, N).contiguous()
        M = x2.shape[0]
        block_m, block_n, warps = _blocks(M, N)
        if residual is not None:
            r2 = residual.reshape(-1, N).contiguous()
            s = torch.empty_like(x2, dtype=torch.promote_types(x.dtype, residual.dtype))
        else:
            r2 = s = x2  # S is X: its dtype is the one the normalised value is rounded to
        y = torch.empty_like(s, dtype=torch.promote_types(weight.dtype, s.dtype) if rms else s.dtype)
        w = weight.contiguous()
        b = bias.contiguous() if bias is not None else w
        mean = torch.empty(M, dtype=torch.float32, device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        _norm_fwd[(triton.cdiv(M, block_m),)](x2, r2, s, w, b, y, mean, rstd, M, N, eps, RMS=rms,
                                              HAS_RES=residual is not None, HAS_BIAS=bias is not None,
                                              BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(s, w, mean, rstd)
        res_dtype = None if residual is None else residual.dtype
        ctx.meta = (rms, None if bias is None else bias.dtype, x.shape, x.dtype, res_dtype)
        if residual is None:
            return y.view(x.shape)
        return y.view(x.shape), s.view(x.shape)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        s, w, mean, rstd = ctx.saved_tensors
        rms, bias_dtype, shape, x_dtype, res_dtype = ctx.meta
        has_bias = bias_dtype is not None
        M, N = s.shape
        block_m, block_n, warps = _blocks(M, N)
        programs, per = _backward_programs(s.device, triton.cdiv(M, block_m))
        dy = grads[0].reshape(-1, N).contiguous()
        ds_out = grads[1].reshape(-1, N).contiguous() if res_dtype is not None else dy
        ds = torch.empty_like(s)
        dw = torch.empty(programs, N, dtype=torch.float32, device=s.device)
        db = torch.empty(programs, N, dtype=torch.float32, device=s.device) if has_bias else dw
        _norm_bwd[(programs,)](dy, ds_out, s, w, mean, rstd, ds, dw, db, M, N, per, RMS=rms,
                               HAS_DS_OUT=res_dtype is not None, HAS_BIAS=has_bias,
                               BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        dx = ds.view(shape).to(x_dtype) if ctx.needs_input_grad[0] else None
        dres = ds.view(shape).to(res_dtype) if res_dtype is not None and ctx.needs_input_grad[1] else None
        dweight = dw.sum(0).to(w.dtype) if ctx.needs_input_grad[2] else None
        dbias = db.sum(0).to(bias_dtype) if has_bias and ctx.needs_input_grad[3] else None
        return dx, dres, dweight, dbias, None, None
