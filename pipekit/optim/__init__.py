"""Optimizers: ZeRO stages 0-3 with fp32 master weights, and fp16 loss scaling.

`ZeroOptimizer` (zero.py) is the one gradient path, a façade over its parts:
`Stage` (stage.py: what each stage shards), the flat buckets (buckets.py), the
gradient hooks and reductions overlapped with backward (reducer.py), the step's
norm, clipping, update and all-gather (step.py), layout-free optimizer state
(state.py), gloo-aware collectives (collectives.py), param-group checks
(hyper.py), stage 3's layers sharded by FSDP2 (fsdp.py), and the world-wide check that
skips a step with a non-finite loss, input or gradient (finite.py). `LossScaler`
(scaler.py) scales fp16 losses; factory.py builds the optimizer a config names.
"""

from .finite import Marks, Skip
from .scaler import LossScaler
from .zero import OPTIMIZERS, ZeroOptimizer

__all__ = ["LossScaler", "Marks", "OPTIMIZERS", "Skip", "ZeroOptimizer"]
