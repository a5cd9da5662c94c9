"""The precision policy of a run: which dtype holds what, and the fp16 loss scaling.

One `Precision` is made from the config (`train.precision`, `train.dtype` and
the `fp16` keys) when a run is resolved, and every part that needs a dtype
reads it there, instead of interpreting the string `"bf16"` itself:

    name      param_dtype          reduce_dtype   master_dtype   loss scaling
    fp32      train.dtype          train.dtype    train.dtype    none
    bf16      bfloat16             float32        float32        none
    fp16      float16              float32        float32        LossScaling

`param_dtype` is what the layers' weights, their activations and the p2p
messages are in; `reduce_dtype` what gradients are accumulated and reduced in;
`master_dtype` what the optimizer steps (master weights and its state). The
float64 parity suites run fp32 with train.dtype=float64: every column is
float64. Limits: one policy per run (no per-layer exceptions); the loss
stays in float32 whatever the policy (the cross-entropy upcasts its logits).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

PRECISION_NAMES = ("fp32", "bf16", "fp16")
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
_FULL = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class LossScaling:
    """fp16 loss scaling, DeepSpeed's knobs: a static scale, or dynamic from 2**initial_scale_power.
    The fields are `pipekit.optim.LossScaler`'s arguments: `LossScaler(**asdict(scaling))`
    (one scaler per optimizer: it holds the running scale)."""

    static_scale: float | None = None  # None: dynamic
    initial_scale_power: int = 16
    scale_window: int = 1000  # clean steps before the scale doubles
    hysteresis: int = 2  # overflows tolerated before the scale halves
    min_scale: float = 1.0
    consecutive_hysteresis: bool = False  # a clean step restores the tolerance (else only a doubling does)


@dataclass(frozen=True)
class Precision:
    """Which dtype holds what in a run (see the module docstring's table)."""

    name: str  # fp32 | bf16 | fp16: what PipelineModule(precision=) and the logs call it
    param_dtype: torch.dtype  # weights, activations and p2p messages
    reduce_dtype: torch.dtype  # gradients, accumulated and reduced over dp
    master_dtype: torch.dtype  # master weights and optimizer state
    loss_scaling: LossScaling | None = None  # fp16 only

    @property
    def mixed(self) -> bool:
        """Low-precision weights with wider master weights (bf16, fp16)."""
        return self.name != "fp32"


def precision_policy(name: str = "fp32", dtype: str = "float32", fp16=None) -> Precision:
    """The policy of `train.precision=name` with `train.dtype=dtype`; `fp16` (an
    `Fp16Config`, used for name="fp16") gives the loss scaling, DeepSpeed's
    `loss_scale: 0` meaning dynamic. ValueError for a name or dtype not in the table."""
    if name not in PRECISION_NAMES:
        raise ValueError(f"precision={name!r} is not one of {list(PRECISION_NAMES)}")
    if dtype not in _FULL:
        raise ValueError(f"dtype={dtype!r} is not one of {list(_FULL)}")
    if name == "fp32":
        full = _FULL[dtype]
        return Precision(name, full, full, full)
    if dtype != "float32":
        raise ValueError(f"precision={name} keeps float32 master weights, so it needs dtype float32 (got {dtype})")
    scaling = _loss_scaling(fp16) if name == "fp16" else None
    return Precision(name, _HALF[name], torch.float32, torch.float32, scaling)


def _loss_scaling(fp16) -> LossScaling:
    if fp16 is None:
        return LossScaling()
    return LossScaling(static_scale=fp16.loss_scale or None, initial_scale_power=fp16.initial_scale_power,
                       scale_window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                       min_scale=fp16.min_loss_scale, consecutive_hysteresis=fp16.consecutive_hysteresis)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to `dtype` inside the block and restored after it, so a run
    (or a profile, or a loaded model) made in one process leaves the caller's default alone."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
