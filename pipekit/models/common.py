"""The parts the zoo's families share: config checks, the padded vocab-parallel token
table and head, the MoE feed-forward factory, and the attention FLOPs.

A family's spec list composes these with `pipekit.layers.TransformerBlock`
(whose `mlp=` part is the dense MLP or `moe_mlp`); nothing here knows which
family calls it.

Vocabulary padding (Megatron's `--make-vocab-size-divisible-by`): the token
table and the head have Vp = `padded_vocab(cfg)` rows, `vocab_size` rounded up
to `vocab_pad_multiple`, so that tp can divide it (GPT-2's 50,257 = 29 * 1733
becomes 50,304). Vp depends on the config only, never on tp: every layout
builds the same padded model from the same draws. The padded rows are
initialised like the others but never used: ids are < vocab_size, and the
head sets the logits of padded ids to -inf on the shard that holds them, so
softmax and loss are exactly the unpadded model's and the padded rows get
zero gradient. Hugging Face import pads with zero rows, export strips them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F

from ..layers import ColumnParallelLinear, VocabParallelEmbedding, copy_to_tp
from ..layers.parallel import current_ep_group, group_rank
from ..spec import LayerSpec, TiedLayerSpec


# ---- the MoE fields of a config, and config checks ---------------------------------------------
@dataclass(kw_only=True)
class MoEConfig:
    """The MoE fields a family's config adds to its dense one, defined once (GPT-2's optional
    ones, Mixtral's): with `n_experts` set, every block's feed-forward part is an MoE layer
    (`moe_mlp`, a `pipekit.moe.MoEMLP`) of `n_experts` routed experts, `top_k` per token,
    beside `n_shared_experts` always-on ones. Keyword-only, so that a family config inherits
    them after its own positional fields; the names stay flat (`cfg.n_experts`, the config
    key `model.n_experts`). A family whose blocks are always MoE overrides the defaults
    (Mixtral: 8 experts) and checks them with `check_moe`."""

    n_experts: Optional[int] = None  # routed experts per block; None: dense blocks
    top_k: int = 2  # routed experts per token
    n_shared_experts: int = 0  # always-on experts beside the routed ones (one dense MLP of n_shared * hidden)
    score: str = "softmax"  # router scores: softmax | sigmoid (DeepSeek-V3)
    aux_loss_coef: float = 0.01  # load-balancing loss weight, per block
    z_loss_coef: float = 0.0  # router z-loss weight, per block
    capacity_factor: Optional[float] = None  # None: dropless


def check_positive(cfg, names: tuple[str, ...]) -> None:
    """Raise a ValueError naming the first field of `cfg` that is not a positive int."""
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(cfg).__name__}: {name} must be a positive int, got {value!r}")


def check_moe(cfg: MoEConfig) -> None:
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


# ---- the padded, vocab-parallel token table and head ---------------------------------------
def padded_vocab(cfg) -> int:
    """Rows of the token table and the head: `cfg.vocab_size` rounded up to `cfg.vocab_pad_multiple`."""
    m = cfg.vocab_pad_multiple
    return -(-cfg.vocab_size // m) * m


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


def vocab_table_and_head(cfg) -> tuple[LayerSpec, LayerSpec]:
    """The first and last entries of a model whose token table is a plain `VocabParallelEmbedding`
    (Llama, Mixtral): untied, `layers.0.weight` and a `VocabParallelHead`; tied, one
    `TiedLayerSpec("embed")` whose head multiplies by the table's vocab shard. Both padded."""
    rows = cfg.padded_vocab
    if cfg.tie_embeddings:
        embed = TiedLayerSpec("embed", VocabParallelEmbedding, rows, cfg.dim, init_std=cfg.init_std)
        head = TiedLayerSpec("embed", VocabParallelEmbedding, rows, cfg.dim, init_std=cfg.init_std,
                             forward_fn=partial(vocab_logits, vocab_size=cfg.vocab_size))
    else:
        embed = LayerSpec(VocabParallelEmbedding, rows, cfg.dim, init_std=cfg.init_std)
        head = LayerSpec(VocabParallelHead, cfg.dim, cfg.vocab_size, rows, init_std=cfg.init_std)
    return embed, head


# ---- parts of blocks ---------------------------------------------------------------------
def moe_mlp(dim: int, hidden: int, *, group=None, init_std: float = 0.02, out_init_std: float | None = None,
            cfg, layer_index: int, activation: str = "swiglu", bias: bool = False):
    """The MoE feed-forward part of block `layer_index` of a config with MoE fields (Mixtral's,
    or GPT-2's with n_experts set), on the current expert-parallel group: a `TransformerBlock`
    `mlp=` part (`partial(moe_mlp, hidden=..., cfg=cfg, layer_index=i)`)."""
    from ..moe import MoEMLP

    return MoEMLP(dim, hidden, cfg.n_experts, cfg.top_k, activation=activation, bias=bias, score=cfg.score,
                  aux_loss_coef=cfg.aux_loss_coef, z_loss_coef=cfg.z_loss_coef, capacity_factor=cfg.capacity_factor,
                  n_shared_experts=cfg.n_shared_experts, ep_group=current_ep_group(), layer_index=layer_index,
                  init_std=init_std, out_init_std=out_init_std)


# ---- sizes ---------------------------------------------------------------------------------
def attention_flops(cfg, seq_len: int) -> int:
    """Training FLOPs per token of the attention scores and weighted sum,
    12 * n_layers * (n_heads * head_dim) * seq_len (PaLM, Chowdhery et al. 2022, appendix B;
    counted without the causal half-saving, as MFU reports conventionally do)."""
    return 12 * cfg.n_layers * cfg.n_heads * (cfg.dim // cfg.n_heads) * seq_len
