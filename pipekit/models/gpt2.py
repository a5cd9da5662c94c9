"""GPT-2 as a spec list: tied vocab-parallel embedding, pre-norm blocks, LayerNorm, tied head.

    [0]        TiedLayerSpec("embed", GPT2Embedding)   ids (B, T) int64 -> hidden (B, T, D)
    [1..L]     LayerSpec(TransformerBlock, style="gpt2")            (B, T, D) -> (B, T, D)
    [L+1]      LayerSpec(LayerNorm)                                  (B, T, D) -> (B, T, D)
    [L+2]      TiedLayerSpec("embed", ..., forward_fn=tied_logits)   (B, T, D) -> (B, T, Vp/tp)

The head's logits stay split over the vocabulary (rank r holds ids
[r*Vp/tp, (r+1)*Vp/tp)) and go straight into `VocabParallelCrossEntropy`, so
the full (B, T, Vp) logits never exist on one rank. With
`tie_embeddings=False` the embedding is a plain `LayerSpec` and the head a
bias-free `VocabParallelHead` (names `layers.0.*`, `layers.{L+2}.weight`).

Vocabulary padding (Megatron's `--make-vocab-size-divisible-by`): the token
table and the head have Vp = `padded_vocab(cfg)` rows, `vocab_size` rounded up
to `vocab_pad_multiple`, so that tp can divide it (GPT-2's 50,257 = 29 * 1733
becomes 50,304). Vp depends on the config only, never on tp: every layout
builds the same padded model from the same draws. The padded rows are
initialised like the others but never used: ids are < vocab_size, and the
head sets the logits of padded ids to -inf on the shard that holds them, so
softmax and loss are exactly the unpadded model's and the padded rows get
zero gradient. Hugging Face import pads with zero rows, export strips them.

Parameter names (the same at every pp/tp): `tied.embed.wte.weight`,
`tied.embed.wpe.weight`, `layers.{i}.norm1.weight`, `layers.{i}.attn.q.weight`
... `layers.{i}.mlp.proj.bias`, `layers.{L+1}.weight` / `.bias`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import (
    ColumnParallelLinear,
    LayerNorm,
    TransformerBlock,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    copy_to_tp,
)
from ..layers.parallel import group_rank, normal_full
from ..spec import LayerSpec, TiedLayerSpec


@dataclass
class GPT2Config:
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
    # GPT-2-MoE: with n_experts set, every block's MLP is an MoE layer of n_experts GELU experts
    # (width 4*dim, with biases), top_k per token (see pipekit.moe.MoEMLP for the router options).
    n_experts: Optional[int] = None
    top_k: int = 2
    n_shared_experts: int = 0
    score: str = "softmax"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    capacity_factor: Optional[float] = None

    def __post_init__(self):
        check_positive(self, ("vocab_size", "max_seq_len", "n_layers", "dim", "n_heads", "vocab_pad_multiple"))
        if self.dim % self.n_heads:
            raise ValueError(f"GPT2Config: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_experts is not None:
            check_moe(self)

    @property
    def padded_vocab(self) -> int:
        return padded_vocab(self)


def padded_vocab(cfg) -> int:
    """Rows of the token table and the head: `cfg.vocab_size` rounded up to `cfg.vocab_pad_multiple`."""
    m = cfg.vocab_pad_multiple
    return -(-cfg.vocab_size // m) * m


def check_moe(cfg) -> None:
    """The MoE fields of a model config (n_experts, top_k, n_shared_experts, capacity_factor, score)."""
    name = type(cfg).__name__
    check_positive(cfg, ("n_experts", "top_k"))
    if cfg.top_k > cfg.n_experts:
        raise ValueError(f"{name}: top_k={cfg.top_k} exceeds n_experts={cfg.n_experts}")
    if cfg.n_shared_experts < 0:
        raise ValueError(f"{name}: n_shared_experts must be >= 0, got {cfg.n_shared_experts}")
    if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
        raise ValueError(f"{name}: capacity_factor must be > 0 (or None: dropless), got {cfg.capacity_factor}")
    if cfg.score not in ("softmax", "sigmoid"):
        raise ValueError(f"{name}: score={cfg.score!r} is not one of ['softmax', 'sigmoid']")


def check_positive(cfg, names: tuple[str, ...]) -> None:
    """Raise a ValueError naming the first field of `cfg` that is not a positive int."""
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(cfg).__name__}: {name} must be a positive int, got {value!r}")


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
    """Token ids (B, T) int64 -> wte(ids) + wpe(0..T-1), (B, T, D), full on every tp rank.

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

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        if T > self.wpe.num_embeddings:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.wpe.num_embeddings} of the position table")
        pos = torch.arange(T, device=ids.device)
        return self.wte(ids) + self.wpe(pos)  # (B, T, D) + (T, D)


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, vocab_start: int) -> torch.Tensor:
    """Logits (..., V_shard) of global ids [vocab_start, vocab_start + V_shard), with those of
    padded ids (>= vocab_size) set to -inf; returned as they are when the shard has none.
    No communication: each rank masks its own shard. The masked entries get zero gradient."""
    v_shard = logits.shape[-1]
    if vocab_start + v_shard <= vocab_size:
        return logits
    ids = torch.arange(vocab_start, vocab_start + v_shard, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))


def vocab_logits(embedding: VocabParallelEmbedding, h: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """The tied head on a vocab-parallel table: (B, T, D) -> (B, T, Vp/tp), this rank's vocab slice,
    the ids >= `vocab_size` (padding; None: no padding) masked to -inf.

    Communication: none forward; backward all-reduces the gradient of `h` over tp."""
    logits = F.linear(copy_to_tp(h, embedding.group), embedding.weight)
    if vocab_size is None:
        return logits
    return mask_padded_vocab(logits, vocab_size, embedding.vocab_start)


def tied_logits(module: GPT2Embedding, h: torch.Tensor) -> torch.Tensor:
    """`forward_fn` of the tied head: logits from the embedding's `wte` shard, padding masked."""
    return vocab_logits(module.wte, h, module.vocab_size)


class VocabParallelHead(ColumnParallelLinear):
    """The untied head: a bias-free `ColumnParallelLinear(dim, padded_vocab)` whose
    logits (B, T, Vp/tp) have the padded ids (>= vocab_size) masked to -inf.
    Same parameter (`weight`), same draws and same communication as the plain layer."""

    def __init__(self, dim: int, vocab_size: int, padded_vocab: int | None = None, init_std: float = 0.02):
        super().__init__(dim, padded_vocab or vocab_size, bias=False, gather_output=False, init_std=init_std)
        self.vocab_size = vocab_size
        self.vocab_start = group_rank(self.group) * self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mask_padded_vocab(super().forward(x), self.vocab_size, self.vocab_start)


def gpt2_specs(cfg: GPT2Config) -> list:
    """The spec list of `cfg` (see the module docstring for its layout and names)."""
    embed_args = (cfg.vocab_size, cfg.max_seq_len, cfg.dim)
    embed_kw = dict(init_std=cfg.init_std, padded_vocab=cfg.padded_vocab)
    if cfg.tie_embeddings:
        embed = TiedLayerSpec("embed", GPT2Embedding, *embed_args, **embed_kw, tied_weight_attr="wte.weight")
        head = TiedLayerSpec("embed", GPT2Embedding, *embed_args, **embed_kw,
                             tied_weight_attr="wte.weight", forward_fn=tied_logits)
    else:
        embed = LayerSpec(GPT2Embedding, *embed_args, **embed_kw)
        head = LayerSpec(VocabParallelHead, cfg.dim, cfg.vocab_size, cfg.padded_vocab, init_std=cfg.init_std)
    def mlp(i: int):
        if cfg.n_experts is None:
            return None
        from .mixtral import moe_mlp

        return partial(moe_mlp, cfg=cfg, layer_index=i + 1, activation="gelu", bias=True)

    blocks = [
        LayerSpec(TransformerBlock, cfg.dim, cfg.n_heads, hidden=4 * cfg.dim, style="gpt2",
                  norm_eps=cfg.norm_eps, n_layers_for_init=cfg.n_layers, mlp=mlp(i))
        for i in range(cfg.n_layers)
    ]
    return [embed, *blocks, LayerSpec(LayerNorm, cfg.dim, cfg.norm_eps), head]


def gpt2_loss(cfg: GPT2Config | None = None) -> LayerSpec:
    """Mean next-token cross-entropy on vocab-parallel logits (labels are the shifted ids)."""
    return LayerSpec(VocabParallelCrossEntropy)
