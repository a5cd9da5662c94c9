"""The model zoo as LayerSpec lists. For now: a tiny built-in language model
(`toy_lm`) for demos and the engine's parity tests; GPT-2, Llama and
Mixtral-style MoE join with their own issues."""

from .toy import ToyConfig, synthetic_batches, toy_lm

__all__ = ["ToyConfig", "toy_lm", "synthetic_batches"]
