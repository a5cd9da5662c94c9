"""Grouped GEMM over variable-size expert groups, forward and both gradients, in Triton.

    y[rows of group e]  = x[rows of group e] @ w[e]          x_NI, w_EIO -> y_NO
    dx[rows of group e] = dy[rows of group e] @ w[e].T       (N, O) -> (N, I)
    dw[e]               = x[rows of group e].T @ dy[rows of group e]   (zero for an empty group)

The rows of x come sorted by group, `sizes[e]` of them for group e (zeros allowed).
`grouped_gemm(x, w, sizes)` is the MoE gemm registered as "triton" in
pipekit/moe/grouped.py; its reference, `grouped_gemm_reference` (a loop of
`x[a:b] @ w[e]`), is that file's gemm "loop" (`loop_mm`) and runs wherever `use_triton`
(pipekit/kernels/dispatch.py) says so: float64, and CPU tensors unless kernels='triton'
is forced under TRITON_INTERPRET=1.

Group offsets stay on the device. The Triton side reads two int32 tensors: the
cumulative row offsets `offs` (E + 1 entries, offs[0] = 0) and each group's first row
tile `tile_start` (an exclusive cumsum of cdiv(sizes, BLOCK_M)), both computed by torch
ops on the device from the sizes. The grid is sized from host-known shapes only:
cdiv(N, BLOCK_M) + E row tiles (each group adds at most one partial tile) times
cdiv(O, BLOCK_N) column tiles; program t finds its group as the last e with
tile_start[e] <= t, and tiles past the last group's rows store nothing. The weight
gradient runs one program per (group, I tile, O tile), looping over that group's rows.
The input gradient is the forward program reading w through swapped strides (no copy
of w.T).

Host syncs: none inside the kernels. `sizes` may be an int tensor on x's device (what
the MoE dispatchers hand over when the counts are data: no sync on the Triton side) or a
Python list (capacity mode's static sizes, known from the shapes). A list is copied to
the device once per distinct list (a small cache keyed by the list and device: the
three gemms of an expert MLP reuse it), a blocking host-to-device copy the first time.
The reference slices by a list, so a device tensor there is read on the host by
`host_sizes` (a sync), once per tensor: the three gemms of an expert MLP share the read.

Precision: tiles are loaded in their dtype and multiplied by `tl.dot` with float32
accumulation; float32 inputs use input_precision "tf32" only when
`torch.backends.cuda.matmul.allow_tf32` is set (as torch's own matmul), else "ieee".
Under the interpreter every tile is cast to float32 first (bf16 `tl.dot` is wrong there).
Outputs come back in x's dtype (dw in w's). x and w must share a dtype, else the
reference runs. Under autocast the Triton side takes both in autocast's dtype
(`autocast_operands`: autocast does not cover a Triton program).
"""

from __future__ import annotations

import functools
import weakref

import torch

from .dispatch import interpreting, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without triton; only the Triton side needs it
    triton = None

Sizes = list[int] | torch.Tensor


_LAST_READ: list = [None, -1, []]  # (weak reference to the sizes tensor read last, its version, its values)


def host_sizes(sizes: Sizes) -> list[int]:
    """`sizes` as Python ints. A tensor is read with `.tolist()` (a host sync, the one a gemm
    that slices on the host makes), once: the same unmodified tensor again reuses the read."""
    if not isinstance(sizes, torch.Tensor):
        return list(sizes)
    ref, version, values = _LAST_READ
    if ref is None or ref() is not sizes or version != sizes._version:
        values = sizes.tolist()
        _LAST_READ[:] = [weakref.ref(sizes), sizes._version, values]
    return list(values)


def grouped_gemm_reference(x_NI: torch.Tensor, w_EIO: torch.Tensor, sizes: Sizes) -> torch.Tensor:
    """A loop of `x[a:b] @ w[e]` over contiguous slices: the MoE gemm "loop" (`loop_mm` in
    pipekit/moe/grouped.py is this function). A tensor of sizes is read on the host (`host_sizes`);
    under torch.compile that read and the loop run outside the graph (one graph break), since a
    graph traced through them would be specialised on the sizes: a recompile per routing."""
    if isinstance(sizes, torch.Tensor) and torch.compiler.is_compiling():
        return torch.compiler.disable(_loop)(x_NI, w_EIO, sizes)
    return _loop(x_NI, w_EIO, sizes)


def _loop(x_NI: torch.Tensor, w_EIO: torch.Tensor, sizes: Sizes) -> torch.Tensor:
    sizes_list = host_sizes(sizes)
    # unbind, not w[e]: each w[e]'s backward would add a full (E, I, O) zero-padded gradient
    # (E^2 I O work: 7x slower at E=64); unbind's backward stacks the E pieces once
    return torch.cat([piece @ w_I_O for piece, w_I_O in zip(torch.split(x_NI, sizes_list), w_EIO.unbind(0))])


def grouped_gemm(x_NI: torch.Tensor, w_EIO: torch.Tensor, sizes: Sizes) -> torch.Tensor:
    """y_NO, rows of group e times w[e]; Triton (on autocast's operands under autocast) or the
    reference (`loop_mm`, whose matmuls autocast casts itself) by `use_triton`."""
    if use_triton(x_NI, w_EIO) and x_NI.dim() == 2 and w_EIO.dim() == 3:
        x_NI, w_EIO = autocast_operands(x_NI, w_EIO)
        if x_NI.dtype == w_EIO.dtype:
            offs, tile_start = _schedule(sizes, x_NI.device, _blocks(x_NI)[0])
            return _GroupedGemm.apply(x_NI, w_EIO, offs, tile_start)
    return grouped_gemm_reference(x_NI, w_EIO, sizes)


AUTOCAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts (float64 it leaves)


def autocast_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in autocast's dtype when autocast is on for the first one's device, else as
    they are: autocast covers a matmul but neither `torch._grouped_mm` nor a Triton program, so
    a gemm built on those casts its operands itself, as autocast would (float64 left alone)."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.dtype in AUTOCAST_DTYPES else t for t in tensors)


def _blocks(x: torch.Tensor) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): large tiles in the interpreter (few programs), GPU-sized ones else."""
    if interpreting() or not x.is_cuda:
        return 64, 64, 64
    return (64, 128, 32) if x.element_size() == 4 else (64, 128, 64)


@functools.lru_cache(maxsize=16)
def _list_schedule(sizes: tuple[int, ...], device: torch.device, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _device_schedule(torch.tensor(sizes, dtype=torch.int64).to(device), block_m)


def _device_schedule(sizes_E: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offs (E+1,), tile_start (E,)) int32 on sizes_E's device, by torch ops (no host sync)."""
    sizes_E = sizes_E.to(torch.int64)
    zero = sizes_E.new_zeros(1)
    offs = torch.cat([zero, sizes_E.cumsum(0)]).to(torch.int32)
    tiles_E = (sizes_E + block_m - 1) // block_m
    tile_start = torch.cat([zero, tiles_E.cumsum(0)[:-1]]).to(torch.int32)
    return offs, tile_start


def _schedule(sizes: Sizes, device: torch.device, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(sizes, torch.Tensor):
        return _device_schedule(sizes.to(device), block_m)
    return _list_schedule(tuple(int(s) for s in sizes), device, block_m)


def _precision(x: torch.Tensor) -> str:
    return "tf32" if x.is_cuda and torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _rows_by_w(a_NK: torch.Tensor, w: torch.Tensor, w_strides: tuple[int, int, int], n_out: int,
               offs: torch.Tensor, tile_start: torch.Tensor) -> torch.Tensor:
    """out_NO[rows of e] = a[rows of e] @ W[e], W[e] read from `w` with strides (e, k, o)."""
    assert triton is not None
    n, k = a_NK.shape
    n_groups = offs.numel() - 1
    out = torch.empty(n, n_out, dtype=a_NK.dtype, device=a_NK.device)
    if n == 0 or n_out == 0:
        return out
    bm, bn, bk = _blocks(a_NK)
    grid = (triton.cdiv(n, bm) + n_groups, triton.cdiv(n_out, bn))
    _gmm_rows[grid](a_NK, w, out, offs, tile_start, n_groups, k, n_out,
                    a_NK.stride(0), a_NK.stride(1), *w_strides, out.stride(0), out.stride(1),
                    BLOCK_E=triton.next_power_of_2(n_groups), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                    UPCAST=interpreting(), PRECISION=_precision(a_NK))
    return out


class _GroupedGemm(torch.autograd.Function):
    """y = x @ w[group] by Triton; backward: dx by the same program on w.T, dw per group."""

    @staticmethod
    def forward(ctx, x_NI, w_EIO, offs, tile_start):
        x_NI = x_NI.contiguous()
        se, si, so = w_EIO.stride()
        y = _rows_by_w(x_NI, w_EIO, (se, si, so), w_EIO.shape[2], offs, tile_start)
        ctx.save_for_backward(x_NI, w_EIO, offs, tile_start)
        return y

    @staticmethod
    def backward(ctx, dy_NO):
        assert triton is not None
        x_NI, w_EIO, offs, tile_start = ctx.saved_tensors
        dy_NO = dy_NO.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            se, si, so = w_EIO.stride()
            dx = _rows_by_w(dy_NO, w_EIO, (se, so, si), w_EIO.shape[1], offs, tile_start)
        if ctx.needs_input_grad[1]:
            n_groups, n_in, n_out = w_EIO.shape
            dw = torch.empty(n_groups, n_in, n_out, dtype=w_EIO.dtype, device=w_EIO.device)
            if dw.numel():
                bm, bn, bk = _blocks(x_NI)
                grid = (n_groups, triton.cdiv(n_in, bm), triton.cdiv(n_out, bn))
                _gmm_weight_grad[grid](x_NI, dy_NO, dw, offs, n_in, n_out,
                                       x_NI.stride(0), x_NI.stride(1), dy_NO.stride(0), dy_NO.stride(1),
                                       *dw.stride(), BLOCK_I=bm, BLOCK_O=bn, BLOCK_R=bk,
                                       UPCAST=interpreting(), PRECISION=_precision(x_NI))
        return dx, dw, None, None


if triton is not None:

    @triton.jit
    def _gmm_rows(A, W, OUT, OFFS, TILE_START, n_groups, K, N_OUT,
                  s_an, s_ak, s_we, s_wk, s_wo, s_on, s_oo,
                  BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """One (BLOCK_M rows of one group) x (BLOCK_N outputs) tile of out = A[rows] @ W[group]."""
        t = tl.program_id(0)
        groups = tl.arange(0, BLOCK_E)
        starts = tl.load(TILE_START + groups, mask=groups < n_groups, other=2147483647)
        e = tl.sum((starts <= t).to(tl.int32), axis=0) - 1  # the last group starting at or before tile t
        first_tile = tl.load(TILE_START + e)
        row_end = tl.load(OFFS + e + 1)
        row0 = tl.load(OFFS + e) + (t - first_tile) * BLOCK_M
        if row0 < row_end:  # past the last group's rows: nothing to do
            rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
            cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
            row_ok, col_ok = rows < row_end, cols < N_OUT
            w_e = W + e.to(tl.int64) * s_we
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
                k_ok = ks < K
                a = tl.load(A + rows[:, None] * s_an + ks[None, :] * s_ak,
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_e + ks[:, None] * s_wk + cols[None, :] * s_wo,
                            mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if UPCAST:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            tl.store(OUT + rows[:, None] * s_on + cols[None, :] * s_oo, acc.to(OUT.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _gmm_weight_grad(X, DY, DW, OFFS, N_IN, N_OUT, s_xn, s_xi, s_yn, s_yo, s_we, s_wi, s_wo,
                         BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr,
                         UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """One (BLOCK_I x BLOCK_O) tile of dw[e] = X[rows of e].T @ DY[rows of e] (zero when e is empty)."""
        e = tl.program_id(0)
        ins = (tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)).to(tl.int64)
        outs = (tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)).to(tl.int64)
        in_ok, out_ok = ins < N_IN, outs < N_OUT
        row_start = tl.load(OFFS + e)
        row_end = tl.load(OFFS + e + 1)
        acc = tl.zeros((BLOCK_I, BLOCK_O), dtype=tl.float32)
        for r0 in range(row_start, row_end, BLOCK_R):
            rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
            row_ok = rows < row_end
            xt = tl.load(X + rows[None, :] * s_xn + ins[:, None] * s_xi,  # (BLOCK_I, BLOCK_R): x transposed
                         mask=in_ok[:, None] & row_ok[None, :], other=0.0)
            dy = tl.load(DY + rows[:, None] * s_yn + outs[None, :] * s_yo,
                         mask=row_ok[:, None] & out_ok[None, :], other=0.0)
            if UPCAST:
                xt, dy = xt.to(tl.float32), dy.to(tl.float32)
            acc = tl.dot(xt, dy, acc, input_precision=PRECISION)
        tl.store(DW + e.to(tl.int64) * s_we + ins[:, None] * s_wi + outs[None, :] * s_wo,
                 acc.to(DW.dtype.element_ty), mask=in_ok[:, None] & out_ok[None, :])
