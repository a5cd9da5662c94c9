"""What ZeroOptimizer is given, checked: param groups, hyperparameters, the optimizer, fused.

The wrapped optimizer is built over pieces of the master shards, not over the
parameters, so the checks torch's optimizers make on their constructor's arguments
are made here, on every param group, with the same words. Nothing here communicates.
"""

from __future__ import annotations

import math

import torch
from torch import nn

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def optimizer_class(optimizer: str | type) -> type:
    """A torch optimizer class or factory for `optimizer` (a name in `OPTIMIZERS`, or itself)."""
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is not one of {list(OPTIMIZERS)} (or pass a class)")
        return OPTIMIZERS[optimizer]
    return optimizer


def param_groups(params) -> list[dict]:
    """Param groups (at least one, possibly empty: a stage may have no parameters)."""
    if isinstance(params, nn.Module):
        return [{"params": [p for p in params.parameters() if p.requires_grad]}]
    params = list(params)
    if params and isinstance(params[0], dict):
        return [{**g, "params": list(g["params"])} for g in params]
    return [{"params": params}]


def check_hyper(group: dict, index: int) -> None:
    """The checks torch's optimizers make on their constructor's arguments, made on every
    param group (the wrapped optimizer is built over pieces, with the groups' values)."""
    where = f" (param group {index})" if index else ""
    lr = group.get("lr")
    if lr is not None and not (isinstance(lr, (int, float, torch.Tensor)) and 0 <= float(lr) < math.inf):
        raise ValueError(f"lr={lr!r}{where} must be a finite number >= 0")
    for key in ("eps", "weight_decay", "momentum"):
        value = group.get(key)
        if value is not None and not (isinstance(value, (int, float)) and 0 <= value < math.inf):
            raise ValueError(f"{key}={value!r}{where} must be a finite number >= 0")
    betas = group.get("betas")
    if betas is not None and not all(0 <= float(b) < 1 for b in betas):
        raise ValueError(f"betas={tuple(betas)!r}{where} must each be in [0, 1)")


def choose_fused(fused: bool | str, optimizer: type, master_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether FusedAdamW steps the master shards (`fused`: True, False or "auto"; `device`:
    the parameters', the same answer on every rank, one without parameters too: the step's
    collectives differ)."""
    if fused not in (True, False, "auto"):
        raise ValueError(f"fused={fused!r} is not one of [True, False, 'auto']")
    adamw = optimizer is torch.optim.AdamW
    if fused is True and not adamw:
        raise ValueError(f"fused=True steps AdamW only, got optimizer={optimizer!r}; use "
                         "optimizer='adamw', or fused=False")
    if fused == "auto":
        return fused_by_default(optimizer, master_dtype, device.type)
    return bool(fused)


def fused_by_default(optimizer_class: type, master_dtype: torch.dtype, device_type: str) -> bool:
    """`fused="auto"`'s answer: FusedAdamW for AdamW over float32 master shards on CUDA (elsewhere
    its reference side would run, no faster than torch's AdamW)."""
    return optimizer_class is torch.optim.AdamW and master_dtype == torch.float32 and device_type == "cuda"
