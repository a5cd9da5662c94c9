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

The fused loss (`cfg.fused_loss`, Liger-Kernel's `fused_linear_cross_entropy`):
the head stays the model's last layer with the same parameter (tied or not),
but in training it passes the hidden states through and the loss
(`FusedLinearCrossEntropy`, `zoo_loss`) multiplies them by the head's weight
chunk by chunk, so the (B, T, Vp/tp) logits never exist; in eval the head gives
its logits as without it (eval_batch's outputs, generate).

Packed documents (`data.pack`): a zoo model also takes `(ids, positions)`, each
token's position in its document (B, T) int64. The embedding gives `(hidden,
positions)`, every block hands the positions to attention (rotary and learned
positions at them, attention within each document) and passes them on, across stage
boundaries too (an integer tensor: forward only), and the final norm
(`FinalRMSNorm`, `FinalLayerNorm`) drops them, so the head sees (B, T, D) as always.
Fed a plain ids tensor, the same model computes what it always did.
Limits: MoE blocks route the padding tokens of a packed row like any other (they
count in the balancing loss and take expert capacity).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F

from ..layers import (
    ColumnParallelLinear,
    FusedLinearCrossEntropy,
    LayerNorm,
    RMSNorm,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    gather_from_tp,
)
from ..layers.parallel import SEQUENCE_DIM, current_ep_group, enter_tp, group_rank, sequence_parallel_linears
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
    # the top_k weights of a token rescaled to sum to one (Mixtral, Qwen3-MoE's norm_topk_prob); None: when top_k > 1
    renormalize: Optional[bool] = None
    aux_loss_coef: float = 0.01  # load-balancing loss weight, per block
    global_balance: bool = False  # balancing loss on the loads of the whole step (microbatches x dp; pre-pass)
    z_loss_coef: float = 0.0  # router z-loss weight, per block
    bias_update_rate: float = 0.0  # DeepSeek-V3 aux-loss-free bias, moved once per step on the dp group's loads
    n_groups: Optional[int] = None  # device-limited routing: experts in n_groups groups of consecutive ids ...
    topk_groups: Optional[int] = None  # ... each token to experts of at most topk_groups of them
    capacity_factor: Optional[float] = None  # None: dropless
    token_drop_policy: str = "position"  # over capacity: drop the last tokens (position) or lowest weights (probs)
    pad_expert_input_to_capacity: bool = False  # with a capacity: every expert gets exactly capacity rows


def check_positive(cfg, names: tuple[str, ...]) -> None:
    """Raise a ValueError naming the first field of `cfg` that is not a positive int."""
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(cfg).__name__}: {name} must be a positive int, got {value!r}")


def check_finite_positive(cfg, names: tuple[str, ...]) -> None:
    """Raise a ValueError naming the first field of `cfg` (a theta, an eps) that is not a finite number > 0."""
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{type(cfg).__name__}: {name}={value!r} must be a finite number > 0")


def check_moe(cfg: MoEConfig) -> None:
    """The MoE fields of a model config (n_experts, top_k, n_shared_experts, capacity_factor, score,
    the balancing and routing settings, the drop policy)."""
    from ..moe import DROP_POLICIES
    from ..moe.router import check_groups

    name = type(cfg).__name__
    check_positive(cfg, ("n_experts", "top_k"))
    assert cfg.n_experts is not None  # check_positive refused None
    if cfg.top_k > cfg.n_experts:
        raise ValueError(f"{name}: top_k={cfg.top_k} exceeds n_experts={cfg.n_experts}")
    if cfg.n_shared_experts < 0:
        raise ValueError(f"{name}: n_shared_experts must be >= 0, got {cfg.n_shared_experts}")
    if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
        raise ValueError(f"{name}: capacity_factor must be > 0 (or None: dropless), got {cfg.capacity_factor}")
    if cfg.score not in ("softmax", "sigmoid"):
        raise ValueError(f"{name}: score={cfg.score!r} is not one of ['softmax', 'sigmoid']")
    rate = cfg.bias_update_rate
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < float("inf"):
        raise ValueError(f"{name}: bias_update_rate must be a finite number >= 0 (0: off), got {rate!r}")
    if cfg.renormalize is not None and not isinstance(cfg.renormalize, bool):
        raise ValueError(f"{name}: renormalize must be true, false or None (when top_k > 1), got {cfg.renormalize!r}")
    for flag in ("global_balance", "pad_expert_input_to_capacity"):
        if not isinstance(getattr(cfg, flag), bool):
            raise ValueError(f"{name}: {flag} must be true or false, got {getattr(cfg, flag)!r}")
    try:
        check_groups(cfg.n_experts, cfg.top_k, cfg.n_groups, cfg.topk_groups)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from e
    if cfg.token_drop_policy not in DROP_POLICIES:
        raise ValueError(f"{name}: token_drop_policy={cfg.token_drop_policy!r} is not one of {list(DROP_POLICIES)}")
    if cfg.pad_expert_input_to_capacity and cfg.capacity_factor is None:
        raise ValueError(f"{name}: pad_expert_input_to_capacity pads each expert to its capacity, but "
                         "capacity_factor is None (dropless); set a capacity_factor")


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


def vocab_logits(embedding: VocabParallelEmbedding, h: torch.Tensor, vocab_size: int | None = None,
                 fused: bool = False) -> torch.Tensor:
    """The tied head on a vocab-parallel table: (B, T, D) -> (B, T, Vp/tp), this rank's vocab slice,
    the ids >= `vocab_size` (padding; None: no padding) masked to -inf. `fused` (the loss is
    `FusedLinearCrossEntropy`, which multiplies by the table itself): `h` as it is while the
    table is in training mode, the logits in eval.

    Communication: none forward; backward all-reduces the gradient of `h` over tp.
    Sequence-parallel (the table was built so): `h` is this rank's slice (B, T/tp, D), all-gathered
    along T first (backward: reduce-scatter; only the slice is saved for backward and gathered
    again there, `sequence_parallel_linears`; fused: backward keeps this rank's slice of the
    kernel's already summed gradient)."""
    if fused and embedding.training:
        return sequence_whole(h, embedding)
    if embedding.sequence_parallel:  # saves h's slice, not the gathered h
        (logits,) = sequence_parallel_linears(h, embedding.group, (embedding.weight,), (None,))
    else:
        logits = F.linear(enter_tp(h, embedding.group, False), embedding.weight)
    if vocab_size is None:
        return logits
    return mask_padded_vocab(logits, vocab_size, embedding.vocab_start)


def sequence_whole(h: torch.Tensor, head) -> torch.Tensor:
    """What a fused head passes to `FusedLinearCrossEntropy` in training: `h`, or with sequence
    parallelism its slices all-gathered along T (backward keeps this rank's slice: the kernel
    all-reduces the gradient of h over tp itself)."""
    return gather_from_tp(h, head.group, dim=SEQUENCE_DIM) if head.sequence_parallel else h


class VocabParallelHead(ColumnParallelLinear):
    """The untied head: a bias-free `ColumnParallelLinear(dim, padded_vocab)` whose
    logits (B, T, Vp/tp) have the padded ids (>= vocab_size) masked to -inf.
    Same parameter (`weight`), same draws and same communication as the plain layer.
    `fused_loss` (the loss is `FusedLinearCrossEntropy`, which multiplies by `weight`
    itself): in training mode the hidden states pass through unchanged; in eval, the logits."""

    def __init__(self, dim: int, vocab_size: int, padded_vocab: int | None = None, init_std: float = 0.02,
                 fused_loss: bool = False):
        super().__init__(dim, padded_vocab or vocab_size, bias=False, gather_output=False, init_std=init_std)
        self.vocab_size = vocab_size
        self.vocab_start = group_rank(self.group) * self.weight.shape[0]
        self.fused_loss = fused_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_loss and self.training:
            return sequence_whole(x, self)
        return mask_padded_vocab(super().forward(x), self.vocab_size, self.vocab_start)


def zoo_loss(cfg, head_of: Callable | None = None) -> LayerSpec:
    """The loss of a zoo model: mean next-token cross-entropy on the head's vocab-parallel logits
    (`VocabParallelCrossEntropy`), or with `cfg.fused_loss` the head and the loss in one
    (`FusedLinearCrossEntropy`, bound to the last layer, or to `head_of(last layer)`)."""
    if cfg is not None and cfg.fused_loss:
        return LayerSpec(FusedLinearCrossEntropy, cfg.vocab_size, head_of=head_of)
    return LayerSpec(VocabParallelCrossEntropy)


def vocab_table_and_head(cfg) -> tuple[LayerSpec, LayerSpec]:
    """The first and last entries of a model whose token table is a plain `VocabParallelEmbedding`
    (Llama, Mixtral): untied, `layers.0.weight` and a `VocabParallelHead`; tied, one
    `TiedLayerSpec("embed")` whose head multiplies by the table's vocab shard. Both padded;
    with `cfg.fused_loss` the head passes the hidden states through in training (`zoo_loss`)."""
    rows = cfg.padded_vocab
    if cfg.tie_embeddings:
        embed: LayerSpec = TiedLayerSpec("embed", VocabParallelEmbedding, rows, cfg.dim, init_std=cfg.init_std)
        head: LayerSpec = TiedLayerSpec("embed", VocabParallelEmbedding, rows, cfg.dim, init_std=cfg.init_std,
                                        forward_fn=partial(vocab_logits, vocab_size=cfg.vocab_size,
                                                           fused=cfg.fused_loss))
    else:
        embed = LayerSpec(VocabParallelEmbedding, rows, cfg.dim, init_std=cfg.init_std)
        head = LayerSpec(VocabParallelHead, cfg.dim, cfg.vocab_size, rows, init_std=cfg.init_std,
                         fused_loss=cfg.fused_loss)
    return embed, head


# ---- the final norm: drops the positions of packed documents ---------------------------------
def hidden_of(x):
    """The hidden states of a block's output: `x`, or packed `(hidden, positions)`'s first."""
    return x[0] if isinstance(x, tuple) else x


class FinalRMSNorm(RMSNorm):
    """The last RMSNorm of a model (Llama, Mixtral): `RMSNorm` of the hidden states, whose
    input may also be packed `(hidden, positions)` (the positions stop here)."""

    def forward(self, x, residual: torch.Tensor | None = None):
        return super().forward(hidden_of(x), residual)


class FinalLayerNorm(LayerNorm):
    """The last LayerNorm of a model (GPT-2): `LayerNorm` of the hidden states, whose
    input may also be packed `(hidden, positions)` (the positions stop here)."""

    def forward(self, x, residual: torch.Tensor | None = None):
        return super().forward(hidden_of(x), residual)


# ---- parts of blocks ---------------------------------------------------------------------
def moe_mlp(dim: int, hidden: int, *, group=None, init_std: float = 0.02, out_init_std: float | None = None,
            cfg, layer_index: int, activation: str = "swiglu", bias: bool = False):
    """The MoE feed-forward part of block `layer_index` of a config with MoE fields (Mixtral's,
    or GPT-2's with n_experts set), on the current expert-parallel group: a `TransformerBlock`
    `mlp=` part (`partial(moe_mlp, hidden=..., cfg=cfg, layer_index=i)`). The aux-free bias,
    when on, moves once per step (`bias_update="step"`: after the engine's optimizer step, on
    the loads of the stage's whole data-parallel group)."""
    from ..moe import MoEMLP

    return MoEMLP(dim, hidden, cfg.n_experts, cfg.top_k, activation=activation, bias=bias, score=cfg.score,
                  renormalize=cfg.renormalize,
                  aux_loss_coef=cfg.aux_loss_coef, z_loss_coef=cfg.z_loss_coef, global_balance=cfg.global_balance,
                  bias_update_rate=cfg.bias_update_rate, bias_update="step", n_groups=cfg.n_groups,
                  topk_groups=cfg.topk_groups, capacity_factor=cfg.capacity_factor,
                  drop_policy=cfg.token_drop_policy, pad_to_capacity=cfg.pad_expert_input_to_capacity,
                  n_shared_experts=cfg.n_shared_experts, ep_group=current_ep_group(), layer_index=layer_index,
                  init_std=init_std, out_init_std=out_init_std)


# ---- sizes ---------------------------------------------------------------------------------
def attention_flops(cfg, seq_len: int) -> int:
    """Training FLOPs per token of the attention scores and weighted sum,
    12 * n_layers * (n_heads * head_dim) * seq_len (PaLM, Chowdhery et al. 2022, appendix B;
    counted without the causal half-saving, as MFU reports conventionally do); with a sliding
    window W, min(seq_len, W) keys per query in place of seq_len."""
    head_dim = getattr(cfg, "attn_head_dim", cfg.dim // cfg.n_heads)  # Llama's may differ from dim / n_heads
    window = getattr(cfg, "sliding_window", None)  # a query sees at most that many keys
    return 12 * cfg.n_layers * cfg.n_heads * head_dim * (seq_len if window is None else min(seq_len, window))
