"""DeepSpeed's LR schedulers with DeepSpeed's meaning at every step: a ds_config `scheduler` block.

`parse_scheduler(block)` checks a block `{type: ..., params: {...}}` (the config's
`optimizer.scheduler`; `check_scheduler` raises the same one-line ValueError) and fills in
DeepSpeed's defaults; the `LRSchedule` it returns answers the lr, and for OneCycle Adam's
betas, at pipekit's optimizer step k (0-based; a skipped step does not count, as DeepSpeed's
engine does not step its scheduler after an fp16 overflow).

Step convention, DeepSpeed's: the scheduler's constructor sets the lr of the first step (at
its iteration -1), and the engine calls `scheduler.step()` after each optimizer step, so
step k >= 1 runs on the formula at iteration it = k - 1:

    type            step 0           step k >= 1 (it = k - 1; n = max(2, warmup_num_steps))
    WarmupLR        warmup_min_lr    min + (max - min) * g(it), g = ln(it+1)/ln(n) (log) or
                                     it/n (linear) while it < n, then 1; max null: optimizer lr
    WarmupDecayLR   warmup_min_lr    the same warmup (max: 0.001 unless given), then g =
                                     (total_num_steps - it) / (total_num_steps - n), down to 0
    WarmupCosineLR  0                optimizer lr * r(it): warmup_min_ratio up to 1 by g, then a
                                     cosine to cos_min_ratio at it = total_num_steps - 1, held
    OneCycle        cycle_min_lr     up to cycle_max_lr over cycle_first_step_size, down over
                                     cycle_second_step_size (optionally in stairs); j steps
                                     after the cycle, cycle_min_lr / (1 + decay_lr_rate * j /
                                     decay_step_size) (decay_step_size 0: cycle_min_lr)
    LRRangeTest     min_lr           min_lr * (1 + step_rate * (it + 1) / step_size) (staircase:
                                     the quotient floored)

OneCycle with cycle_momentum (DeepSpeed's default) moves Adam's beta1 the other way, from
cycle_max_mom down to cycle_min_mom and back, and sets beta2 to 0.99 (as DeepSpeed does,
whatever the optimizer's beta2); step 0 runs on (cycle_min_mom, 0.99). With SGD nothing
moves (DeepSpeed cycles only an optimizer with betas). `total_num_steps` keeps DeepSpeed's
meaning: it is not train.steps. Limits: one number per key (DeepSpeed's per-param-group
lists are refused: pipekit's param groups are its own, not the model's); an unknown
warmup_type is refused (DeepSpeed warns and takes log); no torch scheduler by name.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class _Value:
    """What a param may hold: `holds(value)`, said as `what`."""

    what: str
    holds: Callable[[Any], bool]

    def optional(self) -> _Value:
        return _Value(f"{self.what} (or null)", lambda v: v is None or self.holds(v))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


NUMBER = _Value("a finite number", _number)
AT_LEAST_0 = _Value("a finite number >= 0", lambda v: _number(v) and v >= 0)
ABOVE_0 = _Value("a finite number > 0", lambda v: _number(v) and v > 0)
STEPS = _Value("a whole number >= 1", lambda v: _whole(v) and v >= 1)
COUNT = _Value("a whole number >= 0", lambda v: _whole(v) and v >= 0)
FLAG = _Value("true or false", lambda v: isinstance(v, bool))
MOMENTUM = _Value("in [0, 1)", lambda v: _number(v) and 0 <= v < 1)
WARMUP_TYPE = _Value("log or linear", lambda v: v in ("log", "linear"))
START = _Value("-1 (pipekit's checkpoints carry the schedule's position; leave it out)", lambda v: v == -1)
REQUIRED = object()  # a param without a default (DeepSpeed's positional arguments)


@dataclass(frozen=True)
class _Kind:
    """One DeepSpeed scheduler: its params (default, what it may hold) and its lr at an iteration."""

    params: Mapping[str, tuple[Any, _Value]]
    lr: Callable[[Mapping[str, Any], float, int], float]  # (params, optimizer lr, DeepSpeed iteration)
    betas: Callable[[Mapping[str, Any], int], tuple[float, float] | None] = lambda p, it: None


# ---- the formulas, at DeepSpeed's iteration `it` (-1: what its constructor sets) ----
def _warmup_steps(p: Mapping[str, Any]) -> int:
    return max(2, p["warmup_num_steps"])  # DeepSpeed's floor: a warmup of 1 step is one of 2


def _warmup(p: Mapping[str, Any], it: int) -> float:
    """The warmup's fraction at iteration 0 <= it < n."""
    n = _warmup_steps(p)
    return 1.0 / math.log(n) * math.log(it + 1) if p["warmup_type"] == "log" else it / n


def _warmup_lr(p: Mapping[str, Any], base: float, it: int) -> float:
    low, high = p["warmup_min_lr"], base if p["warmup_max_lr"] is None else p["warmup_max_lr"]
    if it < 0:
        return low
    return low + (high - low) * (_warmup(p, it) if it < _warmup_steps(p) else 1.0)


def _warmup_decay_lr(p: Mapping[str, Any], base: float, it: int) -> float:
    low, high = p["warmup_min_lr"], base if p["warmup_max_lr"] is None else p["warmup_max_lr"]
    n, total = _warmup_steps(p), p["total_num_steps"]
    if it < 0:
        return low
    gamma = _warmup(p, it) if it < n else max(0.0, float(total - it) / float(max(1.0, total - n)))
    return low + (high - low) * gamma


def _warmup_cosine_lr(p: Mapping[str, Any], base: float, it: int) -> float:
    if it < 0:
        return 0.0  # DeepSpeed's constructor: no ratio yet
    n = _warmup_steps(p)
    if it < n:
        low = p["warmup_min_ratio"]
        return base * (low + _warmup(p, it) * (1.0 - low))
    progress = min(1.0, (it - n + 1) / max(1, p["total_num_steps"] - n))
    floor = p["cos_min_ratio"]
    return base * max(0.0, floor + (1.0 - floor) * ((1 + math.cos(math.pi * progress)) / 2))


def _cycle(p: Mapping[str, Any]) -> tuple[float, float, float]:
    """OneCycle's (first half, second half, whole cycle) in steps, as floats (DeepSpeed's)."""
    first = float(p["cycle_first_step_size"])
    second = first if p["cycle_second_step_size"] is None else float(p["cycle_second_step_size"])
    return first, second, first + second


def _cycle_fraction(p: Mapping[str, Any], it: int) -> float:
    """How far up the cycle iteration `it` is (0: its bottom, 1: its top)."""
    first, second, total = _cycle(p)
    batch = it + 1
    x = 1.0 + batch / total - math.floor(1 + batch / total)
    up = first / total
    if x <= up:
        fraction, stairs = x / up, p["cycle_first_stair_count"]
    else:
        stairs = p["cycle_first_stair_count"] if p["cycle_second_stair_count"] is None \
            else p["cycle_second_stair_count"]
        fraction = (x - 1) / (up - 1)
    if stairs > 0:  # held flat over each stair, counted from the integer position in the cycle
        at = batch % total
        position = at * stairs / first if at <= first else (total - at) * stairs / second
        fraction = math.floor(position) / stairs
    return fraction


def _one_cycle_lr(p: Mapping[str, Any], base: float, it: int) -> float:
    low, high = p["cycle_min_lr"], p["cycle_max_lr"]
    total = _cycle(p)[2]
    if it < 0:
        return low
    if it < total:
        return low + (high - low) * _cycle_fraction(p, it)
    if p["decay_step_size"] == 0 or p["decay_lr_rate"] == 0:
        return low
    return low / (1 + p["decay_lr_rate"] * ((it - total + 1) / p["decay_step_size"]))


def _one_cycle_betas(p: Mapping[str, Any], it: int) -> tuple[float, float] | None:
    if not p["cycle_momentum"]:
        return None
    low, high = p["cycle_min_mom"], p["cycle_max_mom"]
    total = _cycle(p)[2]
    if it < 0:
        return low, 0.99  # DeepSpeed's constructor sets the bottom, not the cycle's start
    if it < total:
        return high - (high - low) * _cycle_fraction(p, it), 0.99
    if p["decay_step_size"] == 0 or p["decay_mom_rate"] == 0:
        return high, 0.99
    return high * (1 + p["decay_mom_rate"] * ((it - total + 1) / p["decay_step_size"])), 0.99


def _range_test_lr(p: Mapping[str, Any], base: float, it: int) -> float:
    steps = float(it + 1) / p["lr_range_test_step_size"]
    return p["lr_range_test_min_lr"] * (1 + p["lr_range_test_step_rate"] *
                                        (math.floor(steps) if p["lr_range_test_staircase"] else steps))


_WARMUP = {"warmup_min_lr": (0.0, AT_LEAST_0), "warmup_max_lr": (None, AT_LEAST_0.optional()),
           "warmup_num_steps": (1000, STEPS), "warmup_type": ("log", WARMUP_TYPE), "last_batch_iteration": (-1, START)}
KINDS: dict[str, _Kind] = {
    "WarmupLR": _Kind(_WARMUP, _warmup_lr),
    "WarmupDecayLR": _Kind({"total_num_steps": (REQUIRED, STEPS), **_WARMUP,
                            "warmup_max_lr": (0.001, AT_LEAST_0.optional())}, _warmup_decay_lr),
    "WarmupCosineLR": _Kind({"total_num_steps": (REQUIRED, STEPS), "warmup_min_ratio": (0.0, AT_LEAST_0),
                             "warmup_num_steps": (1000, STEPS), "cos_min_ratio": (0.0001, AT_LEAST_0),
                             "warmup_type": ("log", WARMUP_TYPE), "last_batch_iteration": (-1, START)},
                            _warmup_cosine_lr),
    "OneCycle": _Kind({"cycle_min_lr": (REQUIRED, AT_LEAST_0), "cycle_max_lr": (REQUIRED, AT_LEAST_0),
                       "decay_lr_rate": (0.0, NUMBER), "cycle_first_step_size": (2000, ABOVE_0),
                       "cycle_second_step_size": (None, AT_LEAST_0.optional()),
                       "cycle_first_stair_count": (0, COUNT), "cycle_second_stair_count": (None, COUNT.optional()),
                       "decay_step_size": (0, AT_LEAST_0), "cycle_momentum": (True, FLAG),
                       "cycle_min_mom": (0.8, MOMENTUM), "cycle_max_mom": (0.9, MOMENTUM),
                       "decay_mom_rate": (0.0, NUMBER), "last_batch_iteration": (-1, START)},
                      _one_cycle_lr, _one_cycle_betas),
    "LRRangeTest": _Kind({"lr_range_test_min_lr": (0.001, AT_LEAST_0), "lr_range_test_step_size": (2000, STEPS),
                          "lr_range_test_step_rate": (1.0, NUMBER), "lr_range_test_staircase": (False, FLAG),
                          "last_batch_iteration": (-1, START)}, _range_test_lr),
}


@dataclass(frozen=True)
class LRSchedule:
    """A checked DeepSpeed scheduler block with DeepSpeed's defaults filled in (`parse_scheduler`)."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)

    def lr(self, base_lr: float, step: int) -> float:
        """The lr of optimizer step `step` (0-based), `base_lr` being the optimizer's own."""
        return KINDS[self.kind].lr(self.params, base_lr, step - 1)

    def betas(self, step: int) -> tuple[float, float] | None:
        """Adam's betas at step `step` where the schedule sets them (OneCycle's cycle_momentum), else None."""
        return KINDS[self.kind].betas(self.params, step - 1)

    @property
    def moves_betas(self) -> bool:
        return self.betas(0) is not None


def _near(word: str, names: list[str]) -> str:
    near = difflib.get_close_matches(word, names, n=1)
    return f"did you mean {near[0]}? " if near else ""


def parse_scheduler(block: Any, where: str = "optimizer.scheduler") -> LRSchedule:
    """`block` (a DeepSpeed scheduler block) checked, with defaults; ValueError in one line
    naming the key as `where` (the config's key, or "ds_config scheduler") and what would do."""
    if not isinstance(block, Mapping):
        raise ValueError(f"{where}={block!r} must be a DeepSpeed scheduler block {{type: ..., params: {{...}}}}")
    for key in block:
        if key not in ("type", "params"):
            raise ValueError(f"{where}.{key} is not a key of a scheduler block; {_near(str(key), ['type', 'params'])}"
                             f"it holds type and params")
    kind = block.get("type")
    if kind not in KINDS:
        import torch.optim.lr_scheduler as torch_schedulers  # a torch class DeepSpeed would also take by name

        torch_own = isinstance(kind, str) and hasattr(torch_schedulers, kind) and kind[:1].isupper()
        also = " (DeepSpeed would take torch's own by name; pipekit does not)" if torch_own else ""
        raise ValueError(f"{where}.type={kind!r} is not a DeepSpeed scheduler pipekit runs{also}; "
                         f"{_near(str(kind), list(KINDS))}give one of {list(KINDS)}")
    given = block.get("params") or {}
    if not isinstance(given, Mapping):
        raise ValueError(f"{where}.params={given!r} must be a mapping of {kind}'s params")
    spec = KINDS[kind].params
    for key, value in given.items():
        if key not in spec:
            raise ValueError(f"{where}.params.{key} is not a param of {kind}; {_near(str(key), list(spec))}"
                             f"its params: {', '.join(spec)}")
        if isinstance(value, (list, tuple)):
            raise ValueError(f"{where}.params.{key}={list(value)} gives one value per param group; pipekit's "
                             f"param groups are its own, so give one number")
        if not spec[key][1].holds(value):
            raise ValueError(f"{where}.params.{key}={value!r} must be {spec[key][1].what}")
    missing = [key for key, (default, _) in spec.items() if default is REQUIRED and key not in given]
    if missing:
        raise ValueError(f"{where}.params.{missing[0]} is needed by {kind} (DeepSpeed gives it no default)")
    return LRSchedule(kind, {key: given.get(key, default) for key, (default, _) in spec.items()})


def check_scheduler(block: Any, where: str = "optimizer.scheduler") -> None:
    """ValueError in one line where `block` is not a DeepSpeed scheduler block pipekit runs (None: none)."""
    if block is not None:
        parse_scheduler(block, where)


class CycledBetas(torch.optim.lr_scheduler.LambdaLR):
    """`LambdaLR` that also sets every param group's Adam betas to `betas_at(step)` before
    each step, from the first (DeepSpeed's OneCycle with cycle_momentum). Every hyperparameter of
    ZeroOptimizer's param groups reaches its inner optimizer at each step, betas too."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_lambda: Callable[[int], float],
                 betas_at: Callable[[int], tuple[float, float] | None]):
        self.betas_at = betas_at
        super().__init__(optimizer, lr_lambda)  # its first step() sets step 0's betas

    def step(self, epoch: int | None = None) -> None:
        if epoch is None:
            super().step()
        else:
            super().step(epoch)
        self.set_betas(self.last_epoch)

    def set_betas(self, step: int) -> None:
        """Each group's betas those of step `step` (also a resume's, at the checkpoint's step)."""
        betas = self.betas_at(step)
        if betas is not None:
            for group in self.optimizer.param_groups:
                group["betas"] = betas

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in super().state_dict().items() if k != "betas_at"}  # the function is the config's
