"""Causal self-attention with grouped-query heads split over the tp group."""

from __future__ import annotations

import einops
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .context import attention_core, chunk_index
from .kv_cache import active_kv_cache
from .linear import ColumnParallelLinear, RowParallelLinear, column_parallel_linears
from .norm import RMSNorm
from .parallel import current_context_parallel, current_tp_group, group_size, mark_tp_partial
from .rotary import RopeScaling, apply_rotary, rope_scaling_of, rotary_cos_sin, rotary_cos_sin_at


def check_heads(dim: int, n_heads: int, n_kv_heads: int, tp: int, head_dim: int | None = None) -> None:
    """Raise a ValueError naming the values unless the head layout is valid at tp size `tp`
    (`head_dim` given: the heads need not divide dim)."""
    if head_dim is None and dim % n_heads:
        raise ValueError(f"dim={dim} is not divisible by n_heads={n_heads}")
    if head_dim is not None and head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if value % tp:
            raise ValueError(
                f"{name}={value} is not divisible by the tensor-parallel size {tp}; "
                f"attention heads are split over tp ranks, so tp must divide {name}"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head / grouped-query causal self-attention, (B, T, dim) -> (B, T, dim).

    `q`, `k`, `v` are column-parallel (rank r holds query heads
    [r*H/tp, (r+1)*H/tp) and kv heads [r*KV/tp, (r+1)*KV/tp), so each query head
    finds its kv head on the same rank), `o` is row-parallel. Input and output
    are full on every rank. Communication: one all-reduce forward (in `o`);
    one backward (the input's `copy_to_tp`, shared by q, k and v).
    Rotary embedding (Llama) when `rope_theta` is not None, its frequencies scaled by
    `rope_scaling` (a `RopeScaling` or its Hugging Face dict: Llama 3.1's "llama3", "linear");
    none for GPT-2. `out_init_std` (default `init_std`) initialises `o`.
    `head_dim` (default dim / n_heads) may differ from dim / n_heads (Qwen3, Gemma): q and k, v
    are n_heads * head_dim and n_kv_heads * head_dim wide, o maps n_heads * head_dim back to dim.
    `qkv_bias` (default `bias`): biases on q, k and v alone (Qwen2), `bias` then being o's.
    `qk_norm_eps`, when given: an RMSNorm over each head's head_dim on q and on k before the
    rotary embedding (Qwen3's q_norm and k_norm), one weight shared by all heads; with tp > 1
    each rank's heads give their part of its gradient (marked `tp_partial`: summed over tp).
    `sliding_window` W, when given: a query at position p sees the keys at p - W + 1 .. p only
    (Mistral's, as transformers masks it), with packed documents within its document, and
    behind a KV cache the cached keys of those positions; up to W tokens the plain causal
    path runs unchanged (the window masks nothing there). Not under context parallelism.

    Packed documents: `forward(x, positions=...)` with each token's position in its
    document (B, T) int64 (a document starts where the position is not the one before
    plus 1; see `document_mask`): the rotary embedding is taken at those positions and
    attention is causal within each document only (a block-diagonal boolean mask). The
    positions are whole on every tp rank (with sequence parallelism too: attention
    sees all T). Without them, plain causal attention (`is_causal=True`), as always.

    Incremental decoding (`pipekit.layers.kv_cache`): inside `with kv_cache(max_len):`
    the input is the new tokens only, with their absolute positions (which must continue
    at the cached length); their keys and values (rotated, before the kv heads are
    repeated) are appended to this module's slot and the queries attend over every
    cached key, the query at position p to keys 0..p (`KVCache.append`'s mask, not
    `document_mask`, which would take the offset for a new document). Outside such a
    block the cache is never consulted.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, bias: bool = True,
                 rope_theta: float | None = None, init_std: float = 0.02,
                 out_init_std: float | None = None, group=None, *, head_dim: int | None = None,
                 qkv_bias: bool | None = None, qk_norm_eps: float | None = None,
                 rope_scaling: RopeScaling | dict | None = None, sliding_window: int | None = None):
        super().__init__()
        group = current_tp_group() if group is None else group
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        tp = group_size(group)
        check_heads(dim, n_heads, n_kv_heads, tp, head_dim)
        self.head_dim = dim // n_heads if head_dim is None else head_dim
        self.local_heads, self.local_kv_heads = n_heads // tp, n_kv_heads // tp
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling_of(rope_scaling)
        if self.rope_scaling is not None and rope_theta is None:
            raise ValueError("rope_scaling scales the rotary embedding, which needs a rope_theta")
        qkv_bias = bias if qkv_bias is None else qkv_bias
        out_std = init_std if out_init_std is None else out_init_std
        hd = self.head_dim
        self.q = ColumnParallelLinear(dim, n_heads * hd, bias=qkv_bias, init_std=init_std, group=group)
        self.k = ColumnParallelLinear(dim, n_kv_heads * hd, bias=qkv_bias, init_std=init_std, group=group)
        self.v = ColumnParallelLinear(dim, n_kv_heads * hd, bias=qkv_bias, init_std=init_std, group=group)
        self.o = RowParallelLinear(n_heads * hd, dim, bias=bias, init_std=out_std, group=group)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_eps is not None:
            self.q_norm, self.k_norm = RMSNorm(hd, eps=qk_norm_eps), RMSNorm(hd, eps=qk_norm_eps)
            if tp > 1:  # each rank normalises its own heads: its part of the shared weight's gradient
                mark_tp_partial(self.q_norm.weight, self.k_norm.weight)
        self.context = current_context_parallel()  # (cp group, mode) when built under context parallelism
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                           or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int (or None: full causal), got {sliding_window!r}")
        if sliding_window is not None and self.context is not None:
            raise ValueError(f"sliding_window={sliding_window} attention is not implemented under context "
                             f"parallelism (cp > 1); train at cp=1, or without the window")
        self.sliding_window = sliding_window

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # one backward all-reduce for q, k and v together; sequence-parallel: the all-gather of the
        # sequence slices (B, T/tp, dim) -> (B, T, dim), so attention and the rotary positions see all T
        # (only the slice is saved for backward, gathered again there)
        q, k, v = column_parallel_linears(x, self.q, self.k, self.v)
        q = einops.rearrange(q, "b t (h d) -> b h t d", d=self.head_dim)  # (B, H/tp, T, hd)
        k = einops.rearrange(k, "b t (h d) -> b h t d", d=self.head_dim)  # (B, KV/tp, T, hd)
        v = einops.rearrange(v, "b t (h d) -> b h t d", d=self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # per head, before the rotation (Qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.context is not None:
            y = self._across_context(q, k, v, positions, *self.context)
            return self.o(einops.rearrange(y, "b h t d -> b t (h d)"))
        if self.rope_theta is not None and positions is None:
            cos, sin = rotary_cos_sin(q.shape[2], self.head_dim, self.rope_theta, q.device, q.dtype,
                                      self.rope_scaling)
            q, k = apply_rotary(q, k, cos, sin)
        elif positions is not None and self.rope_theta is not None:  # packed: at positions in documents
            cos, sin = rotary_cos_sin_at(positions, self.head_dim, self.rope_theta, q.dtype,
                                         self.rope_scaling)  # (B, T, hd)
            q, k = apply_rotary(q, k, cos.unsqueeze(1), sin.unsqueeze(1))  # tables (B, 1, T, hd)
        cache, mask = active_kv_cache(), None
        if cache is not None:  # incremental decoding: attend over the cached keys too
            if positions is None:
                raise ValueError("attention with a KV cache needs the new tokens' positions: feed (ids, positions)")
            k, v, mask = cache.append(self, k, v, positions)  # (B, KV/tp, S, hd); mask (B, 1, T, S)
            if self.sliding_window is not None:  # key index s is position s
                keys = torch.arange(k.shape[2], device=positions.device)
                mask = mask & ((positions.unsqueeze(-1) - keys) < self.sliding_window).unsqueeze(1)
        elif positions is not None:
            mask = document_mask(positions)
            if self.sliding_window is not None:  # within a document positions count tokens
                mask = mask & ((positions.unsqueeze(2) - positions.unsqueeze(1)) < self.sliding_window).unsqueeze(1)
        elif self.sliding_window is not None and q.shape[2] > self.sliding_window:
            mask = window_mask(q.shape[2], self.sliding_window, q.device)
        if self.local_kv_heads != self.local_heads:  # query head i uses kv head i // r
            r = self.local_heads // self.local_kv_heads
            k = einops.repeat(k, "b h t d -> b (h r) t d", r=r)  # (B, H/tp, T or S, hd)
            v = einops.repeat(v, "b h t d -> b (h r) t d", r=r)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H/tp, T, hd)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(einops.rearrange(y, "b h t d -> b t (h d)"))  # (B, T, H/tp * hd)


    def _across_context(self, q, k, v, positions, group, mode: str) -> torch.Tensor:
        """Attention over the whole sequence when this rank holds two chunks of it (context
        parallelism, `pipekit.layers.context`): rotary at the tokens' real positions (their
        global indices, or with packed documents their `positions`), the causal mask by global
        index, within documents (a token's document is told by where it starts: its global
        index less its position)."""
        if active_kv_cache() is not None:
            raise ValueError("a KV cache (incremental decoding) runs in one process, not under context parallelism")
        T = q.shape[2]
        index = chunk_index(T, group_size(group), dist.get_rank(group), device=q.device)  # (T,) global indices
        if self.rope_theta is not None:
            at = positions if positions is not None else index.expand(q.shape[0], T)
            cos, sin = rotary_cos_sin_at(at, self.head_dim, self.rope_theta, q.dtype, self.rope_scaling)
            q, k = apply_rotary(q, k, cos.unsqueeze(1), sin.unsqueeze(1))
        doc = None if positions is None else index - positions  # (B, T): where each token's document starts
        q, k, v = (t.contiguous() for t in (q, k, v))  # they travel between ranks (the ring, all-to-all)
        return attention_core(q, k, v, mode=mode, group=group, index=index, doc=doc)


def window_mask(T: int, window: int, device=None) -> torch.Tensor:
    """(T, T) bool: query t sees key s when t - window < s <= t (causal, the last `window` tokens)."""
    t = torch.arange(T, device=device)
    gap = t.unsqueeze(1) - t.unsqueeze(0)  # t - s
    return (gap >= 0) & (gap < window)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed documents: (B, 1, T, T) bool, True where query t may
    attend to key s: s <= t and both in the same document. Positions (B, T) int64; a
    document starts at t = 0 and wherever positions[t] != positions[t-1] + 1."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    doc = starts.cumsum(dim=1)  # (B, T): the document index of each token
    T = positions.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    return ((doc.unsqueeze(2) == doc.unsqueeze(1)) & causal).unsqueeze(1)
