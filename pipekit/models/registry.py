"""The model families by name: configs from flavours, spec lists, losses, sizes and FLOPs.

    cfg = get_model("llama", "tiny", n_layers=2)     # a LlamaConfig
    specs, loss = model_specs(cfg), model_loss(cfg)  # for PipelineModule(specs, loss_fn=loss, ...)
    count_params(cfg), flops_per_token(cfg, seq_len)
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, replace
from typing import Any, Callable

from ..spec import LayerSpec
from . import gpt2, llama, mixtral


@dataclass(frozen=True)
class Family:
    config_cls: type
    flavours: dict[str, Any]
    specs: Callable[[Any], list]
    loss: Callable[[Any], LayerSpec]


FAMILIES: dict[str, Family] = {
    "gpt2": Family(gpt2.GPT2Config, gpt2.FLAVOURS, gpt2.gpt2_specs, gpt2.gpt2_loss),
    "llama": Family(llama.LlamaConfig, llama.FLAVOURS, llama.llama_specs, llama.llama_loss),
    "mixtral": Family(mixtral.MixtralConfig, mixtral.FLAVOURS, mixtral.mixtral_specs, mixtral.mixtral_loss),
}


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; valid families: {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of(cfg) -> str:
    """The family name of a config object."""
    for name, fam in FAMILIES.items():
        if type(cfg) is fam.config_cls:
            return name
    raise ValueError(f"{type(cfg).__name__} is not the config of a model family; valid families: {sorted(FAMILIES)}")


def get_model(family: str, flavour: str = "tiny", **overrides) -> Any:
    """The config of `family`'s `flavour` with `overrides` applied (validated again).

    Unknown families, flavours or override keys raise a ValueError listing the valid ones."""
    fam = _family(family)
    if flavour not in fam.flavours:
        raise ValueError(f"unknown {family} flavour {flavour!r}; valid flavours: {list(fam.flavours)}")
    return config_from_dict(family, {**_asdict(fam.flavours[flavour]), **overrides})


def config_from_dict(family: str, values: dict) -> Any:
    """Build `family`'s config from a dict of its fields (e.g. one read back from a file)."""
    fam = _family(family)
    valid = [f.name for f in fields(fam.config_cls)]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"unknown {family} config key(s) {unknown}; valid keys: {valid}")
    missing = [k for k in valid if k not in values and _required(fam.config_cls, k)]
    if missing:
        raise ValueError(f"{family} config lacks {missing}")
    return fam.config_cls(**values)


def _required(cls, name: str) -> bool:
    f = next(f for f in fields(cls) if f.name == name)
    return f.default is MISSING and f.default_factory is MISSING


def _asdict(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)}


def with_overrides(cfg, **overrides):
    """`cfg` with some fields replaced; unknown keys raise a ValueError listing the valid ones."""
    valid = [f.name for f in fields(cfg)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown {family_of(cfg)} config key(s) {unknown}; valid keys: {valid}")
    return replace(cfg, **overrides)


def model_specs(cfg) -> list:
    """The spec list of a config of any family."""
    return FAMILIES[family_of(cfg)].specs(cfg)


def model_loss(cfg) -> LayerSpec:
    """The loss spec of a config of any family (vocab-parallel cross-entropy)."""
    return FAMILIES[family_of(cfg)].loss(cfg)


def count_params(cfg, *, embedding_lookups: bool = True, padded: bool = True, active: bool = False) -> int:
    """Number of parameters of the whole model, tied ones counted once.

    With `embedding_lookups=False`, leaves out tables used only by lookup
    (GPT-2's position table, and the token table when it is not also the
    head): what FLOP estimates count. Computed in closed form from the
    config (the tests check it against the spec list built on `meta`).

    `padded=True` (the default) counts the token table and head with their
    padded rows (`padded_vocab(cfg)`), as built, stored and optimised, and as
    Megatron counts them; `padded=False` counts `vocab_size` rows: the size of
    the unpadded model (what Hugging Face's `num_parameters()` and the papers
    report, e.g. 124,439,808 for GPT-2 small, whose padded count is 36,096 more).

    `active=True` counts, for an MoE model, only the experts a token uses (top_k
    routed ones, and the shared ones): what its FLOPs per token see."""
    D, L = cfg.dim, cfg.n_layers
    V = cfg.padded_vocab if padded else cfg.vocab_size
    head = 0 if cfg.tie_embeddings else V * D
    if isinstance(cfg, gpt2.GPT2Config):
        mlp = 8 * D * D + 4 * D + D
        if cfg.n_experts is not None:  # GPT-2-MoE: routed (all, or the top_k a token uses), shared, router
            shared = cfg.n_shared_experts * (8 * D * D + 4 * D) + D if cfg.n_shared_experts else 0
            mlp = (cfg.top_k if active else cfg.n_experts) * mlp + shared + cfg.n_experts * D
        block = (4 * D * D + 4 * D) + mlp + 2 * 2 * D  # attn, mlp, two LayerNorms
        lookups = cfg.max_seq_len * D + (V * D if not cfg.tie_embeddings else 0)
        total = V * D + cfg.max_seq_len * D + L * block + 2 * D + head
    elif isinstance(cfg, (llama.LlamaConfig, mixtral.MixtralConfig)):
        hd = D // cfg.n_heads
        attn = 2 * D * cfg.n_heads * hd + 2 * D * cfg.n_kv_heads * hd
        if isinstance(cfg, mixtral.MixtralConfig):
            routed = (cfg.top_k if active else cfg.n_experts) * 3 * D * cfg.hidden
            ffn = routed + cfg.n_experts * D + cfg.n_shared_experts * 3 * D * cfg.hidden  # + router, shared
        else:
            ffn = 3 * D * cfg.hidden
        block = attn + ffn + 2 * D
        lookups = V * D if not cfg.tie_embeddings else 0
        total = V * D + L * block + D + head
    else:
        raise ValueError(f"count_params: {type(cfg).__name__} is not a model config; "
                         f"valid families: {sorted(FAMILIES)}")
    return total if embedding_lookups else total - lookups


def flops_per_token(cfg, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), for MFU.

    6 * N (N: parameters that take part in matmuls: no lookup-only tables;
    the head with its padded rows, which the matmul computes, as Megatron
    counts it) plus the attention scores and weighted sum,
    12 * n_layers * dim * seq_len (PaLM, Chowdhery et al. 2022, appendix B; counted without the causal
    half-saving, as MFU reports conventionally do). Ignores norms,
    activations and softmax."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    attn_dim = cfg.n_heads * (cfg.dim // cfg.n_heads)
    return 6 * count_params(cfg, embedding_lookups=False, active=True) + 12 * cfg.n_layers * attn_dim * seq_len
