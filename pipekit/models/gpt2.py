"""GPT-2 as a spec list: tied vocab-parallel embedding, pre-norm blocks, LayerNorm, tied head.

    [0]        TiedLayerSpec("embed", GPT2Embedding)   ids (B, T) int64 -> hidden (B, T, D)
    [1..L]     LayerSpec(TransformerBlock, **gpt2_block_parts)     (B, T, D) -> (B, T, D)
    [L+1]      LayerSpec(FinalLayerNorm)                             (B, T, D) -> (B, T, D)
    [L+2]      TiedLayerSpec("embed", ..., forward_fn=tied_logits)   (B, T, D) -> (B, T, Vp/tp)

The head's logits stay split over the vocabulary (rank r holds ids
[r*Vp/tp, (r+1)*Vp/tp)) and go straight into `VocabParallelCrossEntropy`, so
the full (B, T, Vp) logits never exist on one rank; with `fused_loss` the head
passes the hidden states through in training and `FusedLinearCrossEntropy`
multiplies by `wte` chunk by chunk, so no logits exist at all. With
`tie_embeddings=False` the embedding is a plain `LayerSpec` and the head a
bias-free `VocabParallelHead` (names `layers.0.*`, `layers.{L+2}.weight`).

Vocabulary padding: the token table and the head have Vp = `padded_vocab(cfg)`
rows and the padded ids' logits are -inf (see `pipekit.models.common`).
A block is `TransformerBlock` with GPT-2's parts (`gpt2_block_parts`): LayerNorm,
multi-head attention with biases and no rotary embedding, the GELU MLP of width
4*dim with biases, and GPT-2's scaled init of the output projections. With
`n_experts` set, every block's MLP is `common.moe_mlp` (GELU experts with biases).

Parameter names (the same at every pp/tp): `tied.embed.wte.weight`,
`tied.embed.wpe.weight`, `layers.{i}.norm1.weight`, `layers.{i}.attn.q.weight`
... `layers.{i}.mlp.proj.bias`, `layers.{L+1}.weight` / `.bias`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from operator import attrgetter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..layers import (
    CausalSelfAttention,
    GeluMLP,
    LayerNorm,
    TransformerBlock,
    VocabParallelEmbedding,
)
from ..layers.context import chunk_index
from ..layers.parallel import current_context_parallel, group_size, mark_sequence_parallel, normal_full, tp_slice
from ..spec import LayerSpec, TiedLayerSpec
from .common import (  # noqa: F401 - the shared helpers, importable from here as before
    FinalLayerNorm,
    MoEConfig,
    VocabParallelHead,
    check_finite_positive,
    check_moe,
    check_positive,
    mask_padded_vocab,
    moe_mlp,
    padded_vocab,
    vocab_logits,
    zoo_loss,
)


@dataclass
class GPT2Config(MoEConfig):
    """GPT-2, and GPT-2-MoE with `n_experts` set: every block's MLP is then an MoE layer of
    n_experts GELU experts (width 4*dim, with biases), top_k per token (the MoE fields:
    `common.MoEConfig`, keyword-only)."""

    vocab_size: int
    max_seq_len: int  # learned positions (HF n_positions)
    n_layers: int
    dim: int
    n_heads: int
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02  # token/position embeddings and the untied head; blocks use the layers' own init
    # The token table and the head get vocab_size rounded up to a multiple of this (1: no padding);
    # the padded ids' logits are -inf. Independent of tp, which must divide the padded size.
    vocab_pad_multiple: int = 128
    # Train with the head fused into the loss (common.zoo_loss): no (B, T, Vp/tp) logits in training.
    fused_loss: bool = False

    def __post_init__(self):
        check_positive(self, ("vocab_size", "max_seq_len", "n_layers", "dim", "n_heads", "vocab_pad_multiple"))
        check_finite_positive(self, ("norm_eps",))
        if self.dim % self.n_heads:
            raise ValueError(f"GPT2Config: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_experts is not None:
            check_moe(self)

    @property
    def padded_vocab(self) -> int:
        return padded_vocab(self)


# Sizes: `tiny` is ours (a byte vocabulary, CPU-sized); the others are the four
# models of Radford et al. 2019, "Language Models are Unsupervised Multitask
# Learners", Table 2, with the exact values of the Hugging Face configs
# openai-community/gpt2, gpt2-medium, gpt2-large, gpt2-xl (config.json).
FLAVOURS: dict[str, GPT2Config] = {
    "tiny": GPT2Config(vocab_size=256, max_seq_len=128, n_layers=4, dim=128, n_heads=4),
    "124m": GPT2Config(vocab_size=50257, max_seq_len=1024, n_layers=12, dim=768, n_heads=12),  # gpt2
    "355m": GPT2Config(vocab_size=50257, max_seq_len=1024, n_layers=24, dim=1024, n_heads=16),  # gpt2-medium
    "774m": GPT2Config(vocab_size=50257, max_seq_len=1024, n_layers=36, dim=1280, n_heads=20),  # gpt2-large
    "1.5b": GPT2Config(vocab_size=50257, max_seq_len=1024, n_layers=48, dim=1600, n_heads=25),  # gpt2-xl
}


class GPT2Embedding(nn.Module):
    """Token ids (B, T) int64 -> wte(ids) + wpe(0..T-1), (B, T, D), full on every tp rank
    (sequence-parallel: this rank's slice along T, (B, T/tp, D), with its own positions).
    Packed documents: `(ids, positions)` -> `(wte(ids) + wpe(positions), positions)`, each
    token at its position in its document.

    `wte` is vocab-parallel (rows split over tp; one forward all-reduce), with
    `padded_vocab` rows (default: `vocab_size`); `wpe` is replicated. Both start
    at N(0, init_std), wte drawn first. `vocab_size` is kept for the tied head's mask.
    """

    def __init__(self, vocab_size: int, max_seq_len: int, dim: int, init_std: float = 0.02,
                 padded_vocab: int | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.wte = VocabParallelEmbedding(padded_vocab or vocab_size, dim, init_std=init_std)
        # drawn by hand (nn.Embedding's own init would draw once more, and on meta imports torch._dynamo)
        self.wpe = nn.Embedding(max_seq_len, dim, _weight=normal_full((max_seq_len, dim), init_std))
        if self.wte.sequence_parallel:  # the output is this rank's sequence slice: so are wpe's rows' gradients
            mark_sequence_parallel(self.wpe.weight)
        self.context = current_context_parallel()  # cp: this rank's tokens sit at their chunks' positions

    def forward(self, ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> Any:
        if isinstance(ids, tuple):  # packed documents: (ids, positions) -> (hidden, positions)
            tokens, positions = ids
            return self._embed(tokens, positions), positions
        return self._embed(ids)

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        T = ids.shape[1]
        if T > self.wpe.num_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.wpe.num_embeddings} of the position table")
        if positions is not None:
            pos = positions  # (B, T)
        elif self.context is not None:  # context parallelism: the global positions of this rank's two chunks
            group = self.context[0]
            cp = group_size(group)
            if T * cp > self.wpe.num_embeddings:
                raise ValueError(f"sequence length {T * cp} (cp={cp} x {T}) exceeds max_seq_len="
                                 f"{self.wpe.num_embeddings} of the position table")
            pos = chunk_index(T, cp, dist.get_rank(group), device=ids.device)
        else:
            pos = torch.arange(T, device=ids.device)  # (T,)
        if self.wte.sequence_parallel:  # wte gives (B, T/tp, D), this rank's slice: its positions
            pos = tp_slice(pos, pos.dim() - 1, self.wte.group)
        return self.wte(ids) + self.wpe(pos)  # (B, T, D) + (T, D) or (B, T, D); sequence-parallel (B, T/tp, D)


def tied_logits(module: GPT2Embedding, h: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """`forward_fn` of the tied head: logits from the embedding's `wte` shard, padding masked
    (`fused`: `h` itself in training, see `common.vocab_logits`)."""
    return vocab_logits(module.wte, h, module.vocab_size, fused)


def gpt2_specs(cfg: GPT2Config) -> list:
    """The spec list of `cfg` (see the module docstring for its layout and names)."""
    embed_args = (cfg.vocab_size, cfg.max_seq_len, cfg.dim)
    embed_kw: dict[str, Any] = dict(init_std=cfg.init_std, padded_vocab=cfg.padded_vocab)
    if cfg.tie_embeddings:
        embed: LayerSpec = TiedLayerSpec("embed", GPT2Embedding, *embed_args, **embed_kw, tied_weight_attr="wte.weight")
        head: LayerSpec = TiedLayerSpec("embed", GPT2Embedding, *embed_args, **embed_kw, tied_weight_attr="wte.weight",
                                        forward_fn=partial(tied_logits, fused=True) if cfg.fused_loss else tied_logits)
    else:
        embed = LayerSpec(GPT2Embedding, *embed_args, **embed_kw)
        head = LayerSpec(VocabParallelHead, cfg.dim, cfg.vocab_size, cfg.padded_vocab, init_std=cfg.init_std,
                         fused_loss=cfg.fused_loss)

    parts = gpt2_block_parts(cfg.n_heads, 4 * cfg.dim, cfg.norm_eps)

    def mlp(i: int):  # block i's feed-forward factory: the dense GELU MLP, or MoE
        if cfg.n_experts is None:
            return parts["mlp"]
        return partial(moe_mlp, hidden=4 * cfg.dim, cfg=cfg, layer_index=i + 1, activation="gelu", bias=True)

    blocks = [LayerSpec(TransformerBlock, cfg.dim, **{**parts, "mlp": mlp(i)}, n_layers_for_init=cfg.n_layers)
              for i in range(cfg.n_layers)]
    return [embed, *blocks, LayerSpec(FinalLayerNorm, cfg.dim, cfg.norm_eps), head]


def gpt2_block_parts(n_heads: int, hidden: int, norm_eps: float) -> dict:
    """`TransformerBlock`'s parts in GPT-2's form: LayerNorm with bias, multi-head attention
    with biases and no rotary embedding, the GELU MLP of width `hidden` with biases.
    (GPT-2's scaled init of the output projections is the block's `n_layers_for_init`.)"""
    return dict(norm=partial(LayerNorm, eps=norm_eps), attn=partial(CausalSelfAttention, n_heads=n_heads, bias=True),
                mlp=partial(GeluMLP, hidden=hidden, bias=True))


def gpt2_loss(cfg: GPT2Config | None = None) -> LayerSpec:
    """Mean next-token cross-entropy on vocab-parallel logits (labels are the shifted ids); with
    `fused_loss`, fused with the head (`common.zoo_loss`; a tied head's weight is `wte`'s)."""
    return zoo_loss(cfg, head_of=attrgetter("wte") if cfg is not None and cfg.tie_embeddings else None)


def gpt2_params(cfg: GPT2Config, *, padded: bool = True, active: bool = False) -> tuple[int, int]:
    """(parameters, those of them in lookup-only tables: the position table, and the token
    table when it is not also the head), in closed form (see `registry.count_params`)."""
    D, L = cfg.dim, cfg.n_layers
    V = cfg.padded_vocab if padded else cfg.vocab_size
    mlp = 8 * D * D + 4 * D + D
    if cfg.n_experts is not None:  # GPT-2-MoE: routed (all, or the top_k a token uses), shared, router
        shared = cfg.n_shared_experts * (8 * D * D + 4 * D) + D if cfg.n_shared_experts else 0
        mlp = (cfg.top_k if active else cfg.n_experts) * mlp + shared + cfg.n_experts * D
    block = (4 * D * D + 4 * D) + mlp + 2 * 2 * D  # attn, mlp, two LayerNorms
    head = 0 if cfg.tie_embeddings else V * D
    total = V * D + cfg.max_seq_len * D + L * block + 2 * D + head
    lookups = cfg.max_seq_len * D + (0 if cfg.tie_embeddings else V * D)  # wpe, and wte when untied
    return total, lookups
