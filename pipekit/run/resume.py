"""A run's checkpoints: where they live, which one a run continues from, saving one.

`checkpoint_root(cfg)` is `checkpoint.dir`, else `{logging.out_dir}/checkpoints`.
A fresh run refuses to start over another run's checkpoints unless
`logging.overwrite` (then they are deleted: `clear_old_checkpoints`). A run
continues from `train.resume`: a path, or "auto" (the newest complete one). A
torchrun restart continues from the newest complete checkpoint of this run
(the path it started from only while it has saved none). Rank 0 chooses and
every rank loads that one. A resume from an older step of this run starts a new
branch: the later checkpoints are moved aside to `abandoned/`, so neither
"auto" nor a restart can mistake them for this branch's.

On resume the checkpoint's settings are compared with this config's
(`compare_settings`, which the launcher's pre-flight checks call too): a change
of the model or of a key in `config.RUN_DEFINING` (other weights or other
batches: another run) is refused unless `train.allow_changed` names it; any
other change (lr, schedule, steps, clipping, logging, layout) takes effect and
is listed in one line. The LR schedule is this config's, at the checkpoint's
position. The layout-free files themselves are `pipekit.checkpoint`'s.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from ..atomic import fsync_dir
from ..checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_meta,
    save_checkpoint,
    skipped_note,
    step_dir,
)
from ..config import RUN_DEFINING, Config, Run
from ..data import fingerprint, source_dir
from ..engine import PipelineEngine
from ..interchange import checkpoint_dir
from ..optim.lr import CycledBetas
from ..topology import Topology


def checkpoint_root(cfg: Config) -> str | None:
    """Where this run's checkpoints go: checkpoint.dir, else {logging.out_dir}/checkpoints, else nowhere."""
    if cfg.checkpoint.dir:
        return cfg.checkpoint.dir
    return os.path.join(cfg.logging.out_dir, "checkpoints") if cfg.logging.out_dir else None


def clear_old_checkpoints(cfg: Config, topo: Topology) -> None:
    """A fresh run must not leave another run's checkpoints where `train.resume=auto` would
    find them: with logging.overwrite they are deleted (and the abandoned branches with them),
    otherwise the run refuses to start."""
    root = checkpoint_root(cfg)
    old = list_checkpoints(root) if root else []
    if not old:
        return
    if not cfg.logging.overwrite:
        raise CheckpointError(f"{root} holds checkpoints of another run (up to step {old[-1][0]}); continue it with "
                              f"train.resume=auto, or pass logging.overwrite=true to start afresh and delete them")
    if dist.is_initialized():
        dist.barrier()  # every rank has looked before rank 0 deletes
    if topo.rank == 0 and root:
        for path in [p for _, p in old] + [os.path.join(root, ABANDONED)]:
            shutil.rmtree(path, ignore_errors=True)


def is_own(cfg: Config, path: str) -> bool:
    """Whether checkpoint `path` lies in this run's checkpoint root (else it is another run's)."""
    root = checkpoint_root(cfg)
    return root is not None and os.path.realpath(os.path.dirname(os.path.abspath(path))) == os.path.realpath(root)


def launch_id() -> str | None:
    """This launch's identity, the same on every rank and every restart of it: the pipekit
    launcher's PIPEKIT_LAUNCH, else torchrun's run id (None when neither names one)."""
    found = os.environ.get("PIPEKIT_LAUNCH") or os.environ.get("TORCHELASTIC_RUN_ID")
    return found if found and found != "none" else None


def _saved_by_this_launch(root: str) -> str | None:
    """The newest complete checkpoint under `root` that this launch saved (any newest one when
    the launch has no identity), or None."""
    me = launch_id()
    for _, path in reversed(list_checkpoints(root)):
        try:
            if me is None or read_meta(path).get("launch") == me:
                return path
        except CheckpointError:
            continue
    return None


def resume_path(cfg: Config) -> str | None:
    """The checkpoint this run continues from: `train.resume` (a checkpoint, a checkpoints
    root: its newest complete one, or "auto": the newest complete one under checkpoint_root,
    or none). After a torchrun restart: the newest checkpoint this launch saved (its
    identity is in each checkpoint, `launch_id`), else where this launch started: the
    same choice as its first attempt, so a restart of a rollback to an older step never
    continues on the branch being left."""
    wanted = cfg.train.resume
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    root = checkpoint_root(cfg)
    if restarted and root:
        own = _saved_by_this_launch(root)
        if own:
            return own
    if wanted is None:
        return None
    if wanted == "auto":
        return latest_checkpoint(root) if root else None
    try:  # a checkpoints root (as generate and convert take it): its newest complete checkpoint
        return checkpoint_dir(wanted, say=False) if os.path.isdir(wanted) else wanted
    except (OSError, CheckpointError):
        return wanted  # not a checkpoint: the pre-launch check says what it is


def resume(run: Run, topo: Topology, engine: PipelineEngine) -> tuple[int, str | None]:
    """Load the checkpoint to resume from, if any, into `engine` (weights, optimizer state,
    the LR schedule's position, loss scale, RNG); returns (the number of steps already done,
    the checkpoint's path). Collective: rank 0 chooses the checkpoint and every rank loads it."""
    cfg = run.config
    chosen = [resume_path(cfg) if topo.rank == 0 else None]
    if dist.is_initialized() and topo.world_size > 1:
        dist.broadcast_object_list(chosen, src=0)
    path = chosen[0]
    if path is None:
        if cfg.train.resume == "auto" and topo.rank == 0:  # the usual first launch of a resumable job
            print(f"pipekit: train.resume=auto: no checkpoint under {checkpoint_root(cfg)} yet; starting at step 0",
                  flush=True)
        return 0, None
    changed = compare_settings(read_meta(path), run, path)
    meta = load_checkpoint(path, engine.module, engine.optimizer)
    if engine.lr_scheduler is not None and meta.get("lr_scheduler"):
        _restore_schedule(engine, int(meta["lr_scheduler"]["last_epoch"]))
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and meta.get("loss_scaler"):
        scaler.load_state_dict(meta["loss_scaler"])
    step = int(meta["step"])
    if step > cfg.train.steps:  # (== is a finished run: train() only rewrites model.pt)
        raise CheckpointError(f"checkpoint {path} is at step {step}, past train.steps={cfg.train.steps}; "
                              f"raise train.steps to train on")
    if topo.rank == 0:
        wanted = cfg.train.resume
        if wanted in (None, "auto") or os.path.abspath(wanted) != os.path.abspath(path):  # "the newest" was chosen
            note = skipped_note(os.path.dirname(os.path.abspath(path)), path)
            if note:
                print(note, file=sys.stderr, flush=True)
        print(f"resuming from {path} (step {step})", flush=True)
        if changed:
            print(f"pipekit: changed since the checkpoint: {', '.join(changed)}", flush=True)
        root = checkpoint_root(cfg)
        if root and is_own(cfg, path):
            _start_branch(root, step)
    return step, path


def _restore_schedule(engine: PipelineEngine, last_epoch: int) -> None:
    """Put this config's LR schedule (its peak, floor, warmup and length: a changed
    optimizer.lr takes effect) at the checkpoint's position, and the optimizer's lr with it;
    the same numbers LambdaLR.step gives, so an unchanged config resumes bit for bit."""
    sched, optimizer = engine.lr_scheduler, engine.optimizer
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR) and optimizer is not None  # train.build's
    sched.last_epoch = last_epoch
    lrs = [base * f(last_epoch) for base, f in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = lrs
    if isinstance(sched, CycledBetas):  # a DeepSpeed OneCycle's momentum, at the same step
        sched.set_betas(last_epoch)


ABANDONED = "abandoned"  # under the checkpoint root: checkpoints of branches a resume left


def _start_branch(root: str, step: int) -> None:
    """A resume from `step` of this run, with later checkpoints beside it, starts a new branch:
    move those aside (`{root}/abandoned/<time>-from-step<N>/`) and say so."""
    later = [(s, p) for s, p in list_checkpoints(root) if s > step]
    if not later:
        return
    aside = os.path.join(root, ABANDONED, f"{time.strftime('%Y%m%d-%H%M%S')}-from-step{step}")
    os.makedirs(aside, exist_ok=True)
    for _, p in later:
        os.replace(p, os.path.join(aside, os.path.basename(p)))
    fsync_dir(root)
    print(f"pipekit: resuming from step {step} starts a new branch; the later checkpoints (step "
          f"{', '.join(str(s) for s, _ in later)}) were moved to {aside} (delete them when not needed)", flush=True)


_NOT_COMPARED = ("train.resume", "train.allow_changed", "train.device")  # how to start, not what is trained


def compare_settings(meta: dict, run: Run, path: str) -> list[str]:
    """The settings this config changes from checkpoint `path`'s ("optimizer.lr 0.003 -> 0.001"),
    model ones first; CheckpointError for a change that makes it another run (the model, or a
    key of RUN_DEFINING) unless train.allow_changed names it."""
    allowed = {k.strip() for k in (run.config.train.allow_changed or "").split(",") if k.strip()}
    if meta.get("family") != run.family:
        raise CheckpointError(f"checkpoint {path} was saved from another model ({meta.get('family')}, this config: "
                              f"{run.family}); resume it with the config it was saved with")
    saved_model, mine = meta.get("model_config") or {}, _model_record(run)
    model_diff = sorted(k for k in set(mine) | set(saved_model) if saved_model.get(k) != mine.get(k))
    refused = [k for k in model_diff if f"model.{k}" not in allowed]
    if refused:
        shown = ", ".join(f"{k}={saved_model.get(k)} (this config: {mine.get(k)})" for k in refused[:3])
        raise CheckpointError(f"checkpoint {path} was saved from another model ({run.family}: {shown}); resume it "
                              f"with the config it was saved with, or allow the change with "
                              f"train.allow_changed=model.{refused[0]}")
    changed = [f"model.{k} {saved_model.get(k)} -> {mine.get(k)}" for k in model_diff]
    if "config" not in meta:  # saved before checkpoints recorded their config
        return changed
    theirs, ours = _flat(meta["config"]), _flat(json.loads(json.dumps(asdict(run.config))))
    for key in sorted(set(theirs) | set(ours)):
        if key.startswith("model.") or key in _NOT_COMPARED or theirs.get(key) == ours.get(key):
            continue
        if key in RUN_DEFINING and key not in allowed:
            raise CheckpointError(f"checkpoint {path} was saved with {key}={theirs.get(key)} (this config: "
                                  f"{ours.get(key)}), which makes this another run; resume with {key}="
                                  f"{theirs.get(key)}, or allow the change with train.allow_changed={key}")
        changed.append(f"{key} {theirs.get(key)} -> {ours.get(key)}")
    data = _data_change(meta, run, path, allowed)
    return changed + ([data] if data else [])


def _data_change(meta: dict, run: Run, path: str, allowed: set[str]) -> str | None:
    """"data (train.bin, ...)" when data.source's dataset is not the one checkpoint `path` was
    trained on (the fingerprint it recorded), CheckpointError unless train.allow_changed names
    data; None when it is, or when there is nothing to compare (a checkpoint or dataset from
    before fingerprints, a default corpus not yet prepared, a data.source changed as such)."""
    saved = meta.get("data") or {}
    theirs, source = saved.get("files"), run.config.data.source
    ours = fingerprint(source) if theirs and saved.get("source") == source else None
    if theirs is None or ours is None or ours == theirs:
        return None
    names = ", ".join(sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k)))
    if "data" not in allowed:
        raise CheckpointError(f"checkpoint {path} was trained on other data: {names} in {source_dir(source)} changed "
                              f"since (prepared again?); resume on the data it was trained on, or allow the change "
                              f"with train.allow_changed=data")
    return f"data ({names} in {source_dir(source)})"


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"optimizer.lr": 0.003, ...} of a nested config dict."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


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
                     "seq_len": cfg.train.seq_len, "next_step": step, "files": fingerprint(cfg.data.source)},
            "config": json.loads(json.dumps(asdict(cfg))), "launch": launch_id()}
    return save_checkpoint(step_dir(root, step), engine.module, engine.optimizer, meta=meta, keep=cfg.checkpoint.keep)
