"""Loss scaling for fp16 training, with DeepSpeed's knobs and meanings.

fp16 gradients of small losses underflow; multiplying the loss by a large
scale S before backward keeps them representable, and the optimizer divides
the gradients by S again before clipping and the update. Dynamic scaling
(DeepSpeed's `loss_scale: 0`) starts at 2**initial_scale_power and follows
DeepSpeed's `DynamicLossScaler.update_scale` step for step: when any rank sees
an inf/NaN gradient the step is skipped everywhere; the first `hysteresis - 1`
overflows only use up the tolerance, every later one halves S (never below
min_loss_scale); S doubles on a clean step that follows a whole number (>= 1)
of `loss_scale_window` clean steps in a row, so the first doubling after an
overflow (or the start) is on the window + 1-th clean step, later ones every
window, and each restores the tolerance; with `consecutive_hysteresis` every
clean step restores it. Where DeepSpeed's ZeRO optimizer raises (an overflow
at min_loss_scale with no tolerance left) the step is skipped at min_loss_scale,
and the run's train.max_skipped_steps decides (DeepSpeed's stage-0 fp16
optimizer, which has no hysteresis, keeps going at the minimum too).
A static scaler (`loss_scale > 0`) never changes and never skips.
"""

from __future__ import annotations


class LossScaler:
    """Dynamic (`static_scale=None`) or static loss scale; `update(overflow)` after each step."""

    def __init__(self, static_scale: float | None = None, initial_scale_power: int = 16, scale_window: int = 1000,
                 hysteresis: int = 2, min_scale: float = 1.0, consecutive_hysteresis: bool = False):
        if static_scale is not None and static_scale <= 0:
            raise ValueError(f"a static loss scale must be > 0, got {static_scale}")
        for name, value in (("scale_window", scale_window), ("hysteresis", hysteresis)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.dynamic = static_scale is None
        self.scale = float(static_scale) if static_scale is not None else 2.0 ** initial_scale_power
        self.scale_window, self.hysteresis, self.min_scale = scale_window, hysteresis, min_scale
        self.consecutive_hysteresis = consecutive_hysteresis
        self.tolerance = hysteresis  # overflows still tolerated before the scale halves
        self.clean_steps = 0  # clean steps in a row, since the last overflow (or the start)
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.tolerance <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.tolerance -= 1
            return
        if self.consecutive_hysteresis:
            self.tolerance = self.hysteresis
        if self.clean_steps and self.clean_steps % self.scale_window == 0:  # DeepSpeed's stable interval
            self.scale *= 2
            self.tolerance = self.hysteresis
        self.clean_steps += 1

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "tolerance", "clean_steps", "skipped_steps")}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
