"""The model zoo as LayerSpec lists: GPT-2 and Llama (with Hugging Face
conversion in `pipekit.models.hf`), and a tiny built-in language model
(`toy_lm`) for demos and the engine's parity tests, and Mixtral-style MoE
models (Llama blocks with `pipekit.moe` feed-forward layers)."""

from .gpt2 import GPT2Config, gpt2_loss, gpt2_specs, padded_vocab
from .llama import LlamaConfig, llama_loss, llama_specs
from .mixtral import MixtralConfig, mixtral_loss, mixtral_specs
from .registry import (
    FAMILIES,
    config_from_dict,
    count_params,
    family_of,
    flops_per_token,
    get_model,
    model_loss,
    model_specs,
    with_overrides,
)
from .toy import ToyConfig, synthetic_batches, toy_lm

__all__ = [
    "ToyConfig",
    "toy_lm",
    "synthetic_batches",
    "GPT2Config",
    "gpt2_specs",
    "gpt2_loss",
    "padded_vocab",
    "LlamaConfig",
    "llama_specs",
    "llama_loss",
    "MixtralConfig",
    "mixtral_specs",
    "mixtral_loss",
    "FAMILIES",
    "get_model",
    "config_from_dict",
    "with_overrides",
    "family_of",
    "model_specs",
    "model_loss",
    "count_params",
    "flops_per_token",
]
