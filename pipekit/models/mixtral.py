"""Mixtral-style MoE models (Llama with MoE feed-forward blocks) as a spec list.

    [0]        embedding: VocabParallelEmbedding                      ids (B, T) -> (B, T, D)
    [1..L]     LayerSpec(TransformerBlock, Llama's parts, mlp=MoE)    (B, T, D) -> (B, T, D)
    [L+1]      LayerSpec(FinalRMSNorm)
    [L+2]      head: VocabParallelHead(D, V)                          (B, T, D) -> (B, T, Vp/tp)

Every block is a Llama block whose MLP is a `pipekit.moe.MoEMLP`: `n_experts`
SwiGLU experts of width `hidden`, `top_k` per token, softmax router with the
top-k weights renormalised (Mixtral), plus optionally `n_shared_experts`
always-on experts (DeepSeek-style; with many small routed experts, that is the
"fine-grained" design). Each block's router load-balancing loss is weighted by
`aux_loss_coef`, the z-loss by `z_loss_coef`. HF Mixtral adds one loss for
all layers together, `router_aux_loss_coef` times top_k times (about) the
mean of pipekit's per-layer losses, so `aux_loss_coef = router_aux_loss_coef *
top_k / n_layers` gives the same pressure per layer (what HF conversion does).
Experts are sharded over the expert-parallel group the PipelineModule builds
layers under (`parallel.ep`).

Parameter names: `layers.{i}.mlp.router.weight` (E, D), `layers.{i}.mlp.experts.
w_gate` / `w_up` (E, D, H) and `w_down` (E, H, D); the rest as in llama.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from ..spec import LayerSpec
from .common import MoEConfig, check_moe, moe_mlp, zoo_loss
from .llama import LlamaConfig, llama_params, llama_specs


@dataclass(kw_only=True)
class MixtralConfig(LlamaConfig, MoEConfig):
    """Llama's config (its fields and checks; `hidden` is each routed expert's SwiGLU width) with
    the MoE fields of `common.MoEConfig`, checked too. Only defaults are declared here: 8 experts,
    `aux_loss_coef` 0.02, `rope_theta` 1e6 (Mixtral's); they are keyword-only, as the MoE fields."""

    n_experts: int = 8
    aux_loss_coef: float = 0.02
    rope_theta: float = 1000000.0

    HF_FORMS: ClassVar[tuple[str, ...]] = ("mixtral", "qwen3_moe")

    def __post_init__(self):
        super().__post_init__()
        check_moe(self)


# Sizes: `tiny` (Mixtral-style: 8 experts, top-2) and `deepseek_tiny` (fine-grained: 16 small
# experts, top-4, one shared expert, sigmoid scores) are ours, CPU-sized. 8x7b: Mistral AI's
# "Mixtral of Experts" (Jiang et al. 2024) and the HF config mistralai/Mixtral-8x7B-v0.1.
FLAVOURS: dict[str, MixtralConfig] = {
    "tiny": MixtralConfig(vocab_size=256, max_seq_len=128, n_layers=2, dim=64, n_heads=4, n_kv_heads=2, hidden=128,
                          n_experts=8, top_k=2, rope_theta=10000.0),
    "deepseek_tiny": MixtralConfig(vocab_size=256, max_seq_len=128, n_layers=2, dim=64, n_heads=4, n_kv_heads=2,
                                   hidden=32, n_experts=16, top_k=4, n_shared_experts=1, score="sigmoid",
                                   aux_loss_coef=0.001, rope_theta=10000.0),
    "8x7b": MixtralConfig(vocab_size=32000, max_seq_len=32768, n_layers=32, dim=4096, n_heads=32, n_kv_heads=8,
                          hidden=14336, n_experts=8, top_k=2, aux_loss_coef=0.02 * 2 / 32),  # HF's 0.02
}


def mixtral_specs(cfg: MixtralConfig) -> list:
    """The spec list of `cfg` (see the module docstring for its layout and names): Llama's,
    with block i's feed-forward factory `common.moe_mlp` for layer index i + 1."""
    return llama_specs(cfg, mlp=lambda i: partial(moe_mlp, hidden=cfg.hidden, cfg=cfg, layer_index=i + 1))


def mixtral_loss(cfg: MixtralConfig | None = None) -> LayerSpec:
    """Mean next-token cross-entropy on vocab-parallel logits (the router losses are attached
    inside the blocks, pipekit.auxloss); with `fused_loss`, fused with the head (`common.zoo_loss`)."""
    return zoo_loss(cfg)


def mixtral_params(cfg: MixtralConfig, *, padded: bool = True, active: bool = False) -> tuple[int, int]:
    """(parameters, those in lookup-only tables), as `llama_params` with each block's MoE layer:
    the routed experts (all, or with `active` the top_k a token uses), the router and the shared experts."""
    D = cfg.dim
    routed = (cfg.top_k if active else cfg.n_experts) * 3 * D * cfg.hidden
    ffn = routed + cfg.n_experts * D + cfg.n_shared_experts * 3 * D * cfg.hidden
    return llama_params(cfg, padded=padded, ffn=ffn)
