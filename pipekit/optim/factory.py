"""The optimizer `pipekit train` builds from its config: AdamW (or SGD) under ZeRO, and its LR schedule.

`make_optimizer(module, optimizer_cfg, precision)` groups the module's parameters
(matrices decay, vectors do not, as in nanoGPT and Megatron; expert weights in
groups of their own, reduced over their expert-data-parallel group) and wraps
them in a `ZeroOptimizer` at `optimizer.zero_stage`, with the precision
policy's master and reduce dtypes and, for fp16, its loss scaler; `optimizer.fused` picks fused
AdamW (pipekit.kernels.adamw; "auto": on for CUDA float32 master weights).
`lr_lambda(optimizer_cfg, steps)` is the multiplier `LambdaLR` applies: pipekit's warmup and
cosine, or with `optimizer.scheduler` a DeepSpeed scheduler's lr at each step (lr.py);
`lr_schedule` the scheduler `pipekit train` steps (OneCycle with cycle_momentum: Adam's betas too).
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch

from ..precision import Precision
from .lr import CycledBetas, parse_scheduler
from .scaler import LossScaler
from .zero import ZeroOptimizer

# optimizer.fused, lower-cased (a YAML or command-line true reaches the str field as "True")
FUSED: dict[str, bool | str] = {"auto": "auto", "true": True, "false": False}


def lr_lambda(o, steps: int):
    """Multiplier of the peak lr at each step (0-based): linear warmup, then cosine to min_lr
    (or constant); with `o.scheduler` (a DeepSpeed block) its lr at the step / o.lr, whatever
    `steps` is (DeepSpeed's total_num_steps is the block's own).
    `o`: the config's optimizer section (`pipekit.config.OptimizerConfig`); `steps`: train.steps."""
    if o.scheduler is not None:
        schedule = parse_scheduler(o.scheduler)
        return lambda step: schedule.lr(o.lr, step) / o.lr
    floor = o.min_lr / o.lr if o.lr else 0.0

    def at(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.decay == "constant":
            return 1.0
        progress = min(1.0, (step - o.warmup_steps) / max(1, steps - o.warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return at


def lr_schedule(optimizer: torch.optim.Optimizer, o, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR scheduler over `optimizer` that the engine steps after each step it applies:
    `LambdaLR` over `lr_lambda(o, steps)`; for a DeepSpeed OneCycle cycling momentum with
    AdamW, one that also sets Adam's betas (with SGD DeepSpeed moves nothing either)."""
    multiplier = lr_lambda(o, steps)
    if o.scheduler is not None and o.name == "adamw":
        schedule = parse_scheduler(o.scheduler)
        if schedule.moves_betas:
            return CycledBetas(optimizer, multiplier, schedule.betas)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def param_groups(module, weight_decay: float) -> list[dict]:
    """The module's trainable parameters in four groups: dense and expert-parallel, each as
    matrices (decayed) and vectors (biases, norms: not decayed). Expert groups carry their
    own dp group (reduced over it) and ep group (summed over it in the gradient norm)."""
    params = [p for p in module.parameters() if p.requires_grad]
    topo = module.topology
    groups = []
    for experts in (False, True):
        mine = [p for p in params if bool(getattr(p, "expert_parallel", False)) == experts]
        extra = {"dp_group": topo.edp_group, "ep_group": topo.ep_group} if experts else {}
        groups += [{"params": [p for p in mine if p.dim() >= 2], "weight_decay": weight_decay, **extra},
                   {"params": [p for p in mine if p.dim() < 2], "weight_decay": 0.0, **extra}]
    return groups


def make_optimizer(module, o, precision: Precision) -> ZeroOptimizer:
    """AdamW (or SGD) under ZeRO stage `o.zero_stage` over `module` (a PipelineModule),
    stepping `precision.master_dtype` master weights from `precision.reduce_dtype`
    gradients, with a loss scaler for fp16. `o`: the config's optimizer section
    (`pipekit.config.OptimizerConfig`; read by attribute, so this module needs no config)."""
    scaling = precision.loss_scaling
    hyper = {"betas": (o.beta1, o.beta2), "eps": o.eps} if o.name == "adamw" else {"momentum": o.momentum}
    return ZeroOptimizer(param_groups(module, o.weight_decay), o.name, module=module, stage=o.zero_stage,
                         bucket_mb=o.bucket_mb, master_dtype=precision.master_dtype,
                         grad_dtype=precision.reduce_dtype, fused=FUSED[str(o.fused).lower()], lr=o.lr, **hyper,
                         reshard_after_forward=o.reshard_after_forward,
                         offload=o.offload, offload_dir=o.offload_dir, pin_memory=o.pin_memory,
                         offload_params=o.offload_params, offload_overlap=o.offload_overlap,
                         loss_scaler=LossScaler(**asdict(scaling)) if scaling is not None else None)
