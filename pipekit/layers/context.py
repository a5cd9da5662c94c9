"""Context parallelism's attention core: one signature for local, ring and Ulysses attention.

Layout. At context-parallel degree cp a row of T tokens is cut into 2*cp chunks of
C = T / (2*cp) tokens; cp rank r holds chunks r and 2*cp-1-r, in that order
(T_local = 2*C: load-balanced causal sharding, every rank does the same attention
work). `chunk_index` gives a rank's global token indices, `shard_sequence` cuts a
full-sequence tensor so and `unshard_sequence` puts every rank's part back.

The seam. `attention_core(q, k, v, mode=..., group=..., index=..., doc=...)` is the
attention of every backend, registered by name (`register_attention`): q is
(B, Hq, T_local, d), k and v (B, Hkv, T_local, d) with the kv heads not repeated
(query head h uses kv head h // (Hq // Hkv)). The mask rule is the same everywhere:
query t sees key s iff index[s] <= index[t] and doc[s] == doc[t] (`attention_mask`).
With a group (ring, ulysses) every rank's indices are `chunk_index`'s for its rank,
which is the layout the engine cuts; `index` is then that or None and is not read.

    sdpa     local: `F.scaled_dot_product_attention`, is_causal=True when index and doc
             are None (bitwise what `CausalSelfAttention` computes), else the boolean mask.
             No communication.
    ring     forward: cp steps; at each the K/V block held now is passed on (send to
             r+1, receive from r-1, posted before the block is computed, so the transfer
             hides behind it) while the local queries attend to it; partial results are
             merged online (running max and sum: the log-sum-exp merge) in float32
             (float64 for float64 inputs). Blocks from another rank are half masked by
             the layout and only their live half is computed (rank s < r: the first key
             chunk for all queries; s > r: all keys for the second query chunk); doc ids
             travel with their block. Sends per layer: cp - 1 K/V blocks ((cp-1)/cp of
             the sequence's K/V) and their doc ids.
             backward: the probabilities are recomputed from the saved log-sum-exp, dq
             stays local, and each block's dK/dV accumulator (float32, or float64)
             travels with it, arriving home after cp hops. Sends: cp - 1 K/V blocks and
             cp dK/dV blocks. A rank holds its own K/V, the block it computes on and the
             one arriving, never the whole sequence's.
    ulysses  all-to-all from sequence shards to head shards (q, k, v: each rank gets
             Hq/cp query heads and their kv heads for the whole sequence, put in global
             order), ordinary `sdpa` attention there, and an all-to-all back; the doc ids
             are all-gathered. Fewer kv heads than cp divides: each kv head is repeated
             (to the fewest heads cp divides) before the all-to-all. Sends per layer:
             (cp-1)/cp of q, k, v and the output forward, of their gradients backward.

`sent_bytes()` counts the bytes this process sent in ring and Ulysses communication
(`reset_sent_bytes()` zeroes it), for benchmarks to hold against those formulas. On
the meta device nothing communicates: the result only has its shape. Collectives go
through `pipekit.comm.lane` (a backward's on the group's twin).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass

import einops
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm import lane
from .parallel import group_rank, group_size

_SENT: collections.Counter[str] = collections.Counter()


# ---- the layout ----------------------------------------------------------------------
def chunk_index(T_local: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The (T_local,) int64 global indices of cp rank `rank`'s tokens, in local order:
    chunk `rank` then chunk 2*cp-1-rank, of T_local // 2 tokens each."""
    if T_local % 2:
        raise ValueError(f"T_local={T_local} is odd; each cp rank holds two chunks of equal length")
    C = T_local // 2
    low = torch.arange(rank * C, (rank + 1) * C, device=device)
    return torch.cat((low, low + (2 * cp - 1 - 2 * rank) * C))


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s two chunks of full-sequence `x` along `dim` (T // cp entries)."""
    T = x.shape[dim]
    if T % (2 * cp):
        raise ValueError(f"T={T} is not divisible by 2*cp={2 * cp} (cp={cp}); "
                         f"context parallelism cuts a row into 2*cp equal chunks")
    C = T // (2 * cp)
    return torch.cat((x.narrow(dim, rank * C, C), x.narrow(dim, (2 * cp - 1 - rank) * C, C)), dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's local part (`shard_sequence`'s), in rank order."""
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


def attention_mask(index_q: torch.Tensor, index_k: torch.Tensor, doc_q: torch.Tensor | None = None,
                   doc_k: torch.Tensor | None = None) -> torch.Tensor:
    """True where query t may see key s: index_k[s] <= index_q[t] and (with doc ids) the same
    document. (Tq,) and (Tk,) indices, (B, Tq) and (B, Tk) doc ids; (B or 1, 1, Tq, Tk) bool."""
    mask = (index_k.unsqueeze(0) <= index_q.unsqueeze(1)).unsqueeze(0)  # (1, Tq, Tk)
    if doc_q is not None and doc_k is not None:
        mask = mask & (doc_q.unsqueeze(2) == doc_k.unsqueeze(1))  # (B, Tq, Tk)
    return mask.unsqueeze(1)


# ---- the bytes sent --------------------------------------------------------------------
def sent_bytes(kind: str | None = None) -> int:
    """Bytes this process sent in context-parallel attention since the last reset: "ring",
    "ulysses", or both (None)."""
    return _SENT[kind] if kind is not None else sum(_SENT.values())


def reset_sent_bytes() -> None:
    """Zero the counter of `sent_bytes`."""
    _SENT.clear()


def _count(kind: str, tensors: list[torch.Tensor], fraction: float = 1.0) -> None:
    _SENT[kind] += round(sum(t.numel() * t.element_size() for t in tensors) * fraction)


# ---- the seam ------------------------------------------------------------------------
@dataclass(frozen=True)
class Backend:
    """An attention backend: `fn(q, k, v, group, index, doc, scale)`, and whether it needs the
    cp group (a distributed one) or attends locally (then it takes no group of several ranks)."""

    fn: Callable[..., torch.Tensor]
    needs_group: bool


BACKENDS: dict[str, Backend] = {}


def register_attention(name: str, *, needs_group: bool):
    """Register the decorated function as the attention backend `name` of `attention_core`."""
    def register(fn):
        BACKENDS[name] = Backend(fn, needs_group)
        return fn
    return register


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mode: str = "sdpa", group=None,
                   index: torch.Tensor | None = None, doc: torch.Tensor | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """Attention of local queries q (B, Hq, T_local, d) over keys and values k, v
    (B, Hkv, T_local, d), kv heads unrepeated, by backend `mode` (see the module docstring);
    (B, Hq, T_local, d) in q's dtype. `index`: (T_local,) int64 global token indices (None:
    arange, or with a group `chunk_index`'s); `doc`: (B, T_local) int64 document ids or None;
    `scale`: default 1/sqrt(d)."""
    backend = BACKENDS.get(mode)
    if backend is None:
        raise ValueError(f"mode={mode!r} is not an attention backend; choose one of {sorted(BACKENDS)}")
    _check_shapes(q, k, v, index, doc)
    if backend.needs_group and group is None:
        raise ValueError(f"mode={mode!r} needs the context-parallel process group; got group=None "
                         f"(without context parallelism use mode='sdpa')")
    if not backend.needs_group and group_size(group) > 1:
        raise ValueError(f"mode={mode!r} attends locally and takes no group of {group_size(group)} ranks; "
                         f"use 'ring' or 'ulysses' for context parallelism")
    if backend.needs_group and q.shape[2] % 2:
        raise ValueError(f"T_local={q.shape[2]} is odd; with context parallelism each rank holds two chunks of "
                         f"equal length (T divisible by 2*cp)")
    return backend.fn(q, k, v, group, index, doc, scale)


def _check_shapes(q, k, v, index, doc) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0::2] != k.shape[0::2]:
        raise ValueError(f"attention takes q (B, Hq, T, d) and k, v (B, Hkv, T, d); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"Hq={q.shape[1]} query heads are not divisible by Hkv={k.shape[1]} kv heads")
    if index is not None and tuple(index.shape) != (q.shape[2],):
        raise ValueError(f"index has shape {tuple(index.shape)}; expected (T_local,) = ({q.shape[2]},)")
    if doc is not None and tuple(doc.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"doc has shape {tuple(doc.shape)}; expected (B, T_local) = {(q.shape[0], q.shape[2])}")


# ---- sdpa: local attention -------------------------------------------------------------
@register_attention("sdpa", needs_group=False)
def sdpa_attention(q, k, v, group, index, doc, scale):
    """SDPA over the local sequence, the kv heads repeated (`CausalSelfAttention`'s ops)."""
    if k.shape[1] != q.shape[1]:  # query head i uses kv head i // r
        r = q.shape[1] // k.shape[1]
        k = einops.repeat(k, "b h t d -> b (h r) t d", r=r)  # (B, Hq, T, d)
        v = einops.repeat(v, "b h t d -> b (h r) t d", r=r)
    if index is None and doc is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    index = torch.arange(q.shape[2], device=q.device) if index is None else index
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(index, index, doc, doc), scale=scale)


# ---- ring ------------------------------------------------------------------------------
class _Ring:
    """This rank's place on the cp ring: it sends to the next rank and receives from the previous."""

    def __init__(self, group):
        self.group = lane(group)
        self.size, self.rank = group_size(group), group_rank(group)

    def pass_on(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Post the sends of `tensors` to the next rank and the receives of as many alike from
        the previous; the buffers being filled and the works to wait for."""
        tensors = [t.contiguous() for t in tensors]  # (gloo sends and receives contiguous tensors only)
        bufs = [torch.empty_like(t) for t in tensors]
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=nxt) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, group=self.group, group_peer=prev) for b in bufs]
        _count("ring", tensors)
        return bufs, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


@dataclass(frozen=True)
class _Block:
    """The live part of the block of rank `src`'s keys for rank `rank`'s queries: the query
    rows and key columns to compute, and the mask there (None: all visible)."""

    rows: slice
    cols: slice
    mask: torch.Tensor | None  # broadcasts over (B, Hkv, group, rows, cols)


def _block(src: int, rank: int, cp: int, T_local: int, doc_q, doc_k, device) -> _Block:
    C = T_local // 2
    if src == rank:  # the diagonal: causal within each chunk, the second chunk sees all the first
        index = chunk_index(T_local, cp, rank, device)
        rows, cols, mask = slice(None), slice(None), attention_mask(index, index)
    elif src < rank:  # its first chunk precedes both of ours, its second follows both
        rows, cols, mask = slice(None), slice(0, C), None
    else:  # both its chunks follow our first and precede our second
        rows, cols, mask = slice(C, None), slice(None), None
    if doc_q is not None:
        same = (doc_q[:, rows].unsqueeze(2) == doc_k[:, cols].unsqueeze(1)).unsqueeze(1)  # (B, 1, tq, tk)
        mask = same if mask is None else mask & same
    return _Block(rows, cols, None if mask is None else mask.unsqueeze(1))  # (B or 1, 1, 1, tq, tk)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(x: torch.Tensor, n_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, Hq, T, d) -> (B, Hkv, Hq // Hkv, T, d): query heads beside their kv head."""
    return einops.rearrange(x, "b (h g) t d -> b h g t d", h=n_kv).to(dtype)


def _scores(q_g, k, block: _Block, scale: float) -> torch.Tensor:
    """Masked scores (B, Hkv, g, tq, tk) of grouped queries against kv-head keys (B, Hkv, tk, d)."""
    s = q_g[..., block.rows, :] @ k[:, :, block.cols].unsqueeze(2).transpose(-1, -2) * scale
    return s if block.mask is None else s.masked_fill(~block.mask, -math.inf)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, doc, group, scale):
        ring, acc = _Ring(group), _acc_dtype(q.dtype)
        k, v, doc = k.contiguous(), v.contiguous(), None if doc is None else doc.contiguous()
        n_kv, T = k.shape[1], q.shape[2]
        q_g = _grouped(q, n_kv, acc)  # (B, Hkv, g, T, d)
        m = torch.full(q_g.shape[:-1], -math.inf, dtype=acc, device=q.device)  # running max
        total = torch.zeros_like(m)  # running sum of exp(score - m)
        out = torch.zeros_like(q_g)  # running sum of exp(score - m) * v
        held, docs = [k, v] + ([doc] if doc is not None else []), []
        for step in range(ring.size):
            if step < ring.size - 1:  # the next block travels while this one computes
                incoming, works = ring.pass_on(held)
            src = (ring.rank - step) % ring.size
            docs.append(held[2] if doc is not None else None)
            block = _block(src, ring.rank, ring.size, T, doc, docs[-1], q.device)
            s = _scores(q_g, held[0].to(acc), block, scale)
            m_sub, total_sub, out_sub = m[..., block.rows], total[..., block.rows], out[..., block.rows, :]
            m_new = torch.maximum(m_sub, s.amax(-1))  # finite: step 0 is the diagonal, every query sees itself
            p, alpha = torch.exp(s - m_new.unsqueeze(-1)), torch.exp(m_sub - m_new)
            total_sub.mul_(alpha).add_(p.sum(-1))
            out_sub.mul_(alpha.unsqueeze(-1)).add_(p @ held[1][:, :, block.cols].to(acc).unsqueeze(2))
            m_sub.copy_(m_new)
            if step < ring.size - 1:
                _wait(works)
                held = incoming
        out = out / total.unsqueeze(-1)
        lse = m + total.log()  # (B, Hkv, g, T)
        y = einops.rearrange(out, "b h g t d -> b (h g) t d").to(q.dtype)
        ctx.save_for_backward(q, k, v, y, lse, *(d for d in docs if d is not None))
        ctx.group, ctx.scale, ctx.has_doc = group, scale, doc is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse, *docs = ctx.saved_tensors
        ring, acc, scale = _Ring(ctx.group), _acc_dtype(q.dtype), ctx.scale
        n_kv, T = k.shape[1], q.shape[2]
        q_g, dy_g = _grouped(q, n_kv, acc), _grouped(dy, n_kv, acc)
        delta = (dy_g * _grouped(y, n_kv, acc)).sum(-1)  # (B, Hkv, g, T): rowsum(dP * P) per query
        dq = torch.zeros_like(q_g)
        held, dkv, dkv_works = [k, v], None, []
        for step in range(ring.size):
            if step < ring.size - 1:
                incoming, works = ring.pass_on(held)
            src = (ring.rank - step) % ring.size
            doc_k = docs[step] if ctx.has_doc else None
            block = _block(src, ring.rank, ring.size, T, docs[0] if ctx.has_doc else None, doc_k, q.device)
            k_b, v_b = held[0].to(acc), held[1].to(acc)
            p = torch.exp(_scores(q_g, k_b, block, scale) - lse[..., block.rows].unsqueeze(-1))
            dy_sub = dy_g[..., block.rows, :]
            ds = p * (dy_sub @ v_b[:, :, block.cols].unsqueeze(2).transpose(-1, -2)
                      - delta[..., block.rows].unsqueeze(-1))
            dq[..., block.rows, :] += ds @ k_b[:, :, block.cols].unsqueeze(2) * scale
            grads = torch.zeros((2, *k.shape), dtype=acc, device=k.device)  # this block's dK, dV
            grads[0][:, :, block.cols] = (ds.transpose(-1, -2) @ q_g[..., block.rows, :]).sum(2) * scale
            grads[1][:, :, block.cols] = (p.transpose(-1, -2) @ dy_sub).sum(2)
            if step:  # the block's accumulator, from the ranks it visited before
                _wait(dkv_works)
                grads += dkv
            if ring.size > 1:  # on to the next rank; after cp hops it is home
                (dkv,), dkv_works = ring.pass_on([grads])
            else:
                dkv = grads
            if step < ring.size - 1:
                _wait(works)
                held = incoming
        _wait(dkv_works)
        dq = einops.rearrange(dq, "b h g t d -> b (h g) t d").to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


@register_attention("ring", needs_group=True)
def ring_attention(q, k, v, group, index, doc, scale):
    """Ring attention over the cp group (see the module docstring)."""
    if q.is_meta:
        return torch.empty_like(q)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, doc, group, scale)


# ---- ulysses ---------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):  # out[s] on rank r was x[r] on rank s: the same exchange sends it back
        return _all_to_all(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=lane(group))
    _count("ulysses", [x], (group_size(group) - 1) / group_size(group))
    return out


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-to-all over dim 0 (of size cp): x[s] goes to rank s, and out[s] is
    what rank s sent here. Its backward is the same exchange of the gradient."""
    return _AllToAll.apply(x, group)


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H, T_local, d), the local tokens of all heads -> (B, H/cp, T, d), this rank's
    heads for the whole sequence in global order."""
    cp = group_size(group)
    parts = all_to_all(einops.rearrange(x, "b (c h) t d -> c b h t d", c=cp), group)  # parts[s]: rank s's tokens
    return unshard_sequence(list(parts.unbind(0)), dim=2)


def heads_to_sequence(y: torch.Tensor, group) -> torch.Tensor:
    """`sequence_to_heads`'s inverse: (B, H/cp, T, d) -> (B, H, T_local, d)."""
    cp = group_size(group)
    parts = torch.stack([shard_sequence(y, cp, s, dim=2) for s in range(cp)])  # (cp, B, H/cp, T_local, d)
    return einops.rearrange(all_to_all(parts, group), "c b h t d -> b (c h) t d")


def _gather_docs(doc: torch.Tensor, group) -> torch.Tensor:
    """Every rank's doc ids, (B, T_local) -> (B, T) in global order."""
    doc = doc.contiguous()
    parts = [torch.empty_like(doc) for _ in range(group_size(group))]
    dist.all_gather(parts, doc, group=lane(group))
    _count("ulysses", [doc], group_size(group) - 1)
    return unshard_sequence(parts, dim=1)


@register_attention("ulysses", needs_group=True)
def ulysses_attention(q, k, v, group, index, doc, scale):
    """DeepSpeed-Ulysses attention over the cp group (see the module docstring)."""
    cp, n_heads, n_kv = group_size(group), q.shape[1], k.shape[1]
    if n_heads % cp:
        raise ValueError(f"Hq={n_heads} query heads are not divisible by the Ulysses degree cp={cp}; "
                         f"Ulysses splits heads over cp ranks (use mode='ring', or cp dividing {n_heads})")
    if q.is_meta:
        return torch.empty_like(q)
    if n_kv % cp:  # repeat each kv head r times: the fewest heads cp divides (r divides Hq / Hkv)
        r = cp // math.gcd(n_kv, cp)
        k = einops.repeat(k, "b h t d -> b (h r) t d", r=r)
        v = einops.repeat(v, "b h t d -> b (h r) t d", r=r)
    q, k, v = (sequence_to_heads(t, group) for t in (q, k, v))  # (B, H/cp, T, d)
    doc = None if doc is None else _gather_docs(doc, group)
    return heads_to_sequence(sdpa_attention(q, k, v, None, None, doc, scale), group)
