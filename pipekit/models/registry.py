"""The model families by name: configs from flavours, spec lists, losses, sizes and FLOPs.

    cfg = get_model("llama", "tiny", n_layers=2)     # a LlamaConfig
    specs, loss = model_specs(cfg), model_loss(cfg)  # for PipelineModule(specs, loss_fn=loss, ...)
    count_params(cfg), flops_per_token(cfg, seq_len), model_vocab(cfg)

Every family, the engine's toy model included, is one `Family` entry in
`FAMILIES`; the rest of pipekit (config, train, generate) asks the registry
and never branches on a family. A family whose config names a common key
differently says so in its `aliases` (the toy's `vocab` is `vocab_size`): the
registry translates them here, in one place, so `get_model("toy", vocab_size=64)`
and `pipekit train ... model.vocab_size=64` work like any other family's.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Callable

from . import common, gpt2, llama, mixtral, toy


@dataclass(frozen=True)
class Family:
    """One model family: its typed config and named sizes, and what pipekit asks of a model."""

    config_cls: type
    flavours: dict[str, Any]  # named sizes; always a `tiny` one
    specs: Callable[[Any], list]  # config -> the spec list
    loss: Callable[[Any], Any]  # config -> PipelineModule's loss_fn (a LayerSpec or a plain function)
    params: Callable[..., tuple[int, int]]  # (config, *, padded, active) -> (parameters, those in lookup-only tables)
    attention_flops: Callable[[Any, int], int]  # (config, seq_len) -> attention FLOPs per token, not in 6 * N
    aliases: dict[str, str] = field(default_factory=dict)  # a common key (vocab_size, n_layers) -> the config's field


FAMILIES: dict[str, Family] = {
    "gpt2": Family(gpt2.GPT2Config, gpt2.FLAVOURS, gpt2.gpt2_specs, gpt2.gpt2_loss, gpt2.gpt2_params,
                   common.attention_flops),
    "llama": Family(llama.LlamaConfig, llama.FLAVOURS, llama.llama_specs, llama.llama_loss, llama.llama_params,
                    common.attention_flops),
    "mixtral": Family(mixtral.MixtralConfig, mixtral.FLAVOURS, mixtral.mixtral_specs, mixtral.mixtral_loss,
                      mixtral.mixtral_params, common.attention_flops),
    "toy": Family(toy.ToyConfig, toy.FLAVOURS, toy.toy_lm, toy.toy_loss, toy.toy_params,
                  lambda cfg, seq_len: 0,  # no attention: tokens do not mix
                  aliases={"vocab_size": "vocab", "n_layers": "blocks"}),
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


def model_keys(family: str) -> list[str]:
    """The keys `family`'s config takes, its fields under their common names where it has
    aliases (the toy's: vocab_size, dim, wide_dim, n_layers, mlp_ratio)."""
    fam = _family(family)
    common_name = {f: key for key, f in fam.aliases.items()}
    return [common_name.get(f.name, f.name) for f in fields(fam.config_cls)]


def _resolve(family: str, values: dict) -> dict:
    """`values` with the family's common key names turned into its field names; a key
    given under both names, or one the family does not take, raises a ValueError."""
    fam = _family(family)
    out = {fam.aliases.get(k, k): v for k, v in values.items()}
    twice = sorted(k for k, f in fam.aliases.items() if k in values and f in values)
    if twice:
        raise ValueError(f"{family} config key {twice[0]!r} is given twice, also as {fam.aliases[twice[0]]!r}")
    valid = [f.name for f in fields(fam.config_cls)]
    unknown = sorted(set(out) - set(valid))
    if unknown:
        also = f" (or {', '.join(f'{k} for {f}' for k, f in fam.aliases.items())})" if fam.aliases else ""
        raise ValueError(f"unknown {family} config key(s) {unknown}; valid keys: {valid}{also}")
    return out


def get_model(family: str, flavour: str = "tiny", **overrides) -> Any:
    """The config of `family`'s `flavour` with `overrides` applied (validated again).

    Unknown families, flavours or override keys raise a ValueError listing the valid ones."""
    fam = _family(family)
    if flavour not in fam.flavours:
        raise ValueError(f"unknown {family} flavour {flavour!r}; valid flavours: {list(fam.flavours)}")
    return config_from_dict(family, {**_asdict(fam.flavours[flavour]), **_resolve(family, overrides)})


def config_from_dict(family: str, values: dict) -> Any:
    """Build `family`'s config from a dict of its fields (e.g. one read back from a file)."""
    fam = _family(family)
    values = _resolve(family, values)
    missing = [f.name for f in fields(fam.config_cls) if f.name not in values and _required(f)]
    if missing:
        raise ValueError(f"{family} config lacks {missing}")
    return fam.config_cls(**values)


def _required(f) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _asdict(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)}


def with_overrides(cfg, **overrides):
    """`cfg` with some fields replaced; unknown keys raise a ValueError listing the valid ones."""
    return replace(cfg, **_resolve(family_of(cfg), overrides))


def model_specs(cfg) -> list:
    """The spec list of a config of any family."""
    return FAMILIES[family_of(cfg)].specs(cfg)


def model_loss(cfg):
    """The loss of a config of any family: the zoo's vocab-parallel cross-entropy spec, or the
    toy's plain function."""
    return FAMILIES[family_of(cfg)].loss(cfg)


def model_vocab(cfg) -> int:
    """The vocabulary size (unpadded) of a config of any family."""
    return getattr(cfg, FAMILIES[family_of(cfg)].aliases.get("vocab_size", "vocab_size"))


def count_params(cfg, *, embedding_lookups: bool = True, padded: bool = True, active: bool = False) -> int:
    """Number of parameters of the whole model, tied ones counted once.

    With `embedding_lookups=False`, leaves out tables used only by lookup
    (GPT-2's position table, and the token table when it is not also the
    head): what FLOP estimates count. Computed in closed form from the
    config by the family's `params` (the tests check it against the spec list
    built on `meta`).

    `padded=True` (the default) counts the token table and head with their
    padded rows (`padded_vocab(cfg)`), as built, stored and optimised, and as
    Megatron counts them; `padded=False` counts `vocab_size` rows: the size of
    the unpadded model (what Hugging Face's `num_parameters()` and the papers
    report, e.g. 124,439,808 for GPT-2 small, whose padded count is 36,096 more).

    `active=True` counts, for an MoE model, only the experts a token uses (top_k
    routed ones, and the shared ones): what its FLOPs per token see."""
    total, lookups = FAMILIES[family_of(cfg)].params(cfg, padded=padded, active=active)
    return total if embedding_lookups else total - lookups


def flops_per_token(cfg, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), for MFU.

    6 * N (N: parameters that take part in matmuls: no lookup-only tables;
    the head with its padded rows, which the matmul computes, as Megatron
    counts it) plus the family's attention FLOPs (`common.attention_flops`:
    the scores and weighted sum, 12 * n_layers * dim * seq_len; none for the
    toy model). Ignores norms, activations and softmax."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    fam = FAMILIES[family_of(cfg)]
    return 6 * count_params(cfg, embedding_lookups=False, active=True) + fam.attention_flops(cfg, seq_len)
