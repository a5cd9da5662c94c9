"""Linear + cross-entropy that never holds the whole batch's logits (Liger-Kernel's fused
linear cross-entropy, with pipekit's vocab-parallel split).

    loss = sum_i weight_i * CE(h_i @ w.T, label_i)        reduction="sum"
         = that / (number of labels != ignore_index)      reduction="mean" (0 when there is none)

`linear_cross_entropy(h_ND, w_VD, labels_N)` walks the N tokens in chunks of
`chunk_tokens`. Per chunk (C tokens) it computes the logits (C, V) with
`torch.matmul` (cuBLAS on a GPU) in h's dtype, taken to float32 (float64 stays
float64) for everything after: the
log-sum-exp, the per-token loss and dlogits = (softmax - onehot) * weight / count,
overwriting the logits, and turns dlogits into this chunk's rows of dh (N, D) and
adds its share of dw (V, D) with two more matmuls. So the gradients are made in
the forward pass and kept (dh in h's dtype; dw accumulated in w's dtype when h and w
are bf16/fp16, by a matmul in that dtype with float32 accumulation per chunk, as Liger
does, else in float32 or float64);
backward only multiplies them by the incoming gradient (in place: one backward
per forward, `retain_graph` double backward raises). Each reaches its tensor
through its own small autograd node (`_Gradient`, 0 in value, added to the loss),
so a backward split into input and weight passes (zero-bubble schedules,
`pipekit.split_backward`) hands dh back in the first and dw in the second, with
nothing computed twice. When neither h nor w needs a gradient the chunk stops at
the loss. The loss is float32 (float64 for float64 h) whatever h's dtype: a
bf16 loss would round the microbatch weights that scale it and its gradients.
Peak memory beyond the inputs: dh (N, D), dw (V, D) and one chunk's logits (C, V);
the eager loss holds (N, V) logits, their softmax and their gradient. The default chunk (Liger's rule) makes the chunk's
logits about as large as h: C = next power of 2 of N / ceil(V / D), at least 64
tokens (`default_chunk_tokens`). The torch side holds about two chunk-sized
buffers at once (the logits and one temporary), the Triton side one.

Vocab-parallel (`tp_group`): each rank holds rows [vocab_start, vocab_start + V_local)
of the padded vocabulary; `h` and `labels` are the same on every rank. Per chunk,
like `pipekit.layers.cross_entropy.vocab_parallel_cross_entropy`:

    m_r, s_r = local row max, sum of exp(logit - m_r)     (one pass over the chunk)
    m        = max over tp of m_r                          all-reduce (max)  of (C,)
    s, z     = sum over tp of s_r * exp(m_r - m),          all-reduce (sum)  of (2, C)
               and of the target logit - m (only the rank holding the target adds it)
    loss_i   = log(s) - z

(the layer computes the sum of exponentials after the max exchange, in a second
pass; here each rank rescales its own sum instead: the same two collectives, one
pass fewer). After the last chunk dh, a partial sum over this rank's vocabulary
slice, is all-reduced over tp (one (N, D) all-reduce, in forward): the returned
gradient of h is the whole one, so `h` must NOT also pass through `copy_to_tp`.
dw stays local (this rank's rows). The loss is the same on every rank.
Padded rows (global id >= `vocab_size`) get logit -inf: no probability and zero
gradient, as `pipekit.models.common.mask_padded_vocab` does.

Sides (`pipekit.kernels.dispatch.use_triton`): the per-chunk softmax step, the
row statistics (m_r, s_r, target logit) and dlogits = (exp(logit - lse) - onehot)
* scale written over the logits, are two Triton programs over blocks of rows,
each looping over the vocabulary in tiles (online max / sum); the matmuls and the
collectives are torch on both sides. The reference does the same chunk loop with
torch ops, so CPU users get the memory saving too. `linear_cross_entropy_eager`
(logits materialised, plain autograd) is the test oracle and the benchmark's
baseline.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .dispatch import interpreting, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pipekit imports without triton; only the Triton side needs it
    triton = None

REDUCTIONS = ("sum", "mean")
_FAR_BELOW = -3.0e38  # the online max starts here, not at -inf: a row whose logits are all -inf
#                       (a shard of padding only) then gets sum 0 instead of exp(-inf + inf) = NaN


def linear_cross_entropy(h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor, *,
                         ignore_index: int = -100, weights_N: torch.Tensor | None = None,
                         reduction: str = "mean", chunk_tokens: int | None = None,
                         vocab_size: int | None = None, vocab_start: int = 0, tp_group=None) -> torch.Tensor:
    """Cross-entropy of the logits h @ w.T against `labels`, without the (N, V) logits.

    h_ND: (..., D) hidden states; w_VD: (V_local, D) this rank's rows of the head
    (global ids vocab_start .. vocab_start + V_local; the whole head without tp);
    labels_N: (...) global ids, `ignore_index` for tokens that count for nothing;
    weights_N: (...) optional per-token loss weights (a weight multiplies that
    token's loss and its gradients); reduction: "sum" of the weighted losses, or
    "mean": that sum over the number of non-ignored tokens (weights do not enter
    the count; no such token: loss 0 and zero gradients, as in
    `vocab_parallel_cross_entropy`); chunk_tokens: tokens per chunk (None: the
    module docstring's rule); vocab_size: the true vocabulary (global ids >= it
    are padding, masked; None: no padding); tp_group: the group the vocabulary
    is split over (None: one rank). Returns a scalar loss in float32 (float64 for float64 h).
    Communication with tp: per chunk an all-reduce (max) of (C,) and one (sum) of
    (2, C); after the loop one all-reduce of dh (N, D); none in backward.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {list(REDUCTIONS)}")
    if h_ND.shape[:-1] != labels_N.shape or w_VD.dim() != 2 or w_VD.shape[1] != h_ND.shape[-1]:
        raise ValueError(f"h {tuple(h_ND.shape)}, w {tuple(w_VD.shape)} and labels {tuple(labels_N.shape)} "
                         "disagree: expected h (..., D), w (V, D) and labels (...)")
    if weights_N is not None and weights_N.shape != labels_N.shape:
        raise ValueError(f"weights {tuple(weights_N.shape)} and labels {tuple(labels_N.shape)} disagree")
    n, v_local = labels_N.numel(), w_VD.shape[0]
    chunk = chunk_tokens or default_chunk_tokens(n, v_local, w_VD.shape[1])
    if chunk < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    n_real = v_local if vocab_size is None else min(max(vocab_size - vocab_start, 0), v_local)
    want_dh = h_ND.requires_grad and torch.is_grad_enabled()
    want_dw = w_VD.requires_grad and torch.is_grad_enabled()
    with torch.no_grad():  # the gradients are made here, in forward
        loss, dh, dw = _chunked(h_ND, w_VD, labels_N, weights_N, ignore_index, reduction, chunk, n_real,
                                vocab_start, tp_group, use_triton(h_ND, w_VD), want_dh, want_dw)
    if dh is not None:
        loss = loss + _Gradient.apply(h_ND, dh)
    if dw is not None:
        loss = loss + _Gradient.apply(w_VD, dw)
    return loss


def linear_cross_entropy_reference(h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor,
                                   **kwargs) -> torch.Tensor:
    """`linear_cross_entropy` on its PyTorch side whatever the kernels mode (same chunking)."""
    from .dispatch import kernels

    with kernels("torch"):
        return linear_cross_entropy(h_ND, w_VD, labels_N, **kwargs)


def linear_cross_entropy_eager(h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor, *,
                               ignore_index: int = -100, weights_N: torch.Tensor | None = None,
                               reduction: str = "mean", vocab_size: int | None = None) -> torch.Tensor:
    """The same loss the plain way, one rank: all (N, V) logits at once, autograd for the
    gradients. The oracle of the tests and the baseline of benchmarks/kernels.py."""
    logits = (h_ND @ w_VD.T).to(torch.promote_types(h_ND.dtype, torch.float32))
    logits = logits.reshape(-1, w_VD.shape[0])
    if vocab_size is not None and vocab_size < w_VD.shape[0]:
        ids = torch.arange(w_VD.shape[0], device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
    labels = labels_N.reshape(-1)
    per_token = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none")
    if weights_N is not None:
        per_token = per_token * weights_N.reshape(-1).to(per_token.dtype)
    loss = per_token.sum()
    if reduction == "mean":
        loss = loss / (labels != ignore_index).sum().clamp(min=1)
    return loss


MIN_CHUNK_TOKENS = 64  # each chunk reads and writes all of dw (V, D): fewer tokens make that the bottleneck


def default_chunk_tokens(n_tokens: int, v_local: int, dim: int) -> int:
    """Liger-Kernel's chunk, the next power of 2 of N / ceil(V / D), so that one chunk's
    logits (C, V) are about as large as h (N, D); but at least MIN_CHUNK_TOKENS (at most N):
    with a small D the rule alone gives chunks of a few tokens, each paying a full pass
    over dw. (8192 tokens, D=4096, V=128k: 256 tokens, the rule's.)"""
    per = math.ceil(n_tokens / max(1, math.ceil(v_local / max(dim, 1))))
    return max(1, min(n_tokens, max(MIN_CHUNK_TOKENS, 1 << max(0, per - 1).bit_length())))


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and group.size() > 1:
        dist.all_reduce(x, op=op, group=group)  # x is always a fresh tensor of ours
    return x


LOW_PRECISION = (torch.bfloat16, torch.float16)


def _chunked(h, w, labels, weights, ignore_index, reduction, chunk, n_real, vocab_start, group, triton_side,
             want_dh, want_dw):
    """(loss, dh, dw) of the module docstring's chunk loop, without autograd; dh (or dw) None
    when not wanted. The loss is in float32 (float64 for float64 h), dh in h's dtype; dw in
    w's dtype when h and w are both bf16 (or fp16): each chunk's share by a bf16 matmul
    accumulating in float32 and added into dw in one addmm (Liger's way: the tensor cores' speed,
    no float32 (V, D) buffer and no copy of it), else in float32 or float64."""
    d, v_local = h.shape[-1], w.shape[0]
    h2 = h.reshape(-1, d)  # (N, D)
    acc = torch.promote_types(h.dtype, torch.float32)  # logits, softmax, dw: float32 or float64
    t = labels.reshape(-1)  # (N,)
    valid = t != ignore_index
    local_t = t - vocab_start
    here = valid & (local_t >= 0) & (local_t < v_local)  # the target's row is on this rank
    local_t = local_t.masked_fill(~here, -1)  # -1: matches no column
    scale = valid.to(acc) if weights is None else weights.reshape(-1).to(acc) * valid
    if reduction == "mean":
        scale = scale / valid.sum().clamp(min=1)
    low = h.dtype in LOW_PRECISION and w.dtype == h.dtype  # dw by h's own matmul, into w's dtype
    dh = torch.empty_like(h2) if want_dh else None
    dw = torch.zeros(w.shape, dtype=w.dtype if low else acc, device=w.device) if want_dw else None
    loss = torch.zeros((), dtype=acc, device=h.device)
    step = _TritonStep if triton_side else _TorchStep
    for lo in range(0, h2.shape[0], chunk):
        hi = min(lo + chunk, h2.shape[0])
        x = (h2[lo:hi] @ w.T).to(acc)  # (C, V_local) logits; the one chunk-sized buffer
        if n_real < v_local:
            x[:, n_real:] = float("-inf")  # padded ids
        tc = local_t[lo:hi]
        m_r, s_r, x_t = step.stats(x, tc)  # (C,) each
        m = _all_reduce(m_r.clone(), group, dist.ReduceOp.MAX)
        z = torch.where(here[lo:hi], x_t - m, 0.0)
        s, z = _all_reduce(torch.stack([s_r * (m_r - m).exp(), z]), group)  # (2, C)
        loss += ((s.log() - z) * scale[lo:hi]).sum()
        if not (want_dh or want_dw):
            continue
        step.grad_(x, tc, m + s.log(), scale[lo:hi])  # x is now dlogits (C, V_local)
        g = x.to(h.dtype)  # bf16/fp16 dlogits for the two matmuls (no copy in fp32/fp64)
        if want_dh:
            torch.matmul(g, w, out=dh[lo:hi])
        if want_dw and low:
            dw.addmm_(g.T, h2[lo:hi])
        elif want_dw:
            dw.addmm_(x.T, h2[lo:hi].to(acc))
    if dh is not None:
        dh = _all_reduce(dh, group).view(h.shape)  # the partial sums over the vocabulary slices
    return loss, dh, dw


class _Gradient(torch.autograd.Function):
    """0 in value, `grad` as x's gradient: carries a gradient made in forward to its tensor.
    One per differentiated input, so each is its own node of the graph: a backward split in
    two passes (`pipekit.split_backward`, input grads first, weight grads later) runs the one
    for h in the first and the one for w in the second, each once."""

    @staticmethod
    def forward(ctx, x, grad):
        ctx.grad = grad
        ctx.dtype = x.dtype
        return torch.zeros((), dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)

    @staticmethod
    def backward(ctx, g):
        if ctx.grad is None:
            raise RuntimeError("linear_cross_entropy keeps its gradients for one backward pass: it scales them "
                               "in place, so a second backward (retain_graph=True) cannot run")
        grad, ctx.grad = ctx.grad, None
        return grad.mul_(g.to(grad.dtype)).to(ctx.dtype), None


class _TorchStep:
    """The per-chunk softmax step in torch ops (the reference side)."""

    @staticmethod
    def stats(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row max (from _FAR_BELOW), sum of exp(x - max), and the logit at column t (0 when t < 0)."""
        m = x.max(dim=-1).values.clamp(min=_FAR_BELOW)
        s = x.sub(m.unsqueeze(-1)).exp_().sum(dim=-1)  # one chunk-sized temporary
        x_t = x.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(t < 0, 0.0)
        return m, s, x_t

    @staticmethod
    def grad_(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor) -> None:
        """x <- (exp(x - lse) - onehot(t)) * scale, in place (rows with t < 0: no onehot)."""
        x.sub_(lse.unsqueeze(-1)).exp_()
        x.scatter_add_(1, t.clamp(min=0).unsqueeze(-1), -(t >= 0).to(x.dtype).unsqueeze(-1))  # no host sync
        x.mul_(scale.unsqueeze(-1))


def _blocks(rows: int, cols: int) -> tuple[int, int]:
    """(rows per program, vocabulary tile). A GPU runs one row per program over 4096-wide tiles;
    the interpreter, where each program instance costs milliseconds, few large blocks."""
    if interpreting():
        return min(triton.next_power_of_2(rows), 64), min(triton.next_power_of_2(cols), 16384)
    return 1, min(triton.next_power_of_2(cols), 4096)


class _TritonStep:
    """The per-chunk softmax step as two Triton programs over blocks of rows."""

    @staticmethod
    def stats(x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, cols = x.shape
        m, s, x_t = (torch.empty(rows, dtype=torch.float32, device=x.device) for _ in range(3))
        block_r, block_v = _blocks(rows, cols)
        _lce_stats_kernel[(triton.cdiv(rows, block_r),)](x, x.stride(0), t, m, s, x_t, rows, cols,
                                                         BLOCK_R=block_r, BLOCK_V=block_v)
        return m, s, x_t

    @staticmethod
    def grad_(x: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor) -> None:
        rows, cols = x.shape
        block_r, block_v = _blocks(rows, cols)
        _lce_grad_kernel[(triton.cdiv(rows, block_r),)](x, x.stride(0), t, lse.contiguous(), scale.contiguous(),
                                                        rows, cols, BLOCK_R=block_r, BLOCK_V=block_v)


if triton is not None:

    @triton.jit
    def _lce_stats_kernel(x_ptr, stride, t_ptr, m_ptr, s_ptr, xt_ptr, n_rows, n_cols,
                          BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
        """Per row of the (n_rows, n_cols) float32 logits: the max m (online, from _FAR_BELOW),
        s = sum of exp(x - m), and the logit at column t (0 when t = -1)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_rows = rows < n_rows
        t = tl.load(t_ptr + rows, mask=in_rows, other=-1)
        m = tl.full([BLOCK_R], -3.0e38, tl.float32)  # _FAR_BELOW
        s = tl.zeros([BLOCK_R], tl.float32)
        x_t = tl.zeros([BLOCK_R], tl.float32)
        base = x_ptr + rows.to(tl.int64)[:, None] * stride
        for v0 in range(0, n_cols, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            inside = in_rows[:, None] & (cols < n_cols)[None, :]
            x = tl.load(base + cols[None, :], mask=inside, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
            m = m_new
            x_t += tl.sum(tl.where(cols[None, :] == t[:, None], x, 0.0), axis=1)
        tl.store(m_ptr + rows, m, mask=in_rows)
        tl.store(s_ptr + rows, s, mask=in_rows)
        tl.store(xt_ptr + rows, x_t, mask=in_rows)

    @triton.jit
    def _lce_grad_kernel(x_ptr, stride, t_ptr, lse_ptr, scale_ptr, n_rows, n_cols,
                         BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
        """In place over the float32 logits: x <- (exp(x - lse) - onehot(t)) * scale, per row."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        in_rows = rows < n_rows
        t = tl.load(t_ptr + rows, mask=in_rows, other=-1)
        lse = tl.load(lse_ptr + rows, mask=in_rows, other=0.0)
        scale = tl.load(scale_ptr + rows, mask=in_rows, other=0.0)
        base = x_ptr + rows.to(tl.int64)[:, None] * stride
        for v0 in range(0, n_cols, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            inside = in_rows[:, None] & (cols < n_cols)[None, :]
            x = tl.load(base + cols[None, :], mask=inside, other=float("-inf")).to(tl.float32)
            g = tl.exp(x - lse[:, None])
            g = tl.where(cols[None, :] == t[:, None], g - 1.0, g) * scale[:, None]
            tl.store(base + cols[None, :], g, mask=inside)
