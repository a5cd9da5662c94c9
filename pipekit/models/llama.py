"""Llama (2/3 architecture) as a spec list.

    [0]        embedding: VocabParallelEmbedding        ids (B, T) int64 -> hidden (B, T, D)
    [1..L]     LayerSpec(TransformerBlock, **llama_block_parts)    (B, T, D) -> (B, T, D)
    [L+1]      LayerSpec(FinalRMSNorm)                               (B, T, D) -> (B, T, D)
    [L+2]      head: VocabParallelHead(D, V)                         (B, T, D) -> (B, T, Vp/tp)

Untied (the default, as in Llama-3 8B/70B) the embedding is `layers.0.weight`
and the head `layers.{L+2}.weight`; with `tie_embeddings=True` both are one
`TiedLayerSpec("embed")` (`tied.embed.weight`) and the head multiplies by the
embedding's vocab shard. The token table and the head have Vp =
`padded_vocab(cfg)` rows and the padded ids' logits are -inf (see common.py).
With `fused_loss` the head passes (B, T, D) through in training and the loss
multiplies by its weight chunk by chunk (`common.zoo_loss`).
A block is `TransformerBlock` with Llama's parts (`llama_block_parts`): RMSNorm,
grouped-query attention without biases and with the rotary embedding, the SwiGLU
MLP of width `hidden`. Rotary positions 0..T-1 are made inside attention from the
sequence length (no position input travels between stages); with packed documents
the inputs are `(ids, positions)` and the positions travel with the hidden states
(`pipekit.models.common`: "Packed documents"). Generation feeds the new tokens alone at
their positions under a KV cache (`pipekit.layers.kv_cache`, `pipekit generate`).
Variants a Hugging Face model brings, all off by default: `rope_scaling` (Llama 3.1/3.2/3.3's
"llama3" frequency scaling, or "linear"; `pipekit.layers.rotary.RopeScaling`), a `head_dim`
other than dim / n_heads (Qwen3), biases on q, k and v (`qkv_bias`, Qwen2) and an RMSNorm of
each query and key head before the rotation (`qk_norm`, Qwen3), a sliding attention window
(`sliding_window`, Mistral 7B v0.1).
Limits: the KV cache is for one process (no pipeline stages), at most max_seq_len positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Optional

from ..layers import CausalSelfAttention, RMSNorm, SwiGLUMLP, TransformerBlock
from ..layers.rotary import rope_scaling_of
from ..spec import LayerSpec
from .common import FinalRMSNorm, check_finite_positive, check_positive, padded_vocab, vocab_table_and_head, zoo_loss


@dataclass
class LlamaConfig:
    vocab_size: int
    max_seq_len: int
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int  # grouped-query attention: n_heads / n_kv_heads query heads share a kv head
    hidden: int  # SwiGLU feed-forward width
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_embeddings: bool = False
    init_std: float = 0.02  # embedding and head; blocks use the layers' own init (0.02)
    # The token table and the head get vocab_size rounded up to a multiple of this (1: no padding);
    # the padded ids' logits are -inf. Independent of tp, which must divide the padded size.
    vocab_pad_multiple: int = 128
    # Train with the head fused into the loss (common.zoo_loss): no (B, T, Vp/tp) logits in training.
    fused_loss: bool = False
    # Rotary frequency scaling in Hugging Face's form, e.g. {"rope_type": "llama3", "factor": 8.0,
    # "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    # (Llama 3.1), or {"rope_type": "linear", "factor": 2.0}; None: unscaled.
    rope_scaling: Optional[dict[str, Any]] = None
    head_dim: Optional[int] = None  # each head's width; None: dim / n_heads
    qkv_bias: bool = False  # biases on q, k and v (not o), as Qwen2 has
    qk_norm: bool = False  # RMSNorm over each q and k head before the rotation, as Qwen3 has
    sliding_window: Optional[int] = None  # each token sees the last W (itself included), as Mistral 7B v0.1
    # The Hugging Face model this config came from where its features alone do not say it (a Mistral without
    # a window, a Phi-3): export writes that form again. None: chosen by the features (`hf.hf_form`).
    hf_model_type: Optional[str] = None

    HF_FORMS: ClassVar[tuple[str, ...]] = ("llama", "mistral", "qwen2", "qwen3", "phi3")  # valid hf_model_type

    @property
    def padded_vocab(self) -> int:
        return padded_vocab(self)

    @property
    def attn_head_dim(self) -> int:
        """Each attention head's width: `head_dim`, or dim / n_heads."""
        return self.dim // self.n_heads if self.head_dim is None else self.head_dim

    def __post_init__(self):
        check_positive(self, ("vocab_size", "max_seq_len", "n_layers", "dim", "n_heads", "n_kv_heads", "hidden",
                              "vocab_pad_multiple"))
        check_finite_positive(self, ("rope_theta", "norm_eps"))
        name = type(self).__name__  # MixtralConfig too
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"{name}: dim={self.dim} is not divisible by n_heads={self.n_heads} (or set head_dim)")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"{name}: head_dim must be >= 1 (or None: dim / n_heads), got {self.head_dim}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{name}: n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.hf_model_type is not None and self.hf_model_type not in self.HF_FORMS:
            raise ValueError(f"{name}: hf_model_type={self.hf_model_type!r} is not one of {list(self.HF_FORMS)} "
                             f"(or None)")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"{name}: sliding_window must be a positive int (or None: full causal), got {window!r}")
        if self.attn_head_dim % 2:
            raise ValueError(f"{name}: head dim {self.attn_head_dim} must be even for the rotary embedding")
        try:
            scaling = rope_scaling_of(self.rope_scaling)
        except ValueError as e:
            raise ValueError(f"{name}: rope_scaling={self.rope_scaling!r}: {e}") from None
        # kept in Hugging Face's dict form (what configs and checkpoints hold), None when unscaled
        self.rope_scaling = None if scaling is None else scaling.as_dict()


# Sizes: `tiny` is ours (byte vocabulary, grouped-query attention, CPU-sized).
# Llama-2 7B: Touvron et al. 2023 "Llama 2", and the HF config meta-llama/Llama-2-7b-hf.
# Llama-3 8B / 70B: Meta's "The Llama 3 Herd of Models" (2024), Table 3, and the HF
# configs meta-llama/Meta-Llama-3-8B and Meta-Llama-3-70B (config.json; rope_theta
# 500000, rms_norm_eps 1e-5, no rope scaling — the 3.1 models add scaling, unsupported).
FLAVOURS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=256, max_seq_len=128, n_layers=4, dim=128, n_heads=4, n_kv_heads=2,
                        hidden=384, rope_theta=10000.0),
    "2-7b": LlamaConfig(vocab_size=32000, max_seq_len=4096, n_layers=32, dim=4096, n_heads=32, n_kv_heads=32,
                        hidden=11008, norm_eps=1e-5, rope_theta=10000.0),
    "3-8b": LlamaConfig(vocab_size=128256, max_seq_len=8192, n_layers=32, dim=4096, n_heads=32, n_kv_heads=8,
                        hidden=14336),
    "3-70b": LlamaConfig(vocab_size=128256, max_seq_len=8192, n_layers=80, dim=8192, n_heads=64, n_kv_heads=8,
                         hidden=28672),
}


def llama_specs(cfg: LlamaConfig, mlp: Optional[Callable[[int], Callable]] = None) -> list:
    """The spec list of `cfg` (see the module docstring for its layout and names).

    `mlp(i)`, when given, is block i's feed-forward factory (`TransformerBlock`'s `mlp=`)
    instead of the dense SwiGLU MLP: mixtral.py builds its MoE model as this list with MoE factories."""
    embed, head = vocab_table_and_head(cfg)
    parts = llama_block_parts(cfg.n_heads, cfg.n_kv_heads, cfg.hidden, cfg.norm_eps, cfg.rope_theta,
                              rope_scaling=cfg.rope_scaling, head_dim=cfg.head_dim, qkv_bias=cfg.qkv_bias,
                              qk_norm=cfg.qk_norm, sliding_window=cfg.sliding_window)
    blocks = [LayerSpec(TransformerBlock, cfg.dim, **{**parts, "mlp": mlp(i) if mlp else parts["mlp"]})
              for i in range(cfg.n_layers)]
    return [embed, *blocks, LayerSpec(FinalRMSNorm, cfg.dim, cfg.norm_eps), head]


def llama_block_parts(n_heads: int, n_kv_heads: int, hidden: int, norm_eps: float, rope_theta: float, *,
                      rope_scaling: Optional[dict] = None, head_dim: Optional[int] = None, qkv_bias: bool = False,
                      qk_norm: bool = False, sliding_window: Optional[int] = None) -> dict:
    """`TransformerBlock`'s parts in Llama's form: RMSNorm, grouped-query attention without
    biases and with the rotary embedding at `rope_theta`, the SwiGLU MLP of width `hidden`;
    the variants of `LlamaConfig` (scaled rope, head_dim, q/k/v biases, q/k head norms)."""
    attn = partial(CausalSelfAttention, n_heads=n_heads, n_kv_heads=n_kv_heads, bias=False, rope_theta=rope_theta,
                   rope_scaling=rope_scaling, head_dim=head_dim, qkv_bias=qkv_bias,
                   qk_norm_eps=norm_eps if qk_norm else None, sliding_window=sliding_window)
    return dict(norm=partial(RMSNorm, eps=norm_eps), attn=attn, mlp=partial(SwiGLUMLP, hidden=hidden, bias=False))


def llama_loss(cfg: LlamaConfig | None = None) -> LayerSpec:
    """Mean next-token cross-entropy on vocab-parallel logits; with `fused_loss`, fused with the
    head (`common.zoo_loss`)."""
    return zoo_loss(cfg)


def llama_params(cfg: LlamaConfig, *, padded: bool = True, active: bool = False,
                 ffn: Optional[int] = None) -> tuple[int, int]:
    """(parameters, those of them in lookup-only tables: the token table when untied), in
    closed form (see `registry.count_params`). `ffn`: each block's feed-forward parameters
    (default: the SwiGLU MLP's 3 * dim * hidden; mixtral.py gives its MoE layer's)."""
    D, L = cfg.dim, cfg.n_layers
    V = cfg.padded_vocab if padded else cfg.vocab_size
    hd = cfg.attn_head_dim
    attn = 2 * D * cfg.n_heads * hd + 2 * D * cfg.n_kv_heads * hd  # q, o; k, v
    attn += (cfg.n_heads + 2 * cfg.n_kv_heads) * hd if cfg.qkv_bias else 0
    attn += 2 * hd if cfg.qk_norm else 0
    block = attn + (3 * D * cfg.hidden if ffn is None else ffn) + 2 * D  # and two RMSNorms
    head = 0 if cfg.tie_embeddings else V * D
    return V * D + L * block + D + head, (0 if cfg.tie_embeddings else V * D)
