"""A run's checkpoints: where they live, which one a run continues from, saving one.

`checkpoint_root(cfg)` is `checkpoint.dir`, else `{logging.out_dir}/checkpoints`.
A fresh run refuses to start over another run's checkpoints unless
`logging.overwrite` (then they are deleted: `clear_old_checkpoints`). A run
continues from `train.resume` (a path, or "auto": the newest complete one; also
"auto" after a torchrun restart), and only if the checkpoint was saved from the
same model (`check_same_model`, which the launcher's pre-flight checks call too).
The layout-free files themselves are `pipekit.checkpoint`'s.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from typing import Any

import torch.distributed as dist

from .checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_meta,
    save_checkpoint,
    step_dir,
)
from .config import Config, Run
from .engine import PipelineEngine
from .topology import Topology


def checkpoint_root(cfg: Config) -> str | None:
    """Where this run's checkpoints go: checkpoint.dir, else {logging.out_dir}/checkpoints, else nowhere."""
    if cfg.checkpoint.dir:
        return cfg.checkpoint.dir
    return os.path.join(cfg.logging.out_dir, "checkpoints") if cfg.logging.out_dir else None


def clear_old_checkpoints(cfg: Config, topo: Topology) -> None:
    """A fresh run must not leave another run's checkpoints where `train.resume=auto` would
    find them: with logging.overwrite they are deleted, otherwise the run refuses to start."""
    root = checkpoint_root(cfg)
    old = list_checkpoints(root) if root else []
    if not old:
        return
    if not cfg.logging.overwrite:
        raise CheckpointError(f"{root} holds checkpoints of another run (up to step {old[-1][0]}); continue it with "
                              f"train.resume=auto, or pass logging.overwrite=true to start afresh and delete them")
    if dist.is_initialized():
        dist.barrier()  # every rank has looked before rank 0 deletes
    if topo.rank == 0:
        for _, path in old:
            shutil.rmtree(path, ignore_errors=True)


def resume_path(cfg: Config) -> str | None:
    """The checkpoint this run continues from: `train.resume` (a path, or "auto": the newest
    complete one under checkpoint_root, or none), also "auto" after a torchrun restart."""
    wanted = cfg.train.resume
    if wanted is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        wanted = "auto"  # a restarted worker continues from where the group got to
    if wanted is None:
        return None
    if wanted == "auto":
        root = checkpoint_root(cfg)
        return latest_checkpoint(root) if root else None
    return wanted


def resume(run: Run, topo: Topology, engine: PipelineEngine) -> int:
    """Load the checkpoint to resume from, if any, into `engine` (weights, optimizer state,
    LR schedule, loss scale, RNG); returns the number of steps already done."""
    cfg = run.config
    path = resume_path(cfg)
    if path is None:
        return 0
    check_same_model(read_meta(path), run, path)
    meta = load_checkpoint(path, engine.module, engine.optimizer)
    if engine.lr_scheduler is not None and meta.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
        assert engine.optimizer is not None  # an LR scheduler is built on the engine's optimizer
        for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and meta.get("loss_scaler"):
        scaler.load_state_dict(meta["loss_scaler"])
    step = int(meta["step"])
    if step > cfg.train.steps:  # (== is a finished run: train() only rewrites model.pt)
        raise CheckpointError(f"checkpoint {path} is at step {step}, past train.steps={cfg.train.steps}; "
                              f"raise train.steps to train on")
    if topo.rank == 0:
        print(f"resuming from {path} (step {step})", flush=True)
    return step


def check_same_model(meta: dict, run: Run, path: str) -> None:
    """A checkpoint continues only the model (and data) it was saved from."""
    mine: dict[str, Any] = {"family": run.family, "config": _model_record(run)}
    theirs: dict[str, Any] = {"family": meta.get("family"), "config": meta.get("model_config")}
    if theirs != mine:
        saved = theirs["config"] or {}
        diff = sorted(k for k in set(mine["config"]) | set(saved) if saved.get(k) != mine["config"].get(k))
        shown = ", ".join(f"{k}={saved.get(k)} (this config: {mine['config'].get(k)})" for k in diff[:3])
        raise CheckpointError(f"checkpoint {path} was saved from another model ({theirs['family']}: "
                              f"{shown or 'family'}); resume it with the config it was saved with")


def _model_record(run: Run) -> dict:
    """The model config as a checkpoint stores it (JSON types)."""
    return json.loads(json.dumps(asdict(run.model)))


def save(run: Run, topo: Topology, engine: PipelineEngine, root: str, step: int) -> str:
    """Save a resumable, layout-free checkpoint of step `step` under `root` (collective)."""
    cfg = run.config
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    meta = {"step": step, "family": run.family, "model_config": _model_record(run),
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "loss_scaler": scaler.state_dict() if scaler is not None else None,
            "data": {"source": cfg.data.source, "seed": cfg.train.seed, "global_batch": cfg.train.global_batch,
                     "seq_len": cfg.train.seq_len, "next_step": step},
            "config": json.loads(json.dumps(asdict(cfg)))}
    return save_checkpoint(step_dir(root, step), engine.module, engine.optimizer, meta=meta, keep=cfg.checkpoint.keep)
