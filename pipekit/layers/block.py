"""Pre-norm transformer block in the GPT-2 and Llama styles."""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention import CausalSelfAttention
from .mlp import GeluMLP, SwiGLUMLP
from .norm import LayerNorm, RMSNorm
from .parallel import current_tp_group

STYLES = ("gpt2", "llama")


def llama_hidden(dim: int, multiple_of: int = 256) -> int:
    """Meta's Llama FFN width: 2/3 of 4*dim, rounded up to a multiple of `multiple_of`."""
    return multiple_of * math.ceil(int(8 * dim / 3) / multiple_of)


class TransformerBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)); (B, T, dim) -> (B, T, dim), full on every tp rank.

    style "gpt2": LayerNorm (eps default 1e-5) with bias, GeluMLP (hidden default
    4*dim), biases everywhere, no rotary embedding. style "llama": RMSNorm (eps
    default 1e-6), SwiGLUMLP (hidden default `llama_hidden(dim)`), no biases,
    rotary embedding with `rope_theta`. With `n_layers_for_init`, the output
    projections (`attn.o`, `mlp.proj` / `mlp.down`) start at std
    0.02/sqrt(2*n_layers) (GPT-2's scaled init), in either style.
    `mlp`, when given, builds the feed-forward part instead of the style's dense
    MLP: `mlp(dim, hidden, group=..., init_std=..., out_init_std=...)` -> a module
    (B, T, dim) -> (B, T, dim), e.g. an MoE layer; the block is otherwise the same.
    Communication: two all-reduces forward (attn.o, mlp's output layer) and
    the backward all-reduces of attention and the MLP inputs.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, hidden: int | None = None,
                 style: str = "gpt2", norm_eps: float | None = None, rope_theta: float = 10000.0,
                 n_layers_for_init: int | None = None, group=None, mlp=None):
        super().__init__()
        if style not in STYLES:
            raise ValueError(f"style={style!r} is not one of {STYLES}")
        group = current_tp_group() if group is None else group
        gpt2 = style == "gpt2"
        std = 0.02
        out_std = std / math.sqrt(2 * n_layers_for_init) if n_layers_for_init else std
        eps = norm_eps if norm_eps is not None else (1e-5 if gpt2 else 1e-6)
        if hidden is None:
            hidden = 4 * dim if gpt2 else llama_hidden(dim)
        self.norm1 = LayerNorm(dim, eps) if gpt2 else RMSNorm(dim, eps)
        self.attn = CausalSelfAttention(dim, n_heads, n_kv_heads, bias=gpt2,
                                        rope_theta=None if gpt2 else rope_theta,
                                        init_std=std, out_init_std=out_std, group=group)
        self.norm2 = LayerNorm(dim, eps) if gpt2 else RMSNorm(dim, eps)
        if mlp is None:
            mlp_cls = GeluMLP if gpt2 else SwiGLUMLP
            self.mlp = mlp_cls(dim, hidden, bias=gpt2, group=group, init_std=std, out_init_std=out_std)
        else:
            self.mlp = mlp(dim, hidden, group=group, init_std=std, out_init_std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))
