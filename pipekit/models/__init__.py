"""The model zoo as LayerSpec lists, one registry entry per family (`FAMILIES`):
GPT-2, Llama, Mixtral-style MoE models (Llama blocks with `pipekit.moe`
feed-forward layers), and a tiny built-in language model (`toy`, `toy_lm`) for
demos and the engine's parity tests. The parts the families share live in
`pipekit.models.common`; the Hugging Face name and layout mapping, one adapter per
family, in `pipekit.models.hf` (files are read and written by `pipekit.interchange`)."""

from .common import MoEConfig, VocabParallelHead, moe_mlp, padded_vocab
from .gpt2 import GPT2Config, gpt2_loss, gpt2_specs
from .llama import LlamaConfig, llama_loss, llama_specs
from .mixtral import MixtralConfig, mixtral_loss, mixtral_specs
from .registry import (
    FAMILIES,
    Family,
    config_from_dict,
    count_params,
    family_of,
    flops_per_token,
    get_model,
    model_keys,
    model_loss,
    model_specs,
    model_vocab,
    with_overrides,
)
from .toy import ToyConfig, lm_loss, synthetic_batches, toy_lm

__all__ = [
    "ToyConfig",
    "toy_lm",
    "lm_loss",
    "synthetic_batches",
    "GPT2Config",
    "gpt2_specs",
    "gpt2_loss",
    "padded_vocab",
    "VocabParallelHead",
    "MoEConfig",
    "moe_mlp",
    "LlamaConfig",
    "llama_specs",
    "llama_loss",
    "MixtralConfig",
    "mixtral_specs",
    "mixtral_loss",
    "FAMILIES",
    "Family",
    "get_model",
    "config_from_dict",
    "with_overrides",
    "family_of",
    "model_keys",
    "model_specs",
    "model_loss",
    "model_vocab",
    "count_params",
    "flops_per_token",
]
