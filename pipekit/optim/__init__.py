"""Optimizers: ZeRO stages 0-2 with fp32 master weights, and fp16 loss scaling."""

from .scaler import LossScaler
from .zero import OPTIMIZERS, ZeroOptimizer

__all__ = ["LossScaler", "OPTIMIZERS", "ZeroOptimizer"]
