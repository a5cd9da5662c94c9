"""A tiny language model that exercises everything the engine must handle.

`toy_lm(cfg)` is a spec list with a token embedding tied to the output head,
a `(hidden, positions)` tuple activation whose integer half travels forward
only, residual MLP blocks of two different widths joined by projections, a
plain function in the list, and a final norm. Tokens do not mix across
positions (there is no attention), so `synthetic_batches` draws a task that a
per-position model can learn: label = (a * token + b) mod vocab.

It is a zoo family like the others (`get_model("toy")`, `pipekit train
configs/toy.yaml`): the registry maps the common keys `vocab_size` and
`n_layers` onto its fields `vocab` and `blocks`. It has no Hugging Face form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from ..layers.embedding import check_token_ids
from ..spec import LayerSpec, TiedLayerSpec
from .common import check_positive


@dataclass
class ToyConfig:
    vocab: int = 64  # the common key vocab_size
    dim: int = 32
    wide_dim: int = 48
    blocks: int = 2  # blocks at each width (the common key n_layers)
    mlp_ratio: int = 2

    def __post_init__(self):
        check_positive(self, ("vocab", "dim", "wide_dim", "blocks", "mlp_ratio"))


# Sizes: ours. `tiny` is the defaults; configs/toy.yaml widens it (vocab_size 64, dim 64, n_layers 3).
FLAVOURS: dict[str, ToyConfig] = {"tiny": ToyConfig()}


class TokenEmbedding(nn.Module):
    """tokens (B, T) -> (hidden (B, T, D), positions (B, T) int64)."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) / math.sqrt(dim))

    def forward(self, tokens: torch.Tensor):
        check_token_ids(tokens, self.weight.shape[0])
        pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return F.embedding(tokens, self.weight), pos


def embedding_logits(module: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """The tied head: hidden (B, T, D) -> logits (B, T, vocab)."""
    return hidden @ module.weight.t()


class AddPositions(nn.Module):
    """Adds a learned scale times sinusoidal features of the integer positions."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), 0.1))
        self.register_buffer("freq", torch.exp(-math.log(1e4) * torch.arange(dim) / dim), persistent=False)

    def forward(self, x):
        h, pos = x
        return h + self.scale * torch.sin(pos.unsqueeze(-1).to(h.dtype) * self.freq.to(h.dtype)), pos


class MLPBlock(nn.Module):
    """Pre-norm residual MLP on the hidden half of a (hidden, positions) pair."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        h, pos = x
        return h + self.down(F.gelu(self.up(self.norm(h)))), pos


class Project(nn.Module):
    """Changes the hidden width: (B, T, d_in) -> (B, T, d_out)."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out)

    def forward(self, x):
        h, pos = x
        return self.proj(h), pos


def drop_positions(x):
    """(hidden, positions) -> hidden: a plain function standing in the spec list."""
    return x[0]


def toy_lm(cfg: ToyConfig | None = None) -> list:
    cfg = cfg or ToyConfig()
    d, w = cfg.dim, cfg.wide_dim
    return [
        TiedLayerSpec("embed", TokenEmbedding, cfg.vocab, d),
        LayerSpec(AddPositions, d),
        *[LayerSpec(MLPBlock, d, cfg.mlp_ratio * d) for _ in range(cfg.blocks)],
        LayerSpec(Project, d, w),
        *[LayerSpec(MLPBlock, w, cfg.mlp_ratio * w) for _ in range(cfg.blocks)],
        LayerSpec(Project, w, d),
        drop_positions,
        LayerSpec(nn.LayerNorm, d),
        TiedLayerSpec("embed", TokenEmbedding, cfg.vocab, d, forward_fn=embedding_logits),
    ]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy: logits (B, T, V), labels (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


# A token-level mean: the engine weighs microbatches by valid tokens. (mypy types a function
# without attributes; the engine reads this one with getattr.)
lm_loss.ignore_index = -100  # type: ignore[attr-defined]


def toy_loss(cfg: ToyConfig | None = None):
    """The loss of the toy model: the plain function `lm_loss` (its logits are not vocab-parallel)."""
    return lm_loss


def toy_params(cfg: ToyConfig, *, padded: bool = True, active: bool = False) -> tuple[int, int]:
    """(parameters, those in lookup-only tables: none, the table is also the head), in closed
    form. No padding and no experts: `padded` and `active` change nothing."""
    d, w, r, n = cfg.dim, cfg.wide_dim, cfg.mlp_ratio, cfg.blocks

    def block(width: int) -> int:  # LayerNorm, up, down
        return 2 * width + (width + 1) * r * width + (r * width + 1) * width

    ends = cfg.vocab * d + d + 2 * d  # the tied table, AddPositions' scale, the final LayerNorm
    return ends + n * (block(d) + block(w)) + (d + 1) * w + (w + 1) * d, 0


def synthetic_batches(vocab: int, batch_size: int, seq_len: int, *, seed: int = 0, a: int = 5, b: int = 3):
    """Endless (tokens, labels) batches with label = (a * token + b) % vocab."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
        yield tokens, (a * tokens + b) % vocab
